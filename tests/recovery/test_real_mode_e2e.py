"""Real mode end to end, at the wire: one alarm from a user's own training job to ``resolved``,
through the incident deployment of ``prefect.yaml`` that a process worker runs.

The job is ``tests/recovery/user_job/train.py`` — a script written as a user would, with the
few sdcguard lines and its own S3 uploads — in a PyTorchJob labelled ``sdcguard.io/job-id`` on
the HTTP-level fake Kubernetes API, whose kubelet (``tests/recovery/fake_kubelet.py``) runs each
pod's real command. Its node ``hyperpod-<a>`` has bad hardware (a node-bound fault). AWS is a
moto server with the HyperPod extension (HyperPod and S3).

What an operator runs, each its own process: ``prefect deploy --name incident-real`` (the
process-pool deployment of ``prefect.yaml``, real backends; the operator's policy allows
auto-approval), ``prefect worker start --pool sdcguard-real`` whose flow-run process builds the
real backends from its environment (``SDCGUARD_RECOVERY_MODE=real``, a kubeconfig naming the
fake API, ``SDCGUARD_AWS_ENDPOINT_URL`` naming moto), and ``sdcguard serve --trigger prefect``,
which receives the job's alarm and starts the deployment. The Prefect server is the session's.
What differs from production is timing only: the HyperPod and node-join polls are shortened by
their settings, and a small "node join" thread plays EKS, adding the ``hyperpod-<new id>`` node
once moto reports the new instance running.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import kubernetes.client as k8s
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.workers.process import ProcessWorker

from db import IncidentState, Ledger
from flows.incident.wiring import build_backends
from flows.logs import PREFECT_LOGGING_CONFIG
from recovery.aws.local import LocalAws, create_demo_bucket, create_demo_cluster, start_local_aws
from recovery.jobs import RESUME_ENV_FROM_ANNOTATION, JobKind, ResumeOutcome, StopOutcome
from recovery.kube.client import api_client_for_host
from recovery.kube.jobs import JOB_ID_LABEL
from recovery.telemetry import packaged_fixture_root
from tests.deploy.rbac import denied, rules_of, used
from tests.prefect_processes import (
    PREFECT,
    REPO,
    flow_run_state,
    flow_run_state_full,
    free_port,
    process,
    wait_for,
)
from tests.recovery.fake_exec import ExecResult
from tests.recovery.fake_kube import FakeKube
from tests.recovery.fake_kubelet import FakeKubelet

TRAINING_NS = "training"
JOB_ID = "llm-user-7"
BUCKET = "user-checkpoints"
SECRET = "e2e-webhook-secret-0123456789abcdef"
CLUSTER = "sdcguard-e2e"
SCRIPT = Path(__file__).parent / "user_job" / "train.py"
POOL = "sdcguard-real"
DEPLOYMENT = "incident-response/incident-real"
# The operator's policy for this cluster, given at deploy time. Three nodes in the job: one
# implicated node is no storm (the share rule needs two).
POLICY = {
    "action": "replace",
    "auto_approve": True,
    "approval_timeout_s": 60,
    "task_retries": 1,
    "retry_delay_s": 0.0,
}


class _Exporter(http.server.BaseHTTPRequestHandler):
    """A dcgm-exporter: serves a real exporter output."""

    body = (packaged_fixture_root() / "_default" / "dcgm-exporter.prom").read_bytes()
    scraped: list[str] = []

    def do_GET(self) -> None:
        self.scraped.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def aws() -> Iterator[LocalAws]:
    with start_local_aws() as local:
        yield local


def _node_join(fake: FakeKube, aws: LocalAws, stop: threading.Event) -> None:
    """Plays EKS: a HyperPod instance that is Running joins as node ``hyperpod-<id>``."""
    client = aws.session().client("sagemaker", endpoint_url=aws.endpoint_url)
    while not stop.wait(0.05):
        nodes = client.list_cluster_nodes(ClusterName=CLUSTER)["ClusterNodeSummaries"]
        for node in nodes:
            name = f"hyperpod-{node['InstanceId']}"
            if node["InstanceStatus"]["Status"] == "Running":
                try:
                    fake.node(name)
                except KeyError:
                    fake.add_node(name, instance_id=node["InstanceId"])


def _user_job(fake: FakeKube, nodes: list[str], env: dict[str, str]) -> None:
    container = {
        "name": "pytorch",
        "image": "registry.example/user-train:3",
        "command": ["python", str(SCRIPT)],
        "env": [
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            *({"name": k, "value": v} for k, v in env.items()),
        ],
        "resources": {"limits": {"nvidia.com/gpu": 1}},
    }
    fake.add_pytorchjob(
        "user-run-2026-12-01", namespace=TRAINING_NS, replicas={"Master": 1, "Worker": 2},
        containers=[container], suspend=True,
    )  # fmt: skip
    fake.mutate(
        "/apis/kubeflow.org/v1", "pytorchjobs", "user-run-2026-12-01",
        lambda o: o["metadata"].setdefault("labels", {}).update({JOB_ID_LABEL: JOB_ID}),
        namespace=TRAINING_NS,
    )  # fmt: skip
    # The operator places the two pods on the job's nodes (a node affinity of the user's).
    fake.mutate(
        "/apis/kubeflow.org/v1", "pytorchjobs", "user-run-2026-12-01",
        lambda o: [
            r["template"]["spec"].update(affinity={"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In",
                                           "values": nodes}]}]}}})
            for r in o["spec"]["pytorchReplicaSpecs"].values()
        ],
        namespace=TRAINING_NS,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)  # a hang guard: about 2 min on an idle machine, 9 at load 28
def test_one_alarm_from_a_users_job_to_resolved(
    tmp_path: Path, aws: LocalAws, sqlite_database_url: str, prefect_api: str
) -> None:
    session = aws.session()
    instances = create_demo_cluster(aws, CLUSTER, 5)
    create_demo_bucket(aws, BUCKET)
    nodes = tuple(f"hyperpod-{i}" for i in instances)
    suspect, healthy, other, spare_a, spare_b = nodes
    credentials = session.get_credentials()
    aws_env = {
        "AWS_ENDPOINT_URL": aws.endpoint_url,
        "AWS_ACCESS_KEY_ID": credentials.access_key,
        "AWS_SECRET_ACCESS_KEY": credentials.secret_key,
        "AWS_SESSION_TOKEN": credentials.token,
        "AWS_DEFAULT_REGION": aws.region,
    }
    exporter = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    threading.Thread(target=exporter.serve_forever, daemon=True).start()
    stop_join = threading.Event()
    webhook_port = free_port()
    prefect_env = {**os.environ, "PREFECT_API_URL": prefect_api}
    _create_pool(prefect_api)
    with contextlib.ExitStack() as stack:
        fake = stack.enter_context(FakeKube())
        fake.on_exec(_diagnostic_container)
        stack.callback(exporter.shutdown)
        # What the operator runs: the deployment, its worker, the webhook. They start together
        # (each a Python process importing Prefect) while the test cluster is set up.
        deploy = stack.enter_context(process(
            [PREFECT, "--no-prompt", "deploy", "--name", "incident-real",
             "--params", json.dumps({"policy": POLICY})],
            prefect_env, tmp_path / "deploy.log",
        ))  # fmt: skip
        worker_log = tmp_path / "worker.log"
        worker_env = {
            **prefect_env,
            **_operator_env(tmp_path, fake.url, aws, sqlite_database_url, exporter),
            "SDCGUARD_KUBE_SPARE_NODES": json.dumps([spare_a, spare_b]),
            **{k: v for k, v in aws_env.items() if k != "AWS_ENDPOINT_URL"},
        }
        stack.enter_context(process(
            [PREFECT, "worker", "start", "--pool", POOL, "--type", "process"],
            worker_env, worker_log,
        ))  # fmt: skip
        webhook_url = f"http://127.0.0.1:{webhook_port}"
        stack.enter_context(process(
            [sys.executable, "-m", "flows.cli", "serve", "--port", str(webhook_port),
             "--trigger", "prefect"],
            {
                **prefect_env,
                "SDCGUARD_WEBHOOK_SECRET": SECRET,
                "SDCGUARD_DATABASE_URL": sqlite_database_url,
                "SDCGUARD_PREFECT_DEPLOYMENT": DEPLOYMENT,
                "SDCGUARD_LOG_FORMAT": "json",
            },
            tmp_path / "webhook.log",
        ))  # fmt: skip
        for node in nodes:
            fake.add_node(node, instance_id=node.removeprefix("hyperpod-"))
        fake.add_pod(
            "dcgm-exporter-x1", namespace="gpu-operator", node=suspect,
            labels={"app": "nvidia-dcgm-exporter"},
        )  # fmt: skip
        fake.mutate(
            "/api/v1", "pods", "dcgm-exporter-x1",
            lambda o: o["status"].update(podIP="127.0.0.1"), namespace="gpu-operator",
        )  # fmt: skip
        kubelet = FakeKubelet(fake, tmp_path, env={"PYTHONPATH": str(REPO)}).start()
        stack.callback(kubelet.stop)
        joiner = threading.Thread(target=_node_join, args=(fake, aws, stop_join), daemon=True)
        joiner.start()
        stack.callback(stop_join.set)
        _user_job(fake, [suspect, healthy, other], {
            "SDCGUARD_CONTRACT": "strict",
            "SDCGUARD_JOB_ID": JOB_ID,
            "SDCGUARD_WEBHOOK_URL": webhook_url,
            "SDCGUARD_WEBHOOK_SECRET": SECRET,
            "SDCGUARD_CHECKPOINT_URI_PREFIX": f"s3://{BUCKET}/{JOB_ID}",
            "FAULT": f"act-flip@node={suspect}:from=10",
            "TRAIN_STEPS": "400",
            **aws_env,
        })  # fmt: skip
        wait_for("the webhook answers", lambda: _up(webhook_url), timeout_s=120, poll_s=0.2)
        ledger = stack.enter_context(Ledger.from_url(sqlite_database_url))
        _run(fake, kubelet, ledger, prefect_api, worker_log, nodes, deploy)


def _diagnostic_container(namespace: str, pod: str, command: Sequence[str]) -> ExecResult:
    """The diagnostic pod's tools print the healthy outputs (the fixture set ``_default``):
    telemetry cannot clear a node, and the replay still finds the bad hardware."""
    name = {"dcgmi": "dcgmi-diag.json", "dmesg": "kmsg.log", "nvidia-smi": "nvidia-smi-q.xml"}
    return ExecResult(stdout=(packaged_fixture_root() / "_default" / name[command[0]]).read_bytes())


def _operator_env(
    tmp_path: Path,
    kube_url: str,
    aws: LocalAws,
    database_url: str,
    exporter: http.server.ThreadingHTTPServer,
) -> dict[str, str]:
    """The worker's environment, as the operator of a real-mode process worker writes it."""
    return {
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_LOGGING_SETTINGS_PATH": str(PREFECT_LOGGING_CONFIG),
        "SDCGUARD_DATABASE_URL": database_url,
        # The operator allows auto-approval server-side; the run's policy alone cannot.
        "SDCGUARD_POLICY_AUTO_APPROVE": "true",
        "SDCGUARD_RECOVERY_CHECKPOINT_BUCKET": BUCKET,
        "SDCGUARD_RECOVERY_CHECKPOINT_ROOT": str(tmp_path / "shared"),
        "SDCGUARD_AWS_ENDPOINT_URL": aws.endpoint_url,
        "SDCGUARD_AWS_REGION": aws.region,
        "SDCGUARD_AWS_HYPERPOD_CLUSTER": CLUSTER,
        "SDCGUARD_KUBE_NAMESPACE": TRAINING_NS,
        "SDCGUARD_KUBE_EXPORTER_PORT": str(exporter.server_address[1]),
        "SDCGUARD_KUBE_STOP_TIMEOUT_S": "60",
        "KUBECONFIG": str(_kubeconfig(tmp_path, kube_url)),
        # Timing only: production polls HyperPod and node joins every 10 s.
        "SDCGUARD_AWS_HYPERPOD_POLL_S": "0.05",
        "SDCGUARD_KUBE_JOIN_POLL_S": "0.05",
    }


