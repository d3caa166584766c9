"""Checkpoints and audits: which saved state is clean enough to resume from.

Invariants: a checkpoint is verified only by a passed audit of the job's evidence kind at or
after its step, with no alarm in between ("never verify across an alarm") and no open incident
reaching back over the audit; quarantined and corrupt checkpoints never become resume
candidates. Writers lock the job's row first, so an alarm and an audit arriving at the same
moment are ordered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Select, select
from sqlalchemy.orm import Session

from db.enums import (
    RING_AUDIT_KINDS,
    AuditKind,
    CheckpointEvidence,
    CheckpointStatus,
    IncidentState,
)
from db.errors import CheckpointNotFound, InvalidValue
from db.ledger._base import LedgerBase, _log
from db.ledger._queries import _active_incident, _evidence_kinds
from db.ledger._validate import _parse_enum, _require_range, _require_step, _require_text
from db.ledger._views import _checkpoint_view
from db.models import AlarmRow, AuditRow, CheckpointRow, IncidentRow
from db.views import CheckpointView

# States whose checkpoint storage still vouches for: an overwrite or a quarantine ends them.
_LIVE = [CheckpointStatus.PENDING, CheckpointStatus.VERIFIED]


class CheckpointsMixin(LedgerBase):
    """:class:`db.ledger.Ledger`'s checkpoint and audit methods."""

    def record_checkpoint(
        self,
        job_id: str,
        step: int,
        uri: str,
        sha256: str,
        fingerprint: str,
        nodes: Sequence[str],
    ) -> CheckpointView:
        """Record a checkpoint as ``pending``; idempotent on (job, step, uri) with equal content.

        A different sha256 at the same (job, step, uri) means the file was rewritten (a resumed
        run writes the same names again): the new content is recorded as a new pending
        checkpoint, and an earlier pending or verified record of that place is marked
        ``corrupt`` — storage no longer holds the bytes it vouched for.
        """
        _require_text("job_id", job_id)
        _require_step("step", step)
        _require_text("uri", uri, max_len=1024)
        _require_text("sha256", sha256, max_len=64)
        _require_text("fingerprint", fingerprint, max_len=64)
        node_list = [_require_text("node", n) for n in nodes]

        def work(s: Session) -> CheckpointView:
            self._require_job(s, job_id, lock=True)
            same = s.scalars(
                _checkpoints(
                    job_id,
                    CheckpointRow.step == step,
                    CheckpointRow.uri == uri,
                    CheckpointRow.sha256 == sha256,
                )
            ).one_or_none()
            if same is not None:
                if same.fingerprint != fingerprint:
                    raise InvalidValue(
                        f"checkpoint {uri} (sha256 {sha256}) was recorded with fingerprint "
                        f"{same.fingerprint}, not {fingerprint}"
                    )
                return _checkpoint_view(same)
            now = self._clock()
            overwritten = s.scalars(
                _checkpoints(
                    job_id,
                    CheckpointRow.step == step,
                    CheckpointRow.uri == uri,
                    CheckpointRow.status.in_(_LIVE),
                )
            )
            for old in overwritten:
                old.status = CheckpointStatus.CORRUPT
                old.reason = f"overwritten in storage: {uri} now holds sha256 {sha256}"
                old.updated_at = now
            row = CheckpointRow(
                job_id=job_id,
                step=step,
                uri=uri,
                sha256=sha256,
                fingerprint=fingerprint,
                nodes=node_list,
                status=CheckpointStatus.PENDING,
                evidence=None,
                audited_through=None,
                reason=None,
                created_at=now,
                updated_at=now,
            )
            s.add(row)
            s.flush()
            return _checkpoint_view(row)

        view = self._write("record_checkpoint", work)
        _log.info("checkpoint recorded", extra={"job": job_id, "step": step, "uri": uri})
        return view

    def record_audit(
        self, job_id: str, step: int, kind: str, ranks: Sequence[int], passed: bool
    ) -> list[int]:
        """Record an audit; a passed one verifies earlier pending checkpoints.

        A passed audit at step ``s`` verifies each pending checkpoint with step ``c <= s``
        unless an alarm of the job lies in ``[c, s]`` (a checkpoint is the state *after* its
        step, so an alarm at ``c`` itself taints it) or the job has an open incident whose
        suspect range starts at or before ``s``. Evidence is ``ring-audit`` for loss/gradient
        audits. A job that runs no ring audits falls back to fingerprint votes, recorded as
        ``fingerprint-vote``: the weaker evidence, blind to a corruption that was averaged
        into every replica; once a job has reported a ring audit, its votes verify nothing.
        A failed audit verifies nothing. Returns the steps of the checkpoints it verified.
        """
        _require_text("job_id", job_id)
        _require_step("step", step)
        audit_kind = _parse_enum(AuditKind, "kind", kind)
        rank_list = [_require_step("rank", r) for r in ranks]
        if not isinstance(passed, bool):
            raise InvalidValue(f"passed must be a bool, not {passed!r}")

        def work(s: Session) -> list[int]:
            self._require_job(s, job_id, lock=True)
            now = self._clock()
            s.add(
                AuditRow(
                    job_id=job_id,
                    step=step,
                    kind=audit_kind,
                    ranks=rank_list,
                    passed=passed,
                    at=now,
                )
            )
            s.flush()
            if not passed or audit_kind not in _evidence_kinds(s, job_id):
                return []
            active = _active_incident(s, job_id)
            if active is not None and active.suspect_start <= step:
                return []
            pending = list(
                s.scalars(
                    _checkpoints(
                        job_id,
                        CheckpointRow.status == CheckpointStatus.PENDING,
                        CheckpointRow.step <= step,
                    ).order_by(CheckpointRow.step, CheckpointRow.id)
                )
            )
            if not pending:
                return []
            alarms = s.execute(
                select(AlarmRow.step, IncidentRow.state, IncidentRow.closed_at)
                .join(IncidentRow, AlarmRow.incident_id == IncidentRow.id)
                .where(
                    AlarmRow.job_id == job_id,
                    AlarmRow.step <= step,
                    AlarmRow.step >= pending[0].step,
                )
            ).all()
            evidence = (
                CheckpointEvidence.RING_AUDIT
                if audit_kind in RING_AUDIT_KINDS
                else CheckpointEvidence.FINGERPRINT_VOTE
            )
            verified: list[int] = []
            for row in pending:
                blocked = any(
                    alarm_step >= row.step
                    and not (
                        state == IncidentState.RESOLVED
                        and closed_at is not None
                        and closed_at <= row.created_at
                    )
                    for alarm_step, state, closed_at in alarms
                )
                if blocked:
                    continue
                row.status = CheckpointStatus.VERIFIED
                row.evidence = evidence
                row.audited_through = step
                row.reason = None
                row.updated_at = now
                verified.append(row.step)
            return sorted(set(verified))

        verified = self._write("record_audit", work)
        _log.info(
            "audit recorded",
            extra={"job": job_id, "step": step, "kind": audit_kind.value, "passed": passed},
        )
        return verified

    def list_checkpoints(self, job_id: str) -> list[CheckpointView]:
        """All checkpoints of the job, oldest step first."""

        def work(s: Session) -> list[CheckpointView]:
            rows = s.scalars(_checkpoints(job_id).order_by(CheckpointRow.step, CheckpointRow.id))
            return [_checkpoint_view(row) for row in rows]

        return self._read("list_checkpoints", work)

    def quarantine_range(self, job_id: str, start: int, end: int | None) -> list[int]:
        """Quarantine pending and verified checkpoints with ``start <= step`` (``<= end``).

        ``end=None`` leaves the range open: everything from ``start`` on. Corrupt checkpoints
        stay corrupt. Returns the steps newly quarantined (empty on a repeat).
        """
        _require_text("job_id", job_id)
        _require_range(start, end)

        def work(s: Session) -> list[int]:
            self._require_job(s, job_id, lock=True)
            now = self._clock()
            query = _checkpoints(
                job_id,
                CheckpointRow.step >= start,
                CheckpointRow.status.in_(_LIVE),
            )
            if end is not None:
                query = query.where(CheckpointRow.step <= end)
            shown = "∞" if end is None else str(end)
            steps: list[int] = []
            for row in s.scalars(query.order_by(CheckpointRow.step)):
                row.status = CheckpointStatus.QUARANTINED
                row.reason = f"in suspect range [{start}, {shown}]"
                row.updated_at = now
                steps.append(row.step)
            return sorted(set(steps))

        steps = self._write("quarantine_range", work)
        _log.info("checkpoints quarantined", extra={"job": job_id, "steps": steps})
        return steps

    def mark_checkpoint_corrupt(
        self, job_id: str, step: int, reason: str, *, uri: str | None = None
    ) -> CheckpointView:
        """Mark the checkpoint(s) at ``step`` corrupt (e.g. sha256 mismatch in storage).

        With ``uri`` only that file's record is marked. Returns the newest record marked.
        """
        _require_text("job_id", job_id)
        _require_step("step", step)
        _require_text("reason", reason, max_len=10_000)

        def work(s: Session) -> CheckpointView:
            self._require_job(s, job_id, lock=True)
            query = _checkpoints(job_id, CheckpointRow.step == step)
            if uri is not None:
                query = query.where(CheckpointRow.uri == uri)
            rows = list(s.scalars(query.order_by(CheckpointRow.id)))
            if not rows:
                raise CheckpointNotFound(job_id, step)
            now = self._clock()
            for row in rows:
                row.status = CheckpointStatus.CORRUPT
                row.reason = reason
                row.updated_at = now
            return _checkpoint_view(rows[-1])

        view = self._write("mark_checkpoint_corrupt", work)
        _log.warning("checkpoint corrupt", extra={"job": job_id, "step": step, "reason": reason})
        return view

    def resume_candidates(self, job_id: str, before_step: int) -> list[CheckpointView]:
        """Verified checkpoints with ``step < before_step``, newest first.

        Pending, quarantined and corrupt checkpoints are never candidates.
        """
        _require_step("before_step", before_step)

        def work(s: Session) -> list[CheckpointView]:
            rows = s.scalars(
                _checkpoints(
                    job_id,
                    CheckpointRow.status == CheckpointStatus.VERIFIED,
                    CheckpointRow.step < before_step,
                ).order_by(CheckpointRow.step.desc(), CheckpointRow.id.desc())
            )
            return [_checkpoint_view(row) for row in rows]

        return self._read("resume_candidates", work)

    def resume_checkpoint(self, job_id: str, before_step: int) -> CheckpointView | None:
        """The newest verified checkpoint strictly before ``before_step``, if any."""
        candidates = self.resume_candidates(job_id, before_step)
        return candidates[0] if candidates else None


def _checkpoints(job_id: str, *conditions: Any) -> Select[CheckpointRow]:
    """The job's checkpoints that meet every condition (a query, not yet run)."""
    return select(CheckpointRow).where(CheckpointRow.job_id == job_id, *conditions)
