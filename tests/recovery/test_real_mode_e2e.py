"""Real mode end to end, at the wire: one alarm from a user's own training job to ``resolved``.

``SDCGUARD_RECOVERY_MODE=real`` backends are built by ``flows.wiring.build_backends`` from the
settings, with the official clients pointed at the HTTP-level fake Kubernetes API (its kubelet,
``tests/recovery/fake_kubelet.py``, runs each pod's real command) and at a moto server (HyperPod
and S3). The job is ``tests/recovery/user_job/train.py`` — a script written as a user would,
with the few sdcguard lines and its own S3 uploads — in a PyTorchJob labelled
``sdcguard.io/job-id``. Its node ``hyperpod-<a>`` has bad hardware (a node-bound fault).

The flow runs in this process against the session Prefect server (``prefect_api``); the
webhook is the real app on uvicorn. What differs from production is timing only: poll
intervals of the HyperPod and node-join waits are shortened, and a small "node join" thread
plays EKS, adding the ``hyperpod-<new id>`` node once moto reports the new instance running.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from db import IncidentState, Ledger
from flows.incident import incident_response
from flows.policy import IncidentPolicy
from flows.recovery_settings import AwsSettings, BackendMode, KubeSettings, RecoverySettings
from flows.serve import run_in_thread
from flows.trigger import RecordingTrigger
from flows.webhook import create_app
from flows.wiring import KubeNodeDirectory, build_backends, use_backends
from recovery.aws_local import LocalAws, create_demo_bucket, create_demo_cluster, start_local_aws
from recovery.hyperpod import HyperPod
from recovery.jobs import JOB_ID_LABEL
from recovery.telemetry import packaged_fixture_root
from tests.deploy.rbac import denied, rules_of, used
from tests.recovery.fake_kube import FakeKube
from tests.recovery.fake_kubelet import FakeKubelet

TRAINING_NS = "training"
JOB_ID = "llm-user-7"
BUCKET = "user-checkpoints"
SECRET = "e2e-webhook-secret-0123456789abcdef"
CLUSTER = "sdcguard-e2e"
SCRIPT = Path(__file__).parent / "user_job" / "train.py"
REPO = Path(__file__).resolve().parents[2]
# Three nodes in the job: one of three implicated is no storm at a 50 % share.
AUTO = IncidentPolicy(
    task_retries=1,
    retry_delay_s=0.0,
    approval_timeout_s=60,
    auto_approve=True,
    storm_node_share=0.5,
)


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
@pytest.mark.timeout(600)
def test_one_alarm_from_a_users_job_to_resolved(
    tmp_path: Path,
    aws: LocalAws,
    sqlite_database_url: str,
    prefect_api: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    session = aws.session()
    instances = create_demo_cluster(aws, CLUSTER, 5)
    create_demo_bucket(aws, BUCKET)
    suspect, healthy, other, spare_a, spare_b = (f"hyperpod-{i}" for i in instances)
    ledger = Ledger.from_url(sqlite_database_url)
    stop_join = threading.Event()
    exporter = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    threading.Thread(target=exporter.serve_forever, daemon=True).start()
    credentials = session.get_credentials()
    aws_env = {
        "AWS_ENDPOINT_URL": aws.endpoint_url,
        "AWS_ACCESS_KEY_ID": credentials.access_key,
        "AWS_SECRET_ACCESS_KEY": credentials.secret_key,
        "AWS_SESSION_TOKEN": credentials.token,
        "AWS_DEFAULT_REGION": aws.region,
    }
    with (
        FakeKube() as fake,
        run_in_thread(create_app(ledger, RecordingTrigger(), SECRET)) as webhook_url,
    ):
        for node in (suspect, healthy, other, spare_a, spare_b):
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
        joiner = threading.Thread(target=_node_join, args=(fake, aws, stop_join), daemon=True)
        joiner.start()
        try:
            _run(tmp_path, fake, kubelet, session, ledger, aws, webhook_url, exporter, aws_env,
                 (suspect, healthy, other, spare_a, spare_b), monkeypatch)  # fmt: skip
        finally:
            stop_join.set()
            kubelet.stop()
            exporter.shutdown()


def _run(
    tmp_path: Path,
    fake: FakeKube,
    kubelet: FakeKubelet,
    session: boto3.session.Session,
    ledger: Ledger,
    aws: LocalAws,
    webhook_url: str,
    exporter: http.server.ThreadingHTTPServer,
    aws_env: dict[str, str],
    nodes: tuple[str, str, str, str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    suspect, healthy, other, spare_a, spare_b = nodes
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
    # The job starts (Kueue admitting it, or its owner, unsuspends it the same way).
    import kubernetes.client as k8s

    from recovery.kube import api_client_for_host

    client = api_client_for_host(fake.url, token="t")
    k8s.CustomObjectsApi(client).patch_namespaced_custom_object(
        "kubeflow.org", "v1", TRAINING_NS, "pytorchjobs", "user-run-2026-12-01",
        {"spec": {"runPolicy": {"suspend": False}}}, _content_type="application/merge-patch+json",
    )  # fmt: skip
    first_pods = [p["metadata"]["name"] for p in kubelet.launched]
    assert len(first_pods) == 3
    first_procs = [kubelet._procs[(TRAINING_NS, p)] for p in first_pods]

    incident_id = _wait_for_incident(ledger, kubelet, first_pods)

    kubeconfig = _kubeconfig(tmp_path, fake.url)
    for key, value in {
        "SDCGUARD_RECOVERY_MODE": "real",
        # The operator allows auto-approval server-side; the run's policy alone cannot.
        "SDCGUARD_POLICY_AUTO_APPROVE": "true",
        "SDCGUARD_RECOVERY_CHECKPOINT_BUCKET": BUCKET,
        "SDCGUARD_RECOVERY_CHECKPOINT_ROOT": str(tmp_path / "shared"),
        "SDCGUARD_AWS_ENDPOINT_URL": aws.endpoint_url,
        "SDCGUARD_AWS_REGION": aws.region,
        "SDCGUARD_AWS_HYPERPOD_CLUSTER": CLUSTER,
        "SDCGUARD_KUBE_NAMESPACE": TRAINING_NS,
        "SDCGUARD_KUBE_SPARE_NODES": json.dumps([spare_a, spare_b]),
        "SDCGUARD_KUBE_EXPORTER_PORT": str(exporter.server_address[1]),
        "SDCGUARD_KUBE_STOP_TIMEOUT_S": "60",
        "KUBECONFIG": str(kubeconfig),
    }.items():
        monkeypatch.setenv(key, value)
    recovery = RecoverySettings()
    assert recovery.mode is BackendMode.REAL
    backends = build_backends(
        recovery, database_url=str(ledger.engine.url.render_as_string(hide_password=False)),
        aws=AwsSettings(), kube=KubeSettings(), aws_session=session,
    )  # fmt: skip
    # Timing only: production polls HyperPod and node joins every 10-30 s.
    backends = dataclasses.replace(
        backends,
        hyperpod=HyperPod.from_settings(
            CLUSTER, aws.region, aws.endpoint_url, session=session, poll_interval_s=0.05
        ),
        directory=KubeNodeDirectory(backends.nodes, [spare_a, spare_b], poll_s=0.05),
    )
    with use_backends(backends):
        incident_response(incident_id, AUTO)

    incident = ledger.get_incident(incident_id)
    assert incident.state is IncidentState.RESOLVED, (
        incident.state, incident.verdict, incident.approval_reason, incident.storm_reason,
        [(a.layer, a.phase, a.suspect_nodes) for a in incident.alarms],
        json.dumps(incident.evidence)[:3000],
    )  # fmt: skip
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
        ("batch", "jobs/status", "patch"),  # resume of a batch/v1 Job (PyTorchJob here)
        ("batch", "jobs", "get"),  # batch/v1 Job control reads the Job itself
        ("batch", "jobs", "patch"),  # stop/resume of a batch/v1 Job
        # dcgmi/nvidia-smi/dmesg run over the exec websocket, which the fake API cannot speak
        ("", "pods/exec", "create"),
        ("", "pods/exec", "get"),
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