def _create_pool(api_url: str) -> None:
    """``prefect work-pool create sdcguard-real --type process``, through the API."""
    template = ProcessWorker.get_default_base_job_template()
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        client.create_work_pool(
            WorkPoolCreate(name=POOL, type="process", base_job_template=template),
            overwrite=True,
        )


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _run(
    fake: FakeKube,
    kubelet: FakeKubelet,
    ledger: Ledger,
    api_url: str,
    worker_log: Path,
    nodes: tuple[str, ...],
    deploy: subprocess.Popen[bytes],
) -> None:
    suspect, _, _, spare_a, _ = nodes
    # The job starts (Kueue admitting it, or its owner, unsuspends it the same way).
    client = api_client_for_host(fake.url, token="t")
    k8s.CustomObjectsApi(client).patch_namespaced_custom_object(
        "kubeflow.org", "v1", TRAINING_NS, "pytorchjobs", "user-run-2026-12-01",
        {"spec": {"runPolicy": {"suspend": False}}}, _content_type="application/merge-patch+json",
    )  # fmt: skip
    first_pods = [p["metadata"]["name"] for p in kubelet.launched]
    assert len(first_pods) == 3
    first_procs = [kubelet._procs[(TRAINING_NS, p)] for p in first_pods]
    # `prefect deploy` ran while the job started; an alarm before it is done would be fired
    # again by the webhook's trigger retries (1, 2, 5, 15 s ...), as in production
    assert deploy.wait(timeout=180) == 0, "prefect deploy failed (see deploy.log)"

    incident_id = _wait_for_incident(ledger, kubelet, first_pods)
    # The webhook started the deployment; the worker's flow-run process runs it to its end.
    try:
        wait_for(
            "the deployed flow run ends",
            lambda: flow_run_state(api_url, incident_id) in {"COMPLETED", "FAILED", "CRASHED"},
            timeout_s=400,
            poll_s=1,
        )
    except TimeoutError as err:  # say where it stood: the state, the ledger, the worker's log
        stuck = ledger.get_incident(incident_id)
        raise AssertionError(
            f"{err}: flow run {flow_run_state_full(api_url, incident_id)}, incident "
            f"{stuck.state}, actions {[a.kind for a in stuck.actions]}\n"
            + worker_log.read_text()[-4000:]
        ) from err
    incident = ledger.get_incident(incident_id)
    assert incident.state is IncidentState.RESOLVED, (
        incident.state, incident.verdict, incident.approval_reason, incident.storm_reason,
        [(a.layer, a.phase, a.suspect_nodes) for a in incident.alarms],
        json.dumps(incident.evidence)[:3000], worker_log.read_text()[-4000:],
    )  # fmt: skip
    assert flow_run_state(api_url, incident_id) == "COMPLETED"
    # Found by label, stopped: the first pods' processes ended (the pods were deleted; the
    # resumed job's pods carry the same names, as the operator names them).
    assert all(p.poll() is not None for p in first_procs)
    stop = next(a for a in incident.actions if a.kind == "stop-job")
    assert stop.detail is not None
    assert stop.detail.get("stop") == "stopped", stop
    # Cordoned (and the replacement left in service).
    assert fake.node(suspect)["spec"].get("unschedulable") is True
    # Telemetry came from the fake exporter.
    assert any(r.path.startswith("/api/v1/namespaces/gpu-operator/pods") for r in fake.requests)
    assert "/metrics" in _Exporter.scraped  # the suspect node's exporter answered
    # and dcgmi, dmesg and nvidia-smi ran in the diagnostic pod over the exec websocket
    execs = fake.requests_to("GET", r"/api/v1/namespaces/sdcguard/pods/[^/]+/exec")
    assert [r.query["command"][0] for r in execs] == ["dcgmi", "dmesg", "nvidia-smi"]
    # The replay ran the user's own command on the suspect and the spares: hardware.
    assert incident.verdict is not None
    assert incident.verdict.value == "hardware"
    replays = [p for p in kubelet.launched if "sdcguard-replay" in p["metadata"]["name"]]
    assert {p["spec"]["nodeName"] for p in replays} >= {suspect, spare_a}
    for pod in replays:
        (container,) = pod["spec"]["containers"]
        assert container["command"] == ["python", str(SCRIPT)]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert len({p["metadata"]["name"] for p in replays}) == len(replays)
    # Replaced, and resumed on the replacement from an s3:// checkpoint whose sha256 was checked.
    resumed = [p for p in kubelet.launched[len(first_pods) :] if p not in replays]
    assert len(resumed) == 3
    env = {e["name"]: e.get("value") for e in resumed[0]["spec"]["containers"][0]["env"]}
    assert env["SDCGUARD_RESUME_FROM"].startswith(f"s3://{BUCKET}/{JOB_ID}/ckpt-")
    assert suspect not in {p["spec"]["nodeName"] for p in resumed}
    gets = [r for r in fake.requests if r.method == "GET"]
    assert gets  # the cluster was read through the official client
    summary = {a.kind: a for a in ledger.get_incident(incident_id).actions}
    assert "resume" in summary
    assert summary["resume"].detail["checkpoint_uri"].startswith("s3://")
    _check_rbac(fake)
    _check_json_logs(worker_log.read_text(), incident_id, suspect)


