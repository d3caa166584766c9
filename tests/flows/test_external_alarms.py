"""``POST /v1/external-alarms`` and the three adapters, each a real event against the real webhook.

A real process that exits 16 or 17 as Megatron-Core's rerun state machine does, a trainer loop
that raises ``SDCReplayMismatch``, and a health reading from ``nvidia-smi -q -x`` each open an
incident naming the right node — and a clean run of each records nothing. The webhook runs on
loopback (``tests/flows/conftest.py``) over SQLite and PostgreSQL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from detection.external import WebhookTarget, report_sdc_mismatch
from detection.transport.sender import drain_spool, find_spools
from flows.cli import app
from tests.flows.conftest import Webhook, alarm_payload, ranks_payload, row_counts

JOB = "job-ext"
ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "telemetry"
A10G = FIXTURES / "nvidia-smi-q-x_A10G_driver515.105.01.xml"
A10G_RESET = FIXTURES / "DERIVED_nvidia-smi-q-x_A10G_driver515.105.01_gpu-recovery-action-reset.xml"
KMSG_79 = FIXTURES / "kmsg_xid48-63-94_dbe-rowremap-contained_dmesg-iso.log"

pytestmark = pytest.mark.timeout(90)


class SDCReplayMismatch(RuntimeError):
    """torchtitan's exception, by name: torchtitan is not installed here."""


def _payload(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "alarm_id": str(uuid.uuid4()),
        "job_id": JOB,
        "source": "megatron",
        "kind": "exit-17",
        "evidence": {"exit_code": 17},
        "sent_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
    }
    body.update(fields)
    return {k: v for k, v in body.items() if v is not None}


def _env(webhook: Webhook, tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "SDCGUARD_WEBHOOK_URL": webhook.url,
        "SDCGUARD_WEBHOOK_SECRET": webhook.secret,
        "SDCGUARD_JOB_ID": JOB,
        "SDCGUARD_EXTERNAL_SPOOL": str(tmp_path / "spool"),
        **extra,
    }


def _external_alarms(webhook: Webhook) -> list[Any]:
    incident = webhook.ledger.open_incident_for(JOB)
    return [] if incident is None else [a for a in incident.alarms if a.layer == "external"]


def _megatron_rank(code: int, rank: int, *, names_rank: int | None) -> list[str]:
    """A rank's command that ends as Megatron's does: the log line on the rank that saw it."""
    line = (
        ""
        if names_rank is None
        else f"Unexpected result tensor(nan) on rank {names_rank} at iteration #37 "
        "invocation #1 (message='loss is NaN')"
    )
    script = (
        "import sys; print('iteration 36 lm loss 2.1'); "
        f"print({line!r}, file=sys.stderr); sys.exit({code})"
    )
    return [sys.executable, "-c", script]


