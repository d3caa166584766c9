"""An incident opened by another detector runs the same flow — and waits for a human.

Each adapter raises its real event against the real webhook over the site's ledger: a process
that exits 17 as Megatron-Core does, a trainer loop raising ``SDCReplayMismatch``, a GPU whose
driver asks for a reset. The incident flow (real Prefect API, local backends of
``tests/flows/test_incident.py``) stops the job, cordons the accused node and no other, collects
telemetry, replays where a verified checkpoint allows it, and asks for approval; the policy
allows auto-approval and the replay even finds node-2 faulty, yet nothing is approved on another
detector's word alone: the request expires unanswered.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from db import IncidentState, Ledger
from detection.external import WebhookTarget, report_sdc_mismatch
from flows.cli import app
from flows.incident.approval.form import artifact_key
from flows.webhook import create_app
from flows.webhook.serve import run_in_thread
from flows.webhook.trigger import RecordingTrigger
from recovery.aws.local import LocalAws
from recovery.jobs import JobKind, JobRef
from tests.flows.test_incident import (
    AUTO,
    FAULTY,
    JOB,
    NODES,
    SPARES,
    _artifact,
    build_site,
    local_aws,  # noqa: F401  (the module's moto server, shared)
)

pytestmark = [pytest.mark.usefixtures("prefect_api"), pytest.mark.timeout(180)]

SECRET = "external-detector-secret-0123456789"
ROOT = Path(__file__).resolve().parents[2]
A10G_RESET = (
    ROOT
    / "tests/fixtures/telemetry"
    / "DERIVED_nvidia-smi-q-x_A10G_driver515.105.01_gpu-recovery-action-reset.xml"
)
MEGATRON_EXIT_17 = (
    "import sys; print('Unexpected result tensor(nan) on rank 2 at iteration #37 invocation #1 "
    "(message=\\'loss is NaN\\')', file=sys.stderr); sys.exit(17)"
)


WRAPPER = [sys.executable, "-m", "detection.external.megatron", "--"]


class SDCReplayMismatch(RuntimeError):
    """torchtitan's exception, matched by name."""


def _raise_the_event(adapter: str, url: str, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "SDCGUARD_WEBHOOK_URL": url,
        "SDCGUARD_WEBHOOK_SECRET": SECRET,
        "SDCGUARD_JOB_ID": JOB,
        "SDCGUARD_EXTERNAL_SPOOL": str(tmp_path / "spool"),
        "NODE_NAME": FAULTY,
        "RANK": str(NODES.index(FAULTY)),
    }
    if adapter == "megatron":
        done = subprocess.run(
            [*WRAPPER, sys.executable, "-c", MEGATRON_EXIT_17],
            env=env,
            capture_output=True,
            timeout=60,
            cwd=ROOT,
        )
        assert done.returncode == 17, done.stderr
    elif adapter == "torchtitan":
        target = WebhookTarget(url, SECRET, tmp_path / "spool")
        with pytest.raises(SDCReplayMismatch, match="step 37"):
            _train(target)
    else:
        result = CliRunner().invoke(
            app, ["external", "health", "--nvidia-smi-xml", str(A10G_RESET)], env=env
        )
        assert result.exit_code == 0, result.output


def _train(target: WebhookTarget) -> None:
    """A trainer's loop with the adapter around its step; torchtitan's replay trips on step 37."""
    for step in range(30, 40):
        with report_sdc_mismatch(step=step, job_id=JOB, node=FAULTY, rank=2, target=target):
            if step == 37:
                raise SDCReplayMismatch("replay of step 37 differs")


@pytest.mark.parametrize("adapter", ["megatron", "torchtitan", "health"])
def test_another_detectors_alarm_runs_the_flow_to_a_human_and_is_never_auto_approved(
    adapter: str,
    tmp_path: Path,
    sqlite_ledger: Ledger,
    local_aws: LocalAws,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SDCGUARD_FLOW_APPROVAL_POLL_S", "1")
    site = build_site(tmp_path, sqlite_ledger, local_aws, first_alarm=False)
    try:
        trigger = RecordingTrigger()
        webhook = create_app(sqlite_ledger, trigger, SECRET, reads_per_s=1e6)
        with run_in_thread(webhook) as url:
            _raise_the_event(adapter, url, tmp_path)
            assert trigger.wait_for(1, timeout=30)
        [(incident_id, job_id)] = trigger.calls
        assert job_id == JOB
        site.incident_id = incident_id

        site.respond(AUTO.model_copy(update={"approval_timeout_s": 5}))  # time to publish

        incident = site.incident()
        [alarm] = incident.alarms
        assert (alarm.layer, alarm.phase, alarm.suspect_nodes) == ("external", adapter, [FAULTY])
        moved = [e.to_state for e in incident.history if e.from_state != e.to_state]
        assert IncidentState.AWAITING_APPROVAL in moved
        assert incident.state is IncidentState.EXPIRED  # nobody answered: nothing approved
        assert (incident.decision, incident.approver) == ("expire", None)
        assert (incident.evidence or {})["approval_request"]["nodes"] == [FAULTY]
        cordoned = [n for n in NODES + SPARES if site.cluster.node(n).unschedulable]
        assert cordoned == [FAULTY]  # the accused node, and no other
        assert [v for v, _ in site.effects.done if v == "replace"] == []
        telemetry = (incident.evidence or {})["telemetry"]
        assert set(telemetry) == {FAULTY}
        evidence = _artifact(artifact_key(incident_id, "evidence"))
        if adapter == "health":
            # no step known: no verified checkpoint before it, so no replay, and a human decides
            assert incident.verdict is not None
            assert incident.verdict.value == "inconclusive"
        else:
            # the replay from checkpoint 29 implicates node-2, and still the policy refuses
            assert incident.verdict is not None
            assert incident.verdict.value == "hardware"
            assert "another detector's alarm" in evidence
    finally:
        site.jobs.stop(JobRef(JOB, kind=JobKind.LOCAL))
