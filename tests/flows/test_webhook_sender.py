"""End to end with the training side's real client: ``detection.transport.sender.AlarmSender``.

What a rank spools is what the webhook records — ranks, checkpoints, audits, alarms — and what
the webhook refuses for good lands in the sender's ``dead/`` with the webhook's reason, not in the
ledger; what it refuses for now (a signature during a key rotation) stays spooled.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from db import Ledger
from detection.identity import RankIdentity
from detection.transport.alarm import Alarm, Layer, Phase
from detection.transport.sender import AlarmSender, drain_spool
from flows.cli import app
from flows.webhook import create_app, dispatcher_of
from flows.webhook.serve import run_in_thread
from flows.webhook.trigger import RecordingTrigger
from tests.flows.conftest import Webhook, row_counts

JOB = "local-1234"
NODES = ["node-0", "node-0", "node-1", "node-1"]


def _identities() -> list[dict[str, object]]:
    return [
        RankIdentity(
            rank=r,
            local_rank=r % 2,
            world_size=4,
            node=NODES[r],
            instance_id=f"i-{r // 2:017x}",
            gpu_uuid=None,
        ).to_dict()
        for r in range(4)
    ]


def _dead_letters(spool: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in sorted((spool / "dead").glob("*.json"))]


def test_a_job_reported_through_the_sender_is_in_the_ledger(
    webhook: Webhook, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    alarm = Alarm.for_ranks(37, Layer.AUDIT, Phase.GRADIENT, [2], NODES, {"max_abs_diff": 12.5})

    with AlarmSender(webhook.url, webhook.secret, JOB, spool) as sender:
        sender.register_ranks(_identities())
        sender.record_checkpoint(
            {
                "step": 30,
                "uri": str(tmp_path / "ckpt-000030.pt"),
                "sha256": "0f" * 32,
                "fingerprint": "a1" * 16,
                "nodes": ["node-0", "node-1"],
            }
        )
        sender.record_audit({"step": 30, "kind": "loss", "ranks": [0, 1, 2, 3], "passed": True})
        alarm_id = sender.send_alarm(alarm.to_webhook(JOB, alarm.reporting_rank(4), "node-0"))
        assert sender.flush(30)

    assert _dead_letters(spool) == []
    assert sorted(webhook.ledger.rank_map(JOB)) == [0, 1, 2, 3]
    (checkpoint,) = webhook.ledger.list_checkpoints(JOB)
    assert (checkpoint.step, checkpoint.status) == (30, "verified")
    (incident,) = webhook.ledger.list_incidents(JOB)
    assert [a.alarm_id for a in incident.alarms] == [alarm_id]
    assert incident.ranks_missing is False
    assert incident.suspect_nodes == ["node-1"]
    assert (incident.suspect_start, incident.suspect_end) == (31, 37)
    assert dispatcher_of(webhook.app).wait_idle(10)
    assert webhook.trigger.calls == [(incident.id, JOB)]


def test_a_sender_with_the_wrong_secret_writes_nothing_and_loses_nothing(
    webhook: Webhook, tmp_path: Path
) -> None:
    """A refused signature (a key rotation in progress, clock skew) keeps the alarm spooled;
    draining the leftover spool with the right key records it once, and the job's re-run,
    which detects the same event again, adds no second alarm."""
    spool = tmp_path / "spool"
    alarm = Alarm.for_ranks(5, Layer.NONFINITE, Phase.PRE_ALLREDUCE, [1], NODES, {})
    before = row_counts(webhook.ledger)

    sender = AlarmSender(
        webhook.url, "a-different-secret-0123456789", JOB, spool, backoff_initial_s=0.01
    )
    try:
        alarm_id = sender.send_alarm(alarm.to_webhook(JOB, 0, "node-0"))
        assert not sender.flush(0.5)
    finally:
        sender.close(timeout_s=0.0)  # the job ends with the alarm still spooled

    assert _dead_letters(spool) == []
    assert row_counts(webhook.ledger) == before
    result = drain_spool(spool, webhook.url, webhook.secret, timeout_s=30)
    assert (result.found, result.delivered, result.left, result.dead) == (1, 1, 0, 0)
    with AlarmSender(webhook.url, webhook.secret, JOB, spool) as rerun:
        assert rerun.send_alarm(alarm.to_webhook(JOB, 2, "node-2")) == alarm_id
        assert rerun.flush(30)
    (incident,) = webhook.ledger.list_incidents(JOB)
    assert [a.alarm_id for a in incident.alarms] == [alarm_id]
    assert _dead_letters(spool) == []


def test_alarms_spooled_while_the_webhook_is_down_arrive_once_it_is_up(
    ledger: Ledger, webhook_secret: str, tmp_path: Path
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spool = tmp_path / "spool"
    alarm = Alarm.for_ranks(
        9, Layer.FINGERPRINT, Phase.WEIGHTS, [3], NODES, {"votes": [1, 1, 1, 0]}
    )

    sender = AlarmSender(f"http://127.0.0.1:{port}", webhook_secret, JOB, spool, timeout_s=2)
    try:
        alarm_id = sender.send_alarm(alarm.to_webhook(JOB, 0, "node-0"))
        assert not sender.flush(0.5), "nothing listens yet: the alarm must stay spooled"

        trigger = RecordingTrigger()
        with run_in_thread(create_app(ledger, trigger, webhook_secret), port=port):
            assert sender.flush(30)
            assert trigger.wait_for(1, timeout=10)
    finally:
        sender.close()

    (incident,) = ledger.list_incidents(JOB)
    assert [a.alarm_id for a in incident.alarms] == [alarm_id]
    assert incident.ranks_missing is True
    assert trigger.calls == [(incident.id, JOB)]


def test_sdcguard_spool_drain_sends_what_a_finished_job_left(
    webhook: Webhook, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks' spools under one job root, left while nothing listened; the command drains
    both into the ledger, and a second drain finds nothing."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{probe.getsockname()[1]}"
    root = tmp_path / "job-spool"
    alarm = Alarm.for_ranks(7, Layer.FINGERPRINT, Phase.WEIGHTS, [3], NODES, {})
    ids = []
    for rank in (0, 1):
        sender = AlarmSender(down, webhook.secret, JOB, root / f"rank-{rank}", timeout_s=1)
        if rank == 0:
            ids.append(sender.send_alarm(alarm.to_webhook(JOB, 0, "node-0")))
        else:
            sender.register_ranks(_identities())
        sender.close(timeout_s=0.0)
    monkeypatch.setenv("SDCGUARD_WEBHOOK_SECRET", webhook.secret)
    runner = CliRunner()
    first = runner.invoke(app, ["spool", "drain", str(root), "--webhook", webhook.url])
    assert first.exit_code == 0, first.output
    assert "1 found, 1 delivered, 0 dead-lettered, 0 left" in first.output
    again = runner.invoke(app, ["spool", "drain", str(root), "--webhook", webhook.url])
    assert again.exit_code == 0, again.output
    assert again.output.count("0 found") == 2
    (incident,) = webhook.ledger.list_incidents(JOB)
    assert [a.alarm_id for a in incident.alarms] == ids
    assert sorted(webhook.ledger.rank_map(JOB)) == [0, 1, 2, 3]