@pytest.mark.parametrize("code", [16, 17])
def test_a_megatron_rank_exiting_with_its_code_opens_an_incident_on_its_node(
    webhook: Webhook, tmp_path: Path, code: int
) -> None:
    assert webhook.post(f"/v1/jobs/{JOB}/ranks", ranks_payload(8, 4)).status_code == 200
    wrapped = [sys.executable, "-m", "detection.external.megatron", "--"]
    done = subprocess.run(
        [*wrapped, *_megatron_rank(code, 6, names_rank=6)],
        env=_env(webhook, tmp_path, NODE_NAME="node-1", RANK="6"),
        capture_output=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == code  # the scheduler sees Megatron's own code
    assert b"iteration 36 lm loss" in done.stdout  # the rank's output passes through
    [alarm] = _external_alarms(webhook)
    assert (alarm.phase, alarm.node, alarm.step, alarm.suspect_nodes) == (
        "megatron",
        "node-1",
        37,
        ["node-1"],
    )
    assert alarm.detail["kind"] == f"exit-{code}"
    assert webhook.trigger.wait_for(1, timeout=30)  # the incident's flow is started
    assert webhook.trigger.calls == [(alarm.incident_id, JOB)]


def test_megatron_ranks_that_exit_cleanly_or_only_follow_the_exit_record_nothing(
    webhook: Webhook, tmp_path: Path
) -> None:
    wrapped = [sys.executable, "-m", "detection.external.megatron", "--"]
    for code, rank, named in ((0, 1, None), (1, 1, None), (16, 1, 6)):
        done = subprocess.run(
            [*wrapped, *_megatron_rank(code, rank, names_rank=named)],
            env=_env(webhook, tmp_path, NODE_NAME="node-0", RANK=str(rank)),
            capture_output=True,
            timeout=60,
            cwd=ROOT,
        )
        assert done.returncode == code
    assert webhook.ledger.open_incident_for(JOB) is None
    assert row_counts(webhook.ledger)["alarms"] == 0


def test_a_trainer_raising_sdc_replay_mismatch_reports_and_re_raises(
    webhook: Webhook, tmp_path: Path
) -> None:
    target = WebhookTarget(webhook.url, webhook.secret, tmp_path / "spool")
    raised = SDCReplayMismatch("replay of step 12 differs: loss 2.31 vs 2.29")
    seen: list[int] = []

    def train() -> None:
        for step in range(20):
            with report_sdc_mismatch(step=step, job_id=JOB, node="node-3", rank=13, target=target):
                seen.append(step)
                if step == 12:
                    raise raised

    with pytest.raises(SDCReplayMismatch) as caught:
        train()
    assert caught.value is raised  # the trainer's own exception, unchanged
    assert seen == list(range(13))
    [alarm] = _external_alarms(webhook)
    assert (alarm.phase, alarm.node, alarm.rank, alarm.step) == ("torchtitan", "node-3", 13, 12)
    assert alarm.detail["evidence"]["exception"].endswith("SDCReplayMismatch")


def test_a_clean_trainer_and_other_errors_report_nothing(webhook: Webhook, tmp_path: Path) -> None:
    target = WebhookTarget(webhook.url, webhook.secret, tmp_path / "spool")
    for step in range(5):
        with report_sdc_mismatch(step=step, job_id=JOB, node="node-3", rank=1, target=target):
            pass
    with (
        pytest.raises(ValueError, match="a bug"),
        report_sdc_mismatch(step=5, job_id=JOB, node="node-3", rank=1, target=target),
    ):
        raise ValueError("a bug, not SDC")
    assert row_counts(webhook.ledger)["alarms"] == 0


def test_a_gpu_asking_for_a_reset_is_reported_and_a_healthy_one_is_not(
    webhook: Webhook, tmp_path: Path
) -> None:
    runner = CliRunner()
    env = _env(webhook, tmp_path, NODE_NAME="node-2")
    healthy = runner.invoke(app, ["external", "health", "--nvidia-smi-xml", str(A10G)], env=env)
    assert healthy.exit_code == 0, healthy.output
    assert "no health event" in healthy.output
    assert row_counts(webhook.ledger)["alarms"] == 0

    stuck = runner.invoke(app, ["external", "health", "--nvidia-smi-xml", str(A10G_RESET)], env=env)
    assert stuck.exit_code == 0, stuck.output
    [alarm] = _external_alarms(webhook)
    assert (alarm.phase, alarm.node, alarm.detail["kind"]) == (
        "health",
        "node-2",
        "gpu-recovery-action-gpu-reset",
    )
    assert alarm.detail["step_known"] is False
    assert alarm.step == 0
    again = runner.invoke(app, ["external", "health", "--nvidia-smi-xml", str(A10G_RESET)], env=env)
    assert again.exit_code == 0
    assert len(_external_alarms(webhook)) == 1  # a GPU stuck since is one event, not one a poll


def test_critical_xids_in_a_real_kernel_log_are_reported(webhook: Webhook, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        ["external", "health", "--kernel-log", str(KMSG_79)],
        env=_env(webhook, tmp_path, NODE_NAME="node-2"),
    )
    assert result.exit_code == 0, result.output
    kinds = sorted(a.detail["kind"] for a in _external_alarms(webhook))
    assert kinds
    assert all(k.startswith("xid-") for k in kinds)
    assert all(a.node == "node-2" for a in _external_alarms(webhook))


def test_a_rank_alone_is_placed_by_the_rank_map_and_an_unknown_rank_is_refused(
    webhook: Webhook,
) -> None:
    assert webhook.post(f"/v1/jobs/{JOB}/ranks", ranks_payload(8, 4)).status_code == 200
    placed = webhook.post("/v1/external-alarms", _payload(rank=5, step=40))
    assert placed.status_code == 202, placed.text
    [alarm] = _external_alarms(webhook)
    assert (alarm.node, alarm.suspect_nodes, alarm.suspect_ranks) == ("node-1", ["node-1"], [5])

    before = row_counts(webhook.ledger)
    unknown = webhook.post("/v1/external-alarms", _payload(rank=99))
    assert unknown.status_code == 422
    assert "rank 99 is not in job" in unknown.text
    assert row_counts(webhook.ledger) == before


@pytest.mark.parametrize(
    ("fields", "status", "reason"),
    [
        ({}, 422, "names a node or a rank"),
        ({"node": "node-1", "source": "Megatron LM"}, 422, "source"),
        ({"node": "node-1", "step": -3}, 422, "step"),
        ({"node": "node-1", "evidence": {f"k{i}": i for i in range(65)}}, 422, "evidence"),
    ],
)
def test_a_malformed_external_alarm_is_refused_and_writes_nothing(
    webhook: Webhook, fields: dict[str, Any], status: int, reason: str
) -> None:
    before = row_counts(webhook.ledger)
    answer = webhook.post("/v1/external-alarms", _payload(**fields))
    assert answer.status_code == status
    assert reason in answer.text
    assert row_counts(webhook.ledger) == before


def test_an_unsigned_external_alarm_is_refused(webhook: Webhook) -> None:
    answer = webhook.post_raw("/v1/external-alarms", b"{}", {})
    assert answer.status_code == 401


def test_the_external_layer_cannot_be_claimed_through_the_alarm_endpoint(
    webhook: Webhook,
) -> None:
    answer = webhook.post("/v1/alarms", alarm_payload(layer="external", phase="megatron"))
    assert answer.status_code == 422
    assert row_counts(webhook.ledger)["alarms"] == 0


def test_a_re_sent_alarm_is_recorded_once(webhook: Webhook) -> None:
    body = _payload(node="node-1", step=37)
    first = webhook.post("/v1/external-alarms", body)
    second = webhook.post("/v1/external-alarms", body)
    assert (first.status_code, second.status_code) == (202, 202)
    assert second.json() == {"incident_id": first.json()["incident_id"], "duplicate": True}


def test_an_unreachable_webhook_leaves_the_alarm_spooled_for_a_drain(
    webhook: Webhook, tmp_path: Path
) -> None:
    dead = WebhookTarget("http://127.0.0.1:9", webhook.secret, tmp_path / "spool")
    with (
        pytest.raises(SDCReplayMismatch),
        report_sdc_mismatch(step=3, job_id=JOB, node="node-1", rank=4, target=dead, timeout_s=0.2),
    ):
        raise SDCReplayMismatch("differs")
    assert row_counts(webhook.ledger)["alarms"] == 0
    [spool] = find_spools(tmp_path / "spool")
    drained = drain_spool(spool, webhook.url, webhook.secret, timeout_s=30)
    assert (drained.delivered, drained.left) == (1, 0)
    [alarm] = _external_alarms(webhook)
    assert (alarm.node, alarm.step) == ("node-1", 3)
