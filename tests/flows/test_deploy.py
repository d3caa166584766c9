"""prefect.yaml against a real ``prefect server start`` and a real process worker.

The whole path an operator runs: create the work pools, ``prefect deploy --all``, start a worker,
let the webhook's PrefectTrigger start the incident deployment for a signed alarm, answer the
approval form through Prefect's API as the UI does, and watch the flow — run by the worker in
its own process, on the local backends built from settings — end ``resolved``.

The approval is answered the way an on-call engineer answers it: late. The run suspends (its
process exits), then more than one concurrency-lease period passes (the server's lease is set to
its 30 s minimum here; ``benchmarks/durable_approval.py`` waits out the default 300 s), the worker
is killed and a new one started, and the Prefect server itself is restarted — all before the
answer. The answer then reschedules the run, the new worker re-enters the flow from the top and
the ledger carries it to ``resolved``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL, temporary_settings

from db import CheckpointStatus, IncidentState, Ledger
from detection.transport.signing import signed_headers
from flows.incident.approval.form import ApprovalDecision, submit_decision
from flows.settings import CoordinationSettings
from flows.webhook import create_app
from flows.webhook.serve import run_in_thread
from flows.webhook.trigger import PrefectTrigger
from recovery.aws.local import create_demo_cluster, start_local_aws
from recovery.jobs import JobKind, JobRef
from recovery.local import LocalJobControl
from recovery.local.cluster import LocalCluster, NodeState
from tests.prefect_events import flush
from tests.prefect_processes import (
    PREFECT,
    flow_run_state,
    flow_run_state_full,
    free_port,
    kill,
    prefect_healthy,
    process,
    run_cli,
    wait_for,
)

SECRET = "deploy-test-webhook-secret-0123456789"
NODES = ["node-0", "node-1", "node-2", "node-3"]
SPARES = ["node-4", "node-5"]
JOB = "job-deployed"
HYPERPOD_CLUSTER = "sdc-deploy"
STAND_IN = [sys.executable, "-c", "import time; time.sleep(300)"]


class _ApiBoundTrigger:
    """PrefectTrigger pointed at this test's server from the dispatcher's own thread.

    Prefect's settings context does not follow a new thread, and the test session may have
    another Prefect API active: binding the URL where the trigger fires keeps the two apart.
    """

    def __init__(self, api_url: str) -> None:
        self._api_url = api_url
        self._trigger = PrefectTrigger("incident-response/incident")

    def fire(self, incident_id: str, job_id: str) -> None:
        with temporary_settings({PREFECT_API_URL: self._api_url}):
            self._trigger.fire(incident_id, job_id)


def _post(url: str, path: str, payload: Any) -> httpx.Response:
    body = json.dumps(payload).encode()
    headers = {
        "Content-Type": "application/json",
        **signed_headers("default", SECRET, "POST", path, body),
    }
    return httpx.post(url + path, content=body, headers=headers, timeout=30)


def _seed_job(url: str, ckpt_dir: Path, instance_ids: dict[str, str]) -> dict[int, Path]:
    """The job reports itself to the webhook: ranks, checkpoints 9/19 verified, 29 pending."""
    ranks = [
        {"rank": r, "local_rank": 0, "node": n, "instance_id": instance_ids[n]}
        for r, n in enumerate(NODES)
    ]
    assert _post(url, f"/v1/jobs/{JOB}/ranks", {"ranks": ranks}).status_code == 200
    paths = {}
    for step in (9, 19, 29):
        path = ckpt_dir / f"ckpt-{step:06d}.pt"
        path.write_bytes(f"weights after step {step}\n".encode() * 64)
        body = {
            "step": step,
            "uri": str(path),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "fingerprint": f"{step:032x}",
            "nodes": NODES,
        }
        assert _post(url, f"/v1/jobs/{JOB}/checkpoints", body).status_code < 300
        if step < 29:
            audit = {"step": step + 1, "kind": "loss", "ranks": [0, 1, 2, 3], "passed": True}
            assert _post(url, f"/v1/jobs/{JOB}/audits", audit).status_code < 300
        paths[step] = path
    return paths


def _alarm() -> dict[str, Any]:
    return {
        "alarm_id": str(uuid.uuid4()),
        "job_id": JOB,
        "step": 27,
        "rank": 0,
        "node": "node-0",
        "layer": "audit",
        "phase": "loss",
        "suspect_ranks": [2],
        "suspect_nodes": ["node-2"],
        "detail": {"partner": 3},
        "sent_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


LEASE_S = float(os.environ.get("SDCGUARD_SOAK_LEASE_S", "30"))
"""The server's deployment-concurrency lease: Prefect's minimum (30 s) in ``make test``;
``benchmarks/durable_approval.py`` sets Prefect's default (300 s) and waits that out."""


