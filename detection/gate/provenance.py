"""The gate's provenance: which checkpoint is trusted, on which evidence, and what the ledger hears.

A checksum of a checkpoint file proves only that the bytes were stored faithfully — including
wrong weights. So every checkpoint is recorded ``pending`` and becomes ``verified`` only when a
ring audit at or after its step passed with no alarm in between (DESIGN, checkpoint provenance).
A job without ring audits (``audit_every=0``) may count a passed fingerprint vote instead; the
record's ``evidence`` then says it is the weaker kind: a vote shows the replicas agree, not that
what they agree on was computed right.

After an alarm the gate closes: every pending checkpoint is quarantined (and posted to the
ledger again as quarantined), checkpoints recorded later are quarantined at once, nothing
becomes verified, and :meth:`GateProvenance.publish` refuses with
:class:`~detection.gate.records.GateClosedError` until :meth:`GateProvenance.reopen` after
recovery.

Provenance goes to the ledger in an order that lets it draw the same conclusions: a checkpoint is
posted before the audit that verifies it (an audit at step s is held back until checkpoint s,
if one is due, has been posted).

This module keeps that state machine apart from the files: it writes nothing to disk. The gate
that writes checkpoints (:class:`~detection.gate.checkpoint.CheckpointGate`) is built on it and
records each file it writes through :meth:`GateProvenance._record`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from detection.gate.records import (
    CheckpointNotVerifiedError,
    CheckpointRecord,
    CheckpointStatus,
    GateClosedError,
    GateError,
    ProvenanceSink,
    StepOutcome,
)
from detection.transport.alarm import Alarm

__all__ = ["GateProvenance"]

_log = logging.getLogger(__name__)


class GateProvenance:
    """Checkpoint provenance of one job: the records, the evidence that verifies them, the
    alarm that closes the gate, and the posts to the ledger.

    Invariant: a record is ``verified`` only if a passed audit (or, without audits, a passed
    vote) at a step ≥ its own was observed while the gate was open and after the record was
    pending; once closed, no record changes to ``verified`` until :meth:`reopen`.
    """

    def __init__(
        self,
        *,
        audit_every: int,
        nodes: Sequence[str] = (),
        sink: ProvenanceSink | None = None,
        job_id: str = "local",
    ) -> None:
        self.audit_every = audit_every
        self.nodes = list(nodes)
        self.job_id = job_id
        self._sink = sink
        self._records: dict[int, CheckpointRecord] = {}
        self._alarm: Alarm | None = None
        self._last: StepOutcome | None = None
        self._held_audit: dict[str, Any] | None = None

    # -- state ------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._alarm is not None

    @property
    def records(self) -> tuple[CheckpointRecord, ...]:
        return tuple(self._records[s] for s in sorted(self._records))

    def latest_verified(self) -> CheckpointRecord | None:
        verified = [r for r in self.records if r.status is CheckpointStatus.VERIFIED]
        return verified[-1] if verified else None

    # -- evidence ---------------------------------------------------------------------------------
    def observe(self, outcome: StepOutcome) -> None:
        """Feed the guard's decision for one step (called by the guard)."""
        self._post_held_audit()
        self._last = outcome
        if outcome.alarm is not None:
            self._close(outcome.alarm)
        elif not self.closed:
            evidence = self._evidence(outcome)
            if evidence is not None:
                for step, record in list(self._records.items()):
                    if record.status is CheckpointStatus.PENDING and step <= outcome.step:
                        self._set(
                            replace(record, status=CheckpointStatus.VERIFIED, evidence=evidence)
                        )
        if outcome.audit is not None:
            self._held_audit = {
                "step": outcome.step,
                "kind": str(outcome.audit),
                "ranks": list(outcome.ranks),
                "passed": outcome.audit_passed and outcome.alarm is None,
            }

    def _evidence(self, outcome: StepOutcome) -> dict[str, Any] | None:
        if outcome.audit is not None and outcome.audit_passed and outcome.vote_passed:
            return {"kind": str(outcome.audit), "step": outcome.step}
        if self.audit_every == 0 and outcome.vote_passed:
            return {
                "kind": "fingerprint",
                "step": outcome.step,
                "weaker": True,
                "note": "no ring audits in this job: a passed fingerprint vote shows the "
                "replicas agree, not that their computation was right",
            }
        return None

    def _close(self, alarm: Alarm) -> None:
        if self._alarm is None:
            self._alarm = alarm
        for record in list(self._records.values()):
            if record.status is CheckpointStatus.PENDING:
                quarantined = replace(
                    record,
                    status=CheckpointStatus.QUARANTINED,
                    evidence={"alarm_step": alarm.step, "layer": str(alarm.layer)},
                )
                self._set(quarantined)
                self._post_checkpoint(quarantined)
        _log.warning("checkpoint gate closed", extra={"job": self.job_id, "step": alarm.step})

    def _set(self, record: CheckpointRecord) -> None:
        self._records[record.step] = record
        _log.info(
            "checkpoint %s",
            record.status,
            extra={"job": self.job_id, "step": record.step, "uri": record.uri},
        )

    # -- recording --------------------------------------------------------------------------------
    def _require_decided(self, step: int) -> StepOutcome:
        """The guard's outcome of ``step``: a checkpoint is written right after its decision,
        so the recorded fingerprint is the written state's."""
        if self._last is None or self._last.step != step:
            seen = None if self._last is None else self._last.step
            raise GateError(
                f"checkpoint of step {step} written after the guard decided step "
                f"{seen}: the recorded fingerprint would not match the file"
                + (
                    " (with GuardConfig(defer_decision=True) call guard.flush() on every rank "
                    "first: it decides the step just run)"
                    if seen is None or seen < step
                    else ""
                )
            )
        return self._last

    def _record(self, step: int, uri: str, digest: str, last: StepOutcome) -> CheckpointRecord:
        """Record the checkpoint just written, with the status the evidence so far gives it,
        and post it (and, without audits, the vote that verified it) to the ledger."""
        if self.closed:
            status = CheckpointStatus.QUARANTINED
            assert self._alarm is not None
            evidence: dict[str, Any] = {
                "alarm_step": self._alarm.step,
                "layer": str(self._alarm.layer),
            }
        else:
            found = self._evidence(last)
            status = CheckpointStatus.VERIFIED if found else CheckpointStatus.PENDING
            evidence = found or {}
        record = CheckpointRecord(
            step=step,
            uri=uri,
            sha256=digest,
            fingerprint=last.fingerprint.hex(),
            status=status,
            evidence=evidence,
        )
        self._set(record)
        self._post_checkpoint(record)
        if self._sink is not None and self.audit_every == 0 and status is CheckpointStatus.VERIFIED:
            self._sink.record_audit(
                {
                    "step": step,
                    "kind": "fingerprint",
                    "ranks": list(last.ranks),
                    "passed": True,
                }
            )
        self._post_held_audit()
        return record

    def _post_checkpoint(self, record: CheckpointRecord) -> None:
        """Tell the ledger about ``record``: as written (the ledger starts it ``pending``), or
        — once the gate holds it quarantined — again with ``status: quarantined``, so the
        ledger never keeps a checkpoint pending that an alarm already condemned."""
        if self._sink is None:
            return
        body: dict[str, Any] = {
            "step": record.step,
            "uri": record.uri,
            "sha256": record.sha256,
            "fingerprint": record.fingerprint,
            "nodes": self.nodes,
        }
        if record.status is CheckpointStatus.QUARANTINED:
            body["status"] = str(CheckpointStatus.QUARANTINED)
        self._sink.record_checkpoint(body)

    # -- publishing -------------------------------------------------------------------------------
    def publish(self, step: int | None = None) -> CheckpointRecord:
        """The checkpoint to publish as verified (the newest, or the one at ``step``).

        Raises :class:`GateClosedError` while an alarm is open and
        :class:`CheckpointNotVerifiedError` for a pending or quarantined checkpoint.
        """
        if self._alarm is not None:
            raise GateClosedError(self._alarm)
        if step is None:
            record = self.latest_verified()
            if record is None:
                raise CheckpointNotVerifiedError("no checkpoint has been verified yet")
            return record
        record = self._records.get(step)
        if record is None:
            raise CheckpointNotVerifiedError(f"no checkpoint at step {step}")
        if record.status is not CheckpointStatus.VERIFIED:
            raise CheckpointNotVerifiedError(f"checkpoint at step {step} is {record.status}")
        return record

    def reopen(self) -> None:
        """Recovery is done (resumed from a verified checkpoint): accept evidence again.
        Quarantined records stay quarantined."""
        self._alarm = None

    def flush(self) -> None:
        """Post an audit still held back (call before the job ends)."""
        self._post_held_audit()

    def _post_held_audit(self) -> None:
        if self._held_audit is not None and self._sink is not None:
            self._sink.record_audit(self._held_audit)
        self._held_audit = None
