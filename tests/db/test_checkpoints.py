"""Checkpoint provenance: verified only by a passed audit with no alarm between, quarantined in
a suspect range, and only verified checkpoints are ever offered for resume."""

from __future__ import annotations

import pytest

from db import (
    CheckpointEvidence,
    CheckpointNotFound,
    CheckpointStatus,
    IncidentState,
    Ledger,
)
from tests.db.support import FP, SHA_A, SHA_B, checkpoint, make_alarm, register, statuses


@pytest.fixture
def job(ledger: Ledger) -> str:
    register(ledger)
    return "job-1"


def test_a_checkpoint_is_written_pending(ledger: Ledger, job: str) -> None:
    view = ledger.record_checkpoint(job, 10, "s3://ckpts/a.pt", SHA_A, FP, ["node-0", "node-1"])
    assert view.status == CheckpointStatus.PENDING
    assert (view.evidence, view.audited_through) == (None, None)
    assert view.nodes == ["node-0", "node-1"]


def test_recording_the_same_checkpoint_again_is_idempotent(ledger: Ledger, job: str) -> None:
    first = ledger.record_checkpoint(job, 10, "s3://ckpts/a.pt", SHA_A, FP, ["node-0"])
    again = ledger.record_checkpoint(job, 10, "s3://ckpts/a.pt", SHA_A, FP, ["node-0"])
    assert again == first
    assert len(ledger.list_checkpoints(job)) == 1


def test_a_passed_ring_audit_verifies_earlier_pending_checkpoints(ledger: Ledger, job: str) -> None:
    for step in (10, 20, 30):
        checkpoint(ledger, step)
    assert ledger.record_audit(job, 20, "gradient", [0, 1, 2, 3], passed=True) == [10, 20]
    views = {v.step: v for v in ledger.list_checkpoints(job)}
    assert views[10].status == views[20].status == CheckpointStatus.VERIFIED
    assert views[10].evidence == CheckpointEvidence.RING_AUDIT
    assert views[20].audited_through == 20
    assert views[30].status == CheckpointStatus.PENDING
    # Already verified ones are not reported again.
    assert ledger.record_audit(job, 30, "loss", [0, 1], passed=True) == [30]


def test_a_failed_audit_verifies_nothing(ledger: Ledger, job: str) -> None:
    checkpoint(ledger, 10)
    assert ledger.record_audit(job, 20, "loss", [0, 1], passed=False) == []
    assert statuses(ledger) == {10: "pending"}


def test_verification_never_crosses_an_alarm(ledger: Ledger, job: str) -> None:
    checkpoint(ledger, 10)
    checkpoint(ledger, 30)
    ledger.record_alarm(make_alarm(step=25))
    incident = ledger.open_incident_for(job)
    assert incident is not None
    # Even with the incident closed the old alarm still lies between 10 and the audit at 40.
    ledger.transition(incident.id, IncidentState.FAILED)
    assert ledger.record_audit(job, 40, "loss", [0, 1], passed=True) == [30]
    assert statuses(ledger) == {10: "pending", 30: "verified"}


def test_an_alarm_at_the_checkpoint_step_taints_it(ledger: Ledger, job: str) -> None:
    checkpoint(ledger, 30)
    incident = ledger.record_alarm(make_alarm(step=30)).incident_id
    ledger.transition(incident, IncidentState.FAILED)
    assert ledger.record_audit(job, 40, "loss", [0, 1], passed=True) == []
    assert statuses(ledger) == {30: "pending"}


def test_an_open_incident_blocks_verification_from_its_suspect_start(
    ledger: Ledger, job: str
) -> None:
    ledger.record_audit(job, 20, "loss", [0, 1], passed=True)
    checkpoint(ledger, 20)
    checkpoint(ledger, 40)
    ledger.record_alarm(make_alarm(step=37))  # suspect range [21, 37]
    assert ledger.record_audit(job, 50, "loss", [0, 1], passed=True) == []
    # A late audit from before the suspect range still counts.
    assert ledger.record_audit(job, 20, "loss", [0, 1], passed=True) == [20]
    assert statuses(ledger) == {20: "verified", 40: "pending"}


def test_fingerprint_votes_verify_only_jobs_without_ring_audits(ledger: Ledger) -> None:
    ledger.ensure_job("votes")
    checkpoint(ledger, 10, job_id="votes")
    assert ledger.record_audit("votes", 10, "fingerprint", [0, 1, 2], passed=True) == [10]
    [view] = ledger.list_checkpoints("votes")
    assert view.evidence == CheckpointEvidence.FINGERPRINT_VOTE

    ledger.ensure_job("ring")
    ledger.record_audit("ring", 0, "loss", [0, 1], passed=True)
    checkpoint(ledger, 10, job_id="ring")
    assert ledger.record_audit("ring", 11, "fingerprint", [0, 1], passed=True) == []
    assert ledger.record_audit("ring", 20, "loss", [0, 1], passed=True) == [10]