def test_every_deployment_loads_the_flow_as_its_module() -> None:
    """prefect.yaml names the flow by module, so a worker imports ``flows.incident.flow`` and
    its logs come from the loggers named for that module (``PREFECT_LOGGING_EXTRA_LOGGERS``
    lists ``flows``); a file-path entrypoint would run it as a module named ``flow``."""
    import yaml
    from prefect.flows import load_flow_from_entrypoint

    config = yaml.safe_load((Path(__file__).parents[2] / "prefect.yaml").read_text())
    entrypoints = {d["entrypoint"] for d in config["deployments"]}
    assert entrypoints == {"flows.incident.flow.incident_response"}
    flow = load_flow_from_entrypoint(entrypoints.pop())
    assert flow.fn.__module__ == "flows.incident.flow"
    assert flow.name == "incident-response"


@pytest.mark.slow
@pytest.mark.timeout(600 + int(LEASE_S))
def test_prefect_yaml_deploys_and_a_late_approval_survives_worker_and_server_restarts(
    tmp_path: Path, sqlite_database_url: str
) -> None:
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    state_dir = tmp_path / "state"
    prefect_env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_LOGGING_TO_API_ENABLED": "false",
        "PREFECT_SERVER_CONCURRENCY_INITIAL_DEPLOYMENT_LEASE_DURATION": str(LEASE_S),
    }
    with start_local_aws() as aws:
        ids = create_demo_cluster(aws, HYPERPOD_CLUSTER, len(NODES) + len(SPARES))
        instance_ids = dict(zip(NODES + SPARES, ids, strict=True))
        cluster = LocalCluster.create(state_dir / "cluster.json", NODES, SPARES, instance_ids)
        jobs = LocalJobControl(state_dir / "jobs", command=STAND_IN)
        jobs.launch(JOB, ["--world-size", "4", "--nodes", ",".join(NODES)], tmp_path / "job.log")
        worker_env = {
            **prefect_env,
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "SDCGUARD_DATABASE_URL": sqlite_database_url,
            "SDCGUARD_RECOVERY_STATE_DIR": str(state_dir),
            "SDCGUARD_AWS_ENDPOINT_URL": aws.endpoint_url,
            "SDCGUARD_AWS_HYPERPOD_CLUSTER": HYPERPOD_CLUSTER,
            "SDCGUARD_FLOW_APPROVAL_POLL_S": "1",
            "SDCGUARD_FLOW_DESTRUCTIVE_LEASE_S": "60",  # the API's minimum slot lease
            # moto's dummy credentials: local mode talks only to the moto endpoint above
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": aws.region,
        }
        server = [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)]
        worker = [PREFECT, "worker", "start", "--pool", "sdcguard-local", "--type", "process"]
        try:
            with contextlib.ExitStack() as stack:
                server_proc = stack.enter_context(
                    process(server, prefect_env, tmp_path / "server.log")
                )
                wait_for(
                    "the Prefect server answers", lambda: prefect_healthy(api_url), timeout_s=120
                )
                run_cli(
                    [PREFECT, "work-pool", "create", "sdcguard-local", "--type", "process"],
                    prefect_env,
                )
                run_cli(
                    [PREFECT, "work-pool", "create", "sdcguard-k8s", "--type", "kubernetes"],
                    prefect_env,
                )
                run_cli(
                    [PREFECT, "work-pool", "create", "sdcguard-real", "--type", "process"],
                    prefect_env,
                )
                out = run_cli([PREFECT, "--no-prompt", "deploy", "--all"], prefect_env)
                assert "incident-response/incident-production" in out
                _check_deployments(api_url)

                first_worker = stack.enter_context(
                    process(worker, worker_env, tmp_path / "worker-1.log")
                )
                ledger = stack.enter_context(Ledger.from_url(sqlite_database_url))
                app = create_app(ledger, _ApiBoundTrigger(api_url), SECRET)
                url = stack.enter_context(run_in_thread(app))
                checkpoints = _seed_job(url, tmp_path, instance_ids)
                accepted = _post(url, "/v1/alarms", _alarm())
                assert accepted.status_code == 202, accepted.text
                incident_id = accepted.json()["incident_id"]

                wait_for(
                    "the worker's flow run suspends for approval",
                    lambda: flow_run_state_full(api_url, incident_id) == ("PAUSED", "Suspended"),
                    timeout_s=180,
                )
                suspended_at = time.monotonic()
                assert ledger.get_incident(incident_id).state is IncidentState.AWAITING_APPROVAL
                # nothing holds a claim or a slot across the wait
                assert not [a for a in ledger.actions(incident_id) if a.status.value == "claimed"]
                assert _slots_held(api_url) == 0

                # the worker dies; the server restarts (same database); a new worker comes up
                kill(first_worker)
                kill(server_proc)
                stack.enter_context(process(server, prefect_env, tmp_path / "server-2.log"))
                wait_for("the restarted server answers", lambda: prefect_healthy(api_url), 120)
                # this process's events worker was bound to this URL by the trigger: flush it
                # while the server is up, so it never drains into a stopped one later
                stack.callback(_flush_events_to, api_url)
                stack.enter_context(process(worker, worker_env, tmp_path / "worker-2.log"))
                wait_for(
                    "more than one lease period to pass",
                    lambda: time.monotonic() - suspended_at > LEASE_S + 5,
                    timeout_s=LEASE_S + 60,
                    poll_s=1,
                )
                assert flow_run_state_full(api_url, incident_id) == ("PAUSED", "Suspended")

                decision = ApprovalDecision(
                    decision="approve", approver="oncall@example.com", reason="node-2"
                )
                with temporary_settings({PREFECT_API_URL: api_url}):
                    submit_decision(incident_id, decision, timeout_s=60)
                wait_for(
                    "the re-entered flow run completes",
                    lambda: flow_run_state(api_url, incident_id) == "COMPLETED",
                    timeout_s=180,
                )

                incident = ledger.get_incident(incident_id)
                assert incident.state is IncidentState.RESOLVED, incident.reason
                assert incident.approver == "oncall@example.com"
                assert cluster.records()[2].state is NodeState.GONE
                statuses = {c.step: c.status for c in ledger.list_checkpoints(JOB)}
                assert statuses[29] is CheckpointStatus.QUARANTINED
                resumed = json.loads((state_dir / "jobs" / f"{JOB}.json").read_text())
                assert resumed["launches"][-1]["args"][-4:] == [
                    "--resume-from",
                    str(checkpoints[19]),
                    "--nodes",
                    "node-0,node-1,node-6,node-3",
                ]
                assert _slots_held(api_url) == 0
        finally:
            jobs.stop(JobRef(JOB, kind=JobKind.LOCAL))


