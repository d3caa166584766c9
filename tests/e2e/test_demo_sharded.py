"""One incident end to end for a sharded job: ``sdcguard demo --parallel hsdp``.

Every job of the demo runs HSDP, 4 ranks as 2 replicas x 2 shards (one rank a node). The
fault-free reference run raises no alarm. In the faulty run node-2's hardware makes its own
gradient NaN from step 12: the sharded guard finds it in rank 2's gradient before the
reduce-scatter and names node-2 (``nonfinite/pre-allreduce``); the alarm opens an incident in
the ledger and the flow runs. A sharded job is not replayed diagnostically, so the replay stage
records ``inconclusive`` with the reason and the flow waits for a person: this test answers the
approval form through the Prefect API, exactly as the UI's Resume does, approving node-2. HyperPod
replaces it; the job resumes from the newest checkpoint the replicas' weight vote verified
before the fault — a ``ckpt-<step>/manifest.json`` directory, checked file by file — with the
same ``--parallel`` options, and ends on the reference's fingerprint bit for bit.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from db import CheckpointStatus, IncidentState, Ledger
from flows.incident.approval.form import ApprovalChoice, ApprovalDecision, submit_decision
from flows.local.demo import run_demo
from flows.local.prefect_server import one_prefect_server
from tests.e2e.demo_checks import check_report, demo_config, processes_under

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api"), pytest.mark.timeout(600)]

JOB = "demo-job"
APPROVER = "oncall@example.com"
REASON = "node-2's own gradient went NaN before the reduce-scatter; no replay for HSDP: replace it"


class Approver(threading.Thread):
    """The person at the form: once the faulty job's incident is in the ledger, approves
    node-2 through the Prefect API (``submit_decision``: what the UI's Resume posts)."""

    def __init__(self, run_dir: Path, timeout_s: float) -> None:
        super().__init__(name="approver", daemon=True)
        self._run_dir = run_dir
        self._timeout_s = timeout_s
        self.error: BaseException | None = None
        self.incident_id: str | None = None

    def run(self) -> None:
        try:
            self.incident_id = self._incident()
            decision = ApprovalDecision(
                decision=ApprovalChoice.APPROVE, approver=APPROVER, reason=REASON, nodes=["node-2"]
            )
            submit_decision(self.incident_id, decision, timeout_s=self._timeout_s)
        except BaseException as err:  # the test's thread reports it
            self.error = err

    def _incident(self) -> str:
        deadline = time.monotonic() + self._timeout_s
        # the faulty job's log exists once the demo has migrated its ledger and launched it
        while not (self._run_dir / f"{JOB}.log").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the faulty job was never launched")
            time.sleep(0.5)
        with Ledger.from_url(f"sqlite:///{self._run_dir / 'ledger.db'}") as ledger:
            while time.monotonic() < deadline:
                incidents = ledger.list_incidents(job_id=JOB)
                if incidents:
                    return incidents[0].id
                time.sleep(0.5)
        raise TimeoutError("no incident of the faulty job in the ledger")


def test_an_hsdp_job_recovers_exactly_through_the_incident_flow(tmp_path: Path) -> None:
    config = demo_config(tmp_path, "grad-nan")
    config.parallel = "hsdp"
    config.approve_in_ui = True
    config.timeout_s = 300.0
    run_dir = config.workdir.resolve() / "run"
    approver = Approver(run_dir, timeout_s=400.0)
    with one_prefect_server(tmp_path / "prefect") as server:
        config.prefect = server
        approver.start()
        report = run_demo(config)
    approver.join(timeout=30)
    assert approver.error is None, repr(approver.error)

    # a clean sharded run is silent; the faulty one is caught and its node named
    assert report["parallel"] == "hsdp"
    assert report["reference_alarms"] == []
    first = report["alarms"][0]
    assert (first["step"], first["layer"], first["phase"]) == (12, "nonfinite", "pre-allreduce")
    assert first["suspect_nodes"] == ["node-2"]
    # every stage completed, node-2 replaced, exact recovery (the DDP demo's checks) — on an
    # inconclusive verdict: the replay stage said why, and a person approved
    check_report(report, config, verdict="inconclusive")
    assert report["approval"]["decision"] == "approve"
    assert (report["approval"]["approver"], report["approval"]["reason"]) == (APPROVER, REASON)
    replay = next(s for s in report["stages"] if s["name"] == "replay")
    assert "a sharded job is not replayed diagnostically" in replay["outcome"]

    # resumed from the newest verified checkpoint before the fault: a sealed directory
    resumed_step = report["resumed_from_step"]
    manifest = Path(report["resumed_checkpoint"])
    assert manifest == run_dir / f"{JOB}-checkpoints" / f"ckpt-{resumed_step:06d}" / "manifest.json"
    assert sorted(json.loads(manifest.read_text())["files"])  # the files it was verified by
    with Ledger.from_url(f"sqlite:///{run_dir / 'ledger.db'}") as ledger:
        incident = ledger.get_incident(report["incident_id"])
        checkpoints = {c.step: c for c in ledger.list_checkpoints(JOB)}
    assert incident.state is IncidentState.RESOLVED, incident.reason
    assert incident.id == approver.incident_id
    verified_before = [
        s
        for s, c in checkpoints.items()
        if s < incident.suspect_start and c.status is CheckpointStatus.VERIFIED
    ]
    assert resumed_step == max(verified_before)
    assert checkpoints[resumed_step].uri == str(manifest)
    # the resumed job kept the sharded layout and took the manifest
    launches = json.loads((run_dir / "jobs" / f"{JOB}.json").read_text())["launches"]
    args = launches[-1]["args"]
    assert args[args.index("--parallel") + 1] == "hsdp"
    assert args[args.index("--shard-size") + 1] == "2"
    assert args[args.index("--resume-from") + 1] == str(manifest)
    recovered = json.loads((run_dir / f"{JOB}.resumed-{resumed_step}.json").read_text())
    assert recovered["alarms"] == []
    assert processes_under(config.workdir.resolve()) == []