def test_quarantine_marks_checkpoints_inside_the_range(ledger: Ledger, job: str) -> None:
    for step in (10, 20, 30, 40, 50):
        checkpoint(ledger, step)
    ledger.record_audit(job, 30, "loss", [0, 1], passed=True)  # 10, 20, 30 verified
    ledger.mark_checkpoint_corrupt(job, 50, "sha256 mismatch")
    assert ledger.quarantine_range(job, 20, 40) == [20, 30, 40]
    assert statuses(ledger) == {
        10: "verified",
        20: "quarantined",
        30: "quarantined",
        40: "quarantined",
        50: "corrupt",  # stays corrupt: that is the stronger finding
    }
    quarantined = {v.step: v for v in ledger.list_checkpoints(job)}[30]
    assert quarantined.reason == "in suspect range [20, 40]"
    assert ledger.quarantine_range(job, 20, 40) == []  # a repeat changes nothing


def test_open_ended_quarantine_takes_everything_from_start(ledger: Ledger, job: str) -> None:
    for step in (10, 20, 30):
        checkpoint(ledger, step)
    assert ledger.quarantine_range(job, 15, None) == [20, 30]
    assert statuses(ledger) == {10: "pending", 20: "quarantined", 30: "quarantined"}


def test_resume_takes_the_newest_verified_checkpoint_before_the_range(
    ledger: Ledger, job: str
) -> None:
    for step in (10, 20, 30, 40, 50, 60):
        checkpoint(ledger, step)
    ledger.record_audit(job, 50, "loss", [0, 1], passed=True)  # 10..50 verified
    ledger.quarantine_range(job, 41, None)  # 50, 60 quarantined
    ledger.mark_checkpoint_corrupt(job, 40, "sha256 mismatch in storage")
    ledger.record_checkpoint(job, 35, "s3://ckpts/late.pt", SHA_B, FP, ["node-0"])  # pending
    candidates = ledger.resume_candidates(job, before_step=41)
    assert [c.step for c in candidates] == [30, 20, 10]
    chosen = ledger.resume_checkpoint(job, before_step=41)
    assert chosen is not None
    assert chosen.step == 30
    assert all(c.status == CheckpointStatus.VERIFIED for c in candidates)
    # Strictly before: a verified checkpoint at the boundary step is not taken.
    assert [c.step for c in ledger.resume_candidates(job, before_step=30)] == [20, 10]
    assert ledger.resume_checkpoint(job, before_step=10) is None


def test_pending_quarantined_and_corrupt_are_never_chosen(ledger: Ledger, job: str) -> None:
    checkpoint(ledger, 10)  # stays pending
    checkpoint(ledger, 20)
    checkpoint(ledger, 30)
    ledger.record_audit(job, 30, "loss", [0], passed=False)
    ledger.quarantine_range(job, 20, 20)
    ledger.mark_checkpoint_corrupt(job, 30, "bad bytes")
    assert ledger.resume_candidates(job, before_step=100) == []
    assert ledger.resume_checkpoint(job, before_step=100) is None


def test_mark_corrupt_of_a_missing_checkpoint_is_a_typed_error(ledger: Ledger, job: str) -> None:
    with pytest.raises(CheckpointNotFound, match="no checkpoint at step 10"):
        ledger.mark_checkpoint_corrupt(job, 10, "gone")


def test_a_rewritten_file_supersedes_its_old_record(ledger: Ledger, job: str) -> None:
    checkpoint(ledger, 10, sha256=SHA_A)
    ledger.record_audit(job, 10, "loss", [0, 1], passed=True)
    rewritten = ledger.record_checkpoint(
        job, 10, "s3://ckpts/ckpt-000010.pt", SHA_B, FP, ["node-0"]
    )
    assert rewritten.status == CheckpointStatus.PENDING
    old, new = ledger.list_checkpoints(job)
    assert (old.sha256, old.status) == (SHA_A, CheckpointStatus.CORRUPT)
    assert old.reason is not None
    assert "overwritten" in old.reason
    assert (new.sha256, new.status) == (SHA_B, CheckpointStatus.PENDING)
    assert ledger.resume_checkpoint(job, before_step=100) is None


def test_after_resolution_the_resumed_run_can_verify_again(ledger: Ledger, job: str) -> None:
    checkpoint(ledger, 30)
    ledger.record_audit(job, 30, "loss", [0, 1], passed=True)
    checkpoint(ledger, 40)
    incident = ledger.record_alarm(make_alarm(step=45)).incident_id
    assert ledger.record_audit(job, 50, "loss", [0, 1], passed=True) == []
    ledger.quarantine_range(job, 31, None)
    ledger.transition(incident, IncidentState.RESOLVED)
    # The resumed run (from 30) writes new files and passes its audits again.
    ledger.record_checkpoint(job, 50, "s3://ckpts/run2/ckpt-000050.pt", SHA_B, FP, ["node-0"])
    assert ledger.record_audit(job, 50, "loss", [0, 1], passed=True) == [50]
    chosen = ledger.resume_checkpoint(job, before_step=100)
    assert chosen is not None
    assert chosen.uri == "s3://ckpts/run2/ckpt-000050.pt"
    assert statuses(ledger)[40] == "quarantined"