def _check_deployments(api_url: str) -> None:
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        deployments = {d.name: d for d in client.read_deployments()}
    assert set(deployments) == {"incident", "incident-real", "incident-production"}
    for deployment in deployments.values():
        # no deployment-wide limit: containment never queues, a suspended run holds nothing
        assert deployment.global_concurrency_limit is None
        assert deployment.enforce_parameter_schema
        # a module entrypoint: the flow is imported as flows.incident.flow, whose logger is
        # named for its module (a file path would load it as a module named ``flow``)
        assert deployment.entrypoint == "flows.incident.flow.incident_response"
    local, production = deployments["incident"], deployments["incident-production"]
    assert local.work_pool_name == "sdcguard-local"
    assert production.work_pool_name == "sdcguard-k8s"
    assert deployments["incident-real"].work_pool_name == "sdcguard-real"
    assert production.pull_steps == [
        {"prefect.deployments.steps.set_working_directory": {"directory": "/opt/sdcguard"}}
    ]
    # secrets only via blocks: the production deployment names a block, carries no secret
    env = production.job_variables["env"]
    assert env["SDCGUARD_RECOVERY_DATABASE_SECRET_BLOCK"] == "sdcguard-database-url"
    assert not any("URL" in key and "DATABASE" in key for key in env)


def _slots_held(api_url: str) -> int:
    """Active slots of the destructive limit (0 when the flow has not created it yet)."""
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        limits = {c.name: c for c in client.read_global_concurrency_limits()}
    limit = limits.get(CoordinationSettings().destructive_limit)
    return 0 if limit is None else int(limit.active_slots)


def _flush_events_to(api_url: str) -> None:
    with temporary_settings({PREFECT_API_URL: api_url}):
        flush()