def _check_json_logs(output: str, incident_id: str, suspect: str) -> None:
    """The flow-run process logged JSON lines carrying the incident, the job and the node."""
    records = []
    for line in output.splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))
        else:
            # every log record is JSON: a line naming the incident that is not is a bug
            assert incident_id not in line, line
    ours = [r for r in records if str(r.get("logger", "")).startswith("flows.")]
    assert ours, output[-3000:]
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    assert any(r.get("incident") == incident_id and r.get("job") == JOB_ID for r in ours), ours
    assert any(r.get("incident") == incident_id and r.get("node") == suspect for r in ours), ours
    # Prefect's own records of the run are JSON too, with its run's name
    assert any(str(r.get("flow_run_name", "")).endswith(incident_id) for r in records), records[:5]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_users_batch_job_is_found_stopped_and_resumed_from_s3_at_the_wire(
    tmp_path: Path,
    aws: LocalAws,
    sqlite_database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stop and resume of the e2e above, for a batch/v1 Job (the e2e's job is a
    PyTorchJob): the real backends built from settings find the Job by its label, stop it (its
    pod's process ends, the pod is gone), and resume it from the s3:// checkpoint the job
    uploaded: the user's new process gets its URI from the pod annotation through the downward
    API (a Job's env is immutable), as the job's own manifest declares."""
    create_demo_bucket(aws, BUCKET)
    credentials = aws.session().get_credentials()
    with contextlib.ExitStack() as stack:
        fake = stack.enter_context(FakeKube())
        fake.add_node("hyperpod-a", instance_id="a")
        kubelet = FakeKubelet(fake, tmp_path, default_nodes=["hyperpod-a"],
                              env={"PYTHONPATH": str(REPO)}).start()  # fmt: skip
        stack.callback(kubelet.stop)
        env = {
            "SDCGUARD_CONTRACT": "strict",
            "SDCGUARD_JOB_ID": JOB_ID,
            # no webhook here: the sender spools and retries in the background
            "SDCGUARD_WEBHOOK_URL": f"http://127.0.0.1:{free_port()}",
            "SDCGUARD_WEBHOOK_SECRET": SECRET,
            "SDCGUARD_CHECKPOINT_URI_PREFIX": f"s3://{BUCKET}/{JOB_ID}",
            "TRAIN_STEPS": "100000",
            "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
            "AWS_ENDPOINT_URL": aws.endpoint_url,
            "AWS_ACCESS_KEY_ID": credentials.access_key,
            "AWS_SECRET_ACCESS_KEY": credentials.secret_key,
            "AWS_SESSION_TOKEN": credentials.token,
            "AWS_DEFAULT_REGION": aws.region,
        }  # fmt: skip
        fake.add_job("user-batch-1", namespace=TRAINING_NS, containers=[{
            "name": "train",
            "image": "registry.example/user-train:3",
            "command": ["python", str(SCRIPT)],
            "env": [
                {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                dict(RESUME_ENV_FROM_ANNOTATION),
                *({"name": k, "value": v} for k, v in env.items()),
            ],
        }], suspend=True)  # fmt: skip
        fake.mutate(
            "/apis/batch/v1", "jobs", "user-batch-1",
            lambda o: o["metadata"].setdefault("labels", {}).update({JOB_ID_LABEL: JOB_ID}),
            namespace=TRAINING_NS,
        )  # fmt: skip
        # the job starts (Kueue admitting it, or its owner, unsuspends it)
        k8s.BatchV1Api(api_client_for_host(fake.url, token="t")).patch_namespaced_job(
            "user-batch-1", TRAINING_NS, {"spec": {"suspend": False}}
        )
        (first,) = kubelet.launched
        process_of = kubelet._procs[(TRAINING_NS, first["metadata"]["name"])]
        s3 = aws.client("s3")

        def checkpoints() -> list[str]:
            listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{JOB_ID}/ckpt-")
            return sorted(o["Key"] for o in listed.get("Contents", []))

        wait_for("the job uploads a checkpoint", lambda: bool(checkpoints()), 120, poll_s=0.2)
        for key, value in {
            "SDCGUARD_RECOVERY_MODE": "real",
            "SDCGUARD_RECOVERY_CHECKPOINT_BUCKET": BUCKET,
            "SDCGUARD_AWS_ENDPOINT_URL": aws.endpoint_url,
            "SDCGUARD_AWS_REGION": aws.region,
            "SDCGUARD_KUBE_NAMESPACE": TRAINING_NS,
            "SDCGUARD_KUBE_STOP_TIMEOUT_S": "60",
            "KUBECONFIG": str(_kubeconfig(tmp_path, fake.url)),
        }.items():
            monkeypatch.setenv(key, value)
        backends = build_backends(database_url=sqlite_database_url, aws_session=aws.session())
        job = backends.catalog.ref(JOB_ID)
        assert (job.kind, job.name) == (JobKind.BATCH_JOB, "user-batch-1")

        stopped = backends.jobs.stop(job)
        assert stopped.outcome is StopOutcome.STOPPED, stopped
        assert process_of.poll() is not None  # the user's process ended
        assert fake.list_objects("/api/v1", "pods", namespace=TRAINING_NS) == []

        key = checkpoints()[0]
        uri = f"s3://{BUCKET}/{key}"
        step = int(re.search(r"ckpt-0*(\d+)", key)[1])  # type: ignore[index]
        resumed = backends.jobs.resume(job, uri, step, None)
        assert resumed.outcome is ResumeOutcome.RESUMED, resumed
        (_, second) = kubelet.launched
        # what the kubelet gave the user's new process: the checkpoint, from the annotation
        resumed_process = kubelet._procs[(TRAINING_NS, second["metadata"]["name"])]
        environ = Path(f"/proc/{resumed_process.pid}/environ").read_bytes().split(b"\0")
        assert f"{RESUME_ENV_FROM_ANNOTATION['name']}={uri}".encode() in environ
        batch = [r for r in fake.requests if r.path.startswith("/apis/batch/v1")]
        assert {r.method for r in batch} >= {"GET", "PATCH"}
        cluster = rules_of("ClusterRole", "sdcguard-recovery")
        namespaced = rules_of("Role", "sdcguard-recovery-telemetry")
        assert denied(batch, cluster, namespaced) == []


def _check_rbac(fake: FakeKube) -> None:
    """The recovery identity's Role allows every request the flow sent, and grants no verb
    beyond those this run used and the few it cannot reach here (named, with the reason)."""
    cluster = rules_of("ClusterRole", "sdcguard-recovery")
    namespaced = rules_of("Role", "sdcguard-recovery-telemetry")
    flow_requests = [
        r for r in fake.requests if r.headers.get("authorization") == "Bearer recovery-token"
    ]
    assert flow_requests
    assert denied(flow_requests, cluster, namespaced) == []
    not_reached_here = {
        ("", "pods/eviction", "create"),  # drain of a node with pods under a budget
        # batch/v1 Job control (the batch Job test checks these requests against the Role)
        ("batch", "jobs/status", "patch"),
        ("batch", "jobs", "get"),
        ("batch", "jobs", "patch"),
        # the exec websocket is authorised as get (this fake, older servers) or create
        ("", "pods/exec", "create"),
    }
    assert (cluster | namespaced) - used(flow_requests) <= not_reached_here


def _wait_for_incident(ledger: Ledger, kubelet: FakeKubelet, pods: list[str]) -> str:
    """The job runs until its guard reports the alarm; wait for the ledger's incident."""
    done = threading.Event()
    found: list[str] = []

    def poll() -> None:
        while not done.wait(0.1):
            incidents = ledger.list_incidents(job_id=JOB_ID)
            if incidents:
                found.append(incidents[0].id)
                done.set()

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    thread.join(timeout=120)
    done.set()
    if not found:
        logs = "\n".join(kubelet.log(TRAINING_NS, p)[-3000:] for p in pods)
        pytest.fail(f"no incident opened; pod logs:\n{logs}")
    return found[0]


def _kubeconfig(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": "u", "user": {"token": "recovery-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}],
    }))  # fmt: skip
    return path


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
