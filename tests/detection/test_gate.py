"""Checkpoint gate: pending → verified only on later evidence; an alarm closes it."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from detection.audit.ring import AuditMode
from detection.gate import (
    CheckpointGate,
    CheckpointNotVerifiedError,
    CheckpointStatus,
    GateClosedError,
    GateError,
    StepOutcome,
)
from detection.guard.state import read_state, state_path
from detection.transport.alarm import Alarm, Layer, Phase
from detection.weights.fingerprint import Fingerprint

FP = Fingerprint(0x1234, 0x5678)
RANKS = (0, 1, 2, 3)


class _Ledger:
    """A provenance sink that remembers what it was sent, in order."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict[str, Any]]] = []

    def record_checkpoint(self, body: dict[str, Any]) -> None:
        self.posts.append(("checkpoint", body))

    def record_audit(self, body: dict[str, Any]) -> None:
        self.posts.append(("audit", body))


def _step(
    step: int,
    *,
    audit: bool = False,
    passed: bool = True,
    alarm: Alarm | None = None,
    vote: bool = True,
) -> StepOutcome:
    return StepOutcome(
        step=step,
        ranks=RANKS,
        fingerprint=FP,
        vote_passed=vote,
        audit=AuditMode.LOSS if audit else None,
        audit_passed=passed,
        alarm=alarm,
    )


def _alarm(step: int) -> Alarm:
    return Alarm.for_ranks(step, Layer.FINGERPRINT, Phase.WEIGHTS, [2], ["n"] * 4, {})


def _write(gate: CheckpointGate, step: int) -> Any:
    def writer(path: Path) -> None:
        path.write_bytes(f"state {step}".encode())

    return gate.write(step, writer)


def test_checkpoint_is_pending_until_a_later_audit_passes(tmp_path: Path) -> None:
    gate = CheckpointGate(tmp_path, audit_every=10)
    gate.observe(_step(5))
    record = _write(gate, 5)
    assert record.status is CheckpointStatus.PENDING
    assert record.fingerprint == FP.hex()
    gate.observe(_step(6))
    assert gate.records[0].status is CheckpointStatus.PENDING
    gate.observe(_step(10, audit=True))
    assert gate.records[0].status is CheckpointStatus.VERIFIED
    assert gate.records[0].evidence == {"kind": "loss", "step": 10}
    assert gate.publish().step == 5


def test_an_audit_at_the_checkpoint_step_verifies_it_at_once(tmp_path: Path) -> None:
    gate = CheckpointGate(tmp_path, audit_every=10)
    gate.observe(_step(10, audit=True))
    assert _write(gate, 10).status is CheckpointStatus.VERIFIED


def test_a_failed_audit_verifies_nothing(tmp_path: Path) -> None:
    gate = CheckpointGate(tmp_path, audit_every=10)
    gate.observe(_step(5))
    _write(gate, 5)
    gate.observe(_step(10, audit=True, passed=False))
    assert gate.records[0].status is CheckpointStatus.PENDING
    with pytest.raises(CheckpointNotVerifiedError, match="pending"):
        gate.publish(5)


def test_after_an_alarm_nothing_is_published_until_recovery(tmp_path: Path) -> None:
    gate = CheckpointGate(tmp_path, audit_every=10)
    gate.observe(_step(0, audit=True))
    _write(gate, 0)  # verified
    gate.observe(_step(5))
    _write(gate, 5)  # pending
    gate.observe(_step(7, alarm=_alarm(7)))
    assert [r.status for r in gate.records] == [
        CheckpointStatus.VERIFIED,
        CheckpointStatus.QUARANTINED,
    ]
    with pytest.raises(GateClosedError, match="step 7"):
        gate.publish()
    with pytest.raises(GateClosedError):
        gate.publish(0)
    gate.observe(_step(8))
    assert _write(gate, 8).status is CheckpointStatus.QUARANTINED
    gate.observe(_step(10, audit=True))  # a passing audit after the alarm proves nothing
    assert gate.records[-1].status is CheckpointStatus.QUARANTINED
    latest = gate.latest_verified()
    assert latest is not None
    assert latest.step == 0
    gate.reopen()
    assert gate.publish().step == 0
    gate.observe(_step(11))
    _write(gate, 11)
    gate.observe(_step(20, audit=True))
    assert gate.publish().step == 11


def test_without_audits_a_passed_vote_counts_as_weaker_evidence(tmp_path: Path) -> None:
    gate = CheckpointGate(tmp_path, audit_every=0)
    gate.observe(_step(3))
    record = _write(gate, 3)
    assert record.status is CheckpointStatus.VERIFIED
    assert record.evidence["kind"] == "fingerprint"
    assert record.evidence["weaker"] is True
    gate.observe(_step(4, vote=False))
    assert _write(gate, 4).status is CheckpointStatus.PENDING


def test_with_audits_a_vote_alone_verifies_nothing(tmp_path: Path) -> None:
    gate = CheckpointGate(tmp_path, audit_every=10)
    gate.observe(_step(3))
    assert _write(gate, 3).status is CheckpointStatus.PENDING


def test_write_is_atomic_and_hashes_the_file(tmp_path: Path) -> None:
    gate = CheckpointGate(tmp_path / "ckpt", audit_every=10)
    gate.observe(_step(12))
    record = _write(gate, 12)
    path = tmp_path / "ckpt" / "ckpt-000012.pt"
    assert record.uri == str(path.resolve())
    assert record.sha256 == hashlib.sha256(b"state 12").hexdigest()
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt-000012.pt"]
    assert record.to_report() == {
        "step": 12,
        "uri": record.uri,
        "sha256": record.sha256,
        "fingerprint": FP.hex(),
        "status": "pending",
    }


def test_a_failing_writer_leaves_no_file_and_records_nothing(tmp_path: Path) -> None:
    gate = CheckpointGate(tmp_path, audit_every=10)
    gate.observe(_step(1))

    def broken(path: Path) -> None:
        path.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        gate.write(1, broken)
    assert list(tmp_path.iterdir()) == []
    assert gate.records == ()


def test_write_must_follow_the_decision_of_its_step(tmp_path: Path) -> None:
    gate = CheckpointGate(tmp_path, audit_every=10)
    with pytest.raises(GateError, match="step 3"):
        _write(gate, 3)
    gate.observe(_step(4))
    with pytest.raises(GateError, match="would not match"):
        _write(gate, 3)
    with pytest.raises(GateError, match="no checkpoint directory"):
        CheckpointGate(None, audit_every=1).write(4, lambda p: None)


def test_provenance_reaches_the_ledger_checkpoint_before_its_audit(tmp_path: Path) -> None:
    ledger = _Ledger()
    gate = CheckpointGate(tmp_path, audit_every=10, nodes=["n0", "n1"], sink=ledger)
    gate.observe(_step(10, audit=True))
    record = _write(gate, 10)
    gate.observe(_step(11))
    gate.observe(_step(20, audit=True, alarm=_alarm(20)))
    gate.flush()
    assert ledger.posts == [
        (
            "checkpoint",
            {
                "step": 10,
                "uri": record.uri,
                "sha256": record.sha256,
                "fingerprint": FP.hex(),
                "nodes": ["n0", "n1"],
            },
        ),
        ("audit", {"step": 10, "kind": "loss", "ranks": [0, 1, 2, 3], "passed": True}),
        ("audit", {"step": 20, "kind": "loss", "ranks": [0, 1, 2, 3], "passed": False}),
    ]


def test_without_audits_the_vote_evidence_is_posted_after_the_checkpoint(tmp_path: Path) -> None:
    ledger = _Ledger()
    gate = CheckpointGate(tmp_path, audit_every=0, sink=ledger)
    gate.observe(_step(4))
    _write(gate, 4)
    assert [(kind, body.get("kind")) for kind, body in ledger.posts] == [
        ("checkpoint", None),
        ("audit", "fingerprint"),
    ]


def test_a_str_directory_works_like_a_path(tmp_path: Path) -> None:
    gate = CheckpointGate(str(tmp_path / "ckpts"), audit_every=10)
    gate.observe(_step(3))
    record = _write(gate, 3)
    assert Path(record.uri).parent == (tmp_path / "ckpts").resolve()
    assert Path(record.uri).exists()


def test_checkpoints_quarantined_by_an_alarm_are_posted_quarantined(tmp_path: Path) -> None:
    ledger = _Ledger()
    gate = CheckpointGate(tmp_path, audit_every=10, sink=ledger)
    gate.observe(_step(5))
    pending = _write(gate, 5)
    gate.observe(_step(7, alarm=_alarm(7)))
    gate.observe(_step(8))
    late = _write(gate, 8)
    checkpoints = [body for kind, body in ledger.posts if kind == "checkpoint"]
    assert [(b["step"], b.get("status")) for b in checkpoints] == [
        (5, None),  # written pending
        (5, "quarantined"),  # the alarm at step 7 condemned it: the ledger is told
        (8, "quarantined"),  # written while closed
    ]
    assert checkpoints[1]["sha256"] == pending.sha256
    assert checkpoints[2]["uri"] == late.uri


def test_a_guard_state_is_written_beside_the_checkpoint_with_its_fingerprint(
    tmp_path: Path,
) -> None:
    """A gate given to a guard writes the guard's learnt state beside each checkpoint,
    ``ckpt-<step>.sdcguard.pt``, tied to the checkpoint's weights by their fingerprint; the
    checkpoint file and its record are as without it."""
    gate = CheckpointGate(tmp_path / "ckpt", audit_every=10)
    gate.bind_guard_state(lambda: {"format": "sdcguard-guard-state", "step": 12, "x": [1.5]})
    gate.observe(_step(12))
    record = _write(gate, 12)
    path = tmp_path / "ckpt" / "ckpt-000012.pt"
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "ckpt-000012.pt",
        "ckpt-000012.sdcguard.pt",
    ]
    assert record.sha256 == hashlib.sha256(b"state 12").hexdigest()
    assert state_path(path) == tmp_path / "ckpt" / "ckpt-000012.sdcguard.pt"
    assert read_state(path) == {
        "format": "sdcguard-guard-state",
        "step": 12,
        "x": [1.5],
        "fingerprint": FP.hex(),
    }
    assert read_state(tmp_path / "ckpt" / "ckpt-000099.pt") is None
