"""The SQL ledger: which steps are suspect, which checkpoint is clean, who approved what.

Every public method is one database transaction: it either commits all of its effect or raises
a :class:`db.errors.LedgerError` and leaves nothing behind. Methods return frozen views, never
ORM rows, so callers cannot write to the database behind the ledger's back.

Concurrency. Writers that touch one job's alarms, audits and checkpoints first lock that job's
row, so "never verify across an alarm" holds even when an alarm and an audit arrive at the same
moment. Races the lock cannot cover (the first alarm of an unknown job, two claims of a new
action) end in a unique-key violation in the database; the losing transaction is rolled back
and re-run from the start, and then sees the winner's row. On SQLite, write transactions begin
``IMMEDIATE`` and are serialised by the file lock.

Timelines. After an incident is resolved the job resumes from an earlier checkpoint and repeats
steps. Alarms and audits recorded before that resolution describe the abandoned run: an alarm of
a resolved incident does not block checkpoints recorded after the incident closed, and passed
audits recorded before it closed do not narrow a later incident's suspect range.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, TypeVar

from sqlalchemy import Engine, exists, func, insert, select
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.orm import Session

from db.engine import create_engine_for, read_only
from db.enums import (
    RING_AUDIT_KINDS,
    TERMINAL_STATES,
    ActionStatus,
    AuditKind,
    CheckpointEvidence,
    CheckpointStatus,
    IncidentState,
    Verdict,
    can_transition,
)
from db.errors import (
    ActionStateError,
    CheckpointNotFound,
    IllegalTransition,
    IncidentConflict,
    InvalidRange,
    InvalidValue,
    LedgerContention,
    LedgerError,
    LedgerUnavailable,
    SchemaNotReady,
    UnknownAction,
    UnknownIncident,
    UnknownJob,
)
from db.models import (
    ActionEventRow,
    ActionRow,
    AlarmRow,
    AuditRow,
    CheckpointRow,
    IncidentEventRow,
    IncidentRow,
    JobRow,
    RankRow,
)
from db.views import (
    ActionClaim,
    ActionEventView,
    ActionView,
    AlarmIn,
    AlarmOutcome,
    AlarmView,
    CheckpointView,
    IncidentEventView,
    IncidentView,
    RankIn,
    RankView,
)

__all__ = [
    "ActionClaim",
    "ActionEventView",
    "ActionView",
    "AlarmIn",
    "AlarmOutcome",
    "AlarmView",
    "CheckpointView",
    "IncidentEventView",
    "IncidentView",
    "Ledger",
    "RankIn",
    "RankView",
]

_log = logging.getLogger(__name__)

_T = TypeVar("_T")
Clock = Callable[[], datetime]

# Each retry follows a rival's commit, so it normally succeeds at once; a loop that keeps
# losing means something else is wrong and should surface.
_MAX_ATTEMPTS = 12
_RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})  # serialization failure, deadlock
_ACTIVE_STATES = tuple(s for s in IncidentState if s not in TERMINAL_STATES)
_ID_MAX = 255
# Ids per IN list: far below SQLite's and PostgreSQL's bind-parameter limits.
_IN_CHUNK = 1000


def _utcnow() -> datetime:
    return datetime.now(UTC)


class Ledger:
    """Ledger queries on one engine; safe to share between threads.

    Build the engine with :func:`db.engine.create_engine_for` (or use :meth:`from_url`): the
    SQLite settings the ledger relies on (WAL, busy timeout, ``BEGIN IMMEDIATE``) live there.
    ``clock`` returns the current time as an aware datetime; tests may pin it.
    """

    engine: Engine

    def __init__(self, engine: Engine, *, clock: Clock | None = None) -> None:
        self.engine = engine
        self._read_engine = read_only(engine)
        self._clock: Clock = clock or _utcnow
        self._owns_engine = False

    @classmethod
    def from_url(cls, url: str, *, clock: Clock | None = None) -> Ledger:
        """A ledger on its own engine. Creates no tables: run :func:`db.migrate.upgrade` first."""
        ledger = cls(create_engine_for(url), clock=clock)
        ledger._owns_engine = True
        return ledger

    def close(self) -> None:
        """Close the pooled connections of an engine this ledger created."""
        if self._owns_engine:
            self.engine.dispose()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ jobs and ranks

    def ensure_job(self, job_id: str) -> None:
        """Make the job known; a no-op when it already is."""
        _require_text("job_id", job_id)
        self._write("ensure_job", lambda s: self._ensure_job(s, job_id))

    def register_ranks(self, job_id: str, ranks: Sequence[RankIn]) -> None:
        """Record where each rank runs, creating the job if needed.

        Upsert by (job, rank): a re-registration (e.g. after a node was replaced) overwrites
        node, instance and GPU, keeps ``first_seen`` and moves ``last_seen``.
        """
        _require_text("job_id", job_id)
        seen: set[int] = set()
        for rank in ranks:
            _require_step("rank", rank.rank)
            _require_step("local_rank", rank.local_rank)
            _require_text("node", rank.node)
            _optional_text("instance_id", rank.instance_id)
            _optional_text("gpu_uuid", rank.gpu_uuid)
            if rank.rank in seen:
                raise InvalidValue(f"rank {rank.rank} is listed twice for job {job_id!r}")
            seen.add(rank.rank)

        def work(s: Session) -> None:
            self._ensure_job(s, job_id, lock=True)
            now = self._clock()
            existing = {
                row.rank: row for row in s.scalars(select(RankRow).where(RankRow.job_id == job_id))
            }
            for rank in ranks:
                row = existing.get(rank.rank)
                if row is None:
                    s.add(
                        RankRow(
                            job_id=job_id,
                            rank=rank.rank,
                            local_rank=rank.local_rank,
                            node=rank.node,
                            instance_id=rank.instance_id,
                            gpu_uuid=rank.gpu_uuid,
                            first_seen=now,
                            last_seen=now,
                        )
                    )
                else:
                    row.local_rank = rank.local_rank
                    row.node = rank.node
                    row.instance_id = rank.instance_id
                    row.gpu_uuid = rank.gpu_uuid
                    row.last_seen = now
            s.flush()

        self._write("register_ranks", work)
        _log.info("ranks registered", extra={"job": job_id, "ranks": len(ranks)})

    def rank_map(self, job_id: str) -> dict[int, RankView]:
        """The job's ranks by rank number; empty for a job the ledger does not know."""

        def work(s: Session) -> dict[int, RankView]:
            rows = s.scalars(select(RankRow).where(RankRow.job_id == job_id).order_by(RankRow.rank))
            return {row.rank: _rank_view(row) for row in rows}

        return self._read("rank_map", work)

    # ------------------------------------------------------------------ alarms

    def record_alarm(self, alarm: AlarmIn) -> AlarmOutcome:
        """Store an alarm and attach it to the job's open incident, opening one if needed.

        Idempotent by ``alarm_id``: a re-sent alarm returns its incident with
        ``duplicate=True``. An alarm is never lost: an unknown job is created, and an incident
        opened for a job without registered ranks is flagged ``ranks_missing``. Each alarm
        widens its incident: the suspect range runs from just after the latest passed audit
        before the earliest alarm step (or step 0) to the latest alarm step. A batch of one:
        see :meth:`record_alarms`.
        """
        _validate_alarm(alarm)
        [outcome] = self._write("record_alarm", lambda s: self._record_alarms(s, [alarm]))
        _log.info(
            "alarm recorded",
            extra={
                "job": alarm.job_id,
                "incident": outcome.incident_id,
                "step": alarm.step,
                "rank": alarm.rank,
                "node": alarm.node,
                "duplicate": outcome.duplicate,
                "opened": outcome.opened,
            },
        )
        return outcome

    def record_alarms(self, alarms: Sequence[AlarmIn]) -> list[AlarmOutcome]:
        """Record many alarms in one transaction; outcome ``i`` belongs to ``alarms[i]``.

        The outcomes, incidents and suspect ranges are exactly those of calling
        :meth:`record_alarm` on each alarm in order: an alarm id seen before (stored, or earlier
        in the batch) is a duplicate of the first one; the first new alarm of a job without an
        open incident opens it (``opened=True``), every later one attaches. All or nothing: one
        invalid alarm refuses the whole batch before anything is written (check each with
        :meth:`validate_alarm` first to refuse it alone), and a database error rolls all of it
        back.

        This is what an alarm storm needs: one lock per job, a fixed number of statements and
        one commit per batch, instead of one transaction serialised on the job row per alarm.
        """
        batch = list(alarms)
        for index, alarm in enumerate(batch):
            try:
                _validate_alarm(alarm)
            except InvalidValue as err:
                raise InvalidValue(f"alarm {index} of the batch: {err}") from err
        if not batch:
            return []
        outcomes = self._write("record_alarms", lambda s: self._record_alarms(s, batch))
        summary: dict[str, dict[str, Any]] = {}
        for alarm, outcome in zip(batch, outcomes, strict=True):
            entry = summary.setdefault(
                outcome.incident_id,
                {"job": alarm.job_id, "incident": outcome.incident_id, "alarms": 0},
            )
            entry["alarms"] += 1
            entry["duplicates"] = entry.get("duplicates", 0) + int(outcome.duplicate)
            entry["opened"] = entry.get("opened", False) or outcome.opened
        for extra in summary.values():
            _log.info("alarms recorded", extra=extra)
        return outcomes

    @staticmethod
    def validate_alarm(alarm: AlarmIn) -> None:
        """Raise :class:`InvalidValue` for an alarm the ledger would refuse; writes nothing.

        A caller that batches alarms from many senders checks each one here first, so that one
        bad alarm is refused on its own instead of failing the batch it would have joined.
        """
        _validate_alarm(alarm)

    # ------------------------------------------------------------------ checkpoints and audits

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
                select(CheckpointRow).where(
                    CheckpointRow.job_id == job_id,
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
                select(CheckpointRow).where(
                    CheckpointRow.job_id == job_id,
                    CheckpointRow.step == step,
                    CheckpointRow.uri == uri,
                    CheckpointRow.status.in_([CheckpointStatus.PENDING, CheckpointStatus.VERIFIED]),
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
                    select(CheckpointRow)
                    .where(
                        CheckpointRow.job_id == job_id,
                        CheckpointRow.status == CheckpointStatus.PENDING,
                        CheckpointRow.step <= step,
                    )
                    .order_by(CheckpointRow.step, CheckpointRow.id)
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
            rows = s.scalars(
                select(CheckpointRow)
                .where(CheckpointRow.job_id == job_id)
                .order_by(CheckpointRow.step, CheckpointRow.id)
            )
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
            query = select(CheckpointRow).where(
                CheckpointRow.job_id == job_id,
                CheckpointRow.step >= start,
                CheckpointRow.status.in_([CheckpointStatus.PENDING, CheckpointStatus.VERIFIED]),
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
            query = select(CheckpointRow).where(
                CheckpointRow.job_id == job_id, CheckpointRow.step == step
            )
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
                select(CheckpointRow)
                .where(
                    CheckpointRow.job_id == job_id,
                    CheckpointRow.status == CheckpointStatus.VERIFIED,
                    CheckpointRow.step < before_step,
                )
                .order_by(CheckpointRow.step.desc(), CheckpointRow.id.desc())
            )
            return [_checkpoint_view(row) for row in rows]

        return self._read("resume_candidates", work)

    def resume_checkpoint(self, job_id: str, before_step: int) -> CheckpointView | None:
        """The newest verified checkpoint strictly before ``before_step``, if any."""
        candidates = self.resume_candidates(job_id, before_step)
        return candidates[0] if candidates else None

    # ------------------------------------------------------------------ incidents

    def open_incident(
        self, job_id: str, *, start: int, end: int, suspect_nodes: Sequence[str]
    ) -> IncidentView:
        """Open an incident by hand (e.g. an operator's report); alarms usually do this."""
        _require_text("job_id", job_id)
        _require_range(start, end)
        nodes = [_require_text("suspect node", n) for n in suspect_nodes]

        def work(s: Session) -> IncidentView:
            self._require_job(s, job_id, lock=True)
            active = _active_incident(s, job_id)
            if active is not None:
                raise IncidentConflict(job_id, active.id)
            row = self._new_incident(
                s, job_id, start=start, end=end, suspect_nodes=nodes, reason="opened by request"
            )
            return _incident_view(s, row)

        view = self._write("open_incident", work)
        _log.info("incident opened", extra={"job": job_id, "incident": view.id})
        return view

    def open_incident_for(self, job_id: str) -> IncidentView | None:
        """The job's non-terminal incident, if it has one (at most one exists)."""

        def work(s: Session) -> IncidentView | None:
            row = _active_incident(s, job_id)
            return None if row is None else _incident_view(s, row)

        return self._read("open_incident_for", work)

    def get_incident(self, incident_id: str) -> IncidentView:
        """The incident with its alarms, actions and history."""

        def work(s: Session) -> IncidentView:
            row = s.get(IncidentRow, incident_id)
            if row is None:
                raise UnknownIncident(incident_id)
            return _incident_view(s, row)

        return self._read("get_incident", work)

    def list_incidents(
        self, job_id: str | None = None, state: IncidentState | None = None
    ) -> list[IncidentView]:
        """Incidents, newest first, optionally of one job and/or in one state."""
        wanted = None if state is None else _parse_enum(IncidentState, "state", state)

        def work(s: Session) -> list[IncidentView]:
            query = select(IncidentRow)
            if job_id is not None:
                query = query.where(IncidentRow.job_id == job_id)
            if wanted is not None:
                query = query.where(IncidentRow.state == wanted)
            rows = list(s.scalars(query.order_by(IncidentRow.opened_at.desc(), IncidentRow.id)))
            return _incident_views(s, rows)

        return self._read("list_incidents", work)

    def transition(
        self,
        incident_id: str,
        to: IncidentState,
        *,
        reason: str | None = None,
        verdict: Verdict | None = None,
        evidence: dict[str, Any] | None = None,
        approver: str | None = None,
        approval_reason: str | None = None,
        decision: str | None = None,
        storm: bool | None = None,
    ) -> IncidentView:
        """Move an incident along its state machine, recording the given fields with the move.

        See :func:`db.enums.can_transition` for the legal moves. Moving to the current state
        changes nothing unless new field values come with it; those are recorded while the
        incident is live, and refused once it is terminal (a closed record is final). With
        ``storm=True`` the ``reason`` is kept as the storm reason. Every change appends a row
        to the incident's history.
        """
        target = _parse_enum(IncidentState, "state", to)
        given: dict[str, Any] = {
            "verdict": None if verdict is None else _parse_enum(Verdict, "verdict", verdict),
            "evidence": None if evidence is None else _json_dict("evidence", evidence),
            "approver": _optional_text("approver", approver),
            "approval_reason": approval_reason,
            "decision": _optional_text("decision", decision, max_len=64),
            "storm": storm,
        }
        if storm is not None and not isinstance(storm, bool):
            raise InvalidValue(f"storm must be a bool, not {storm!r}")

        def work(s: Session) -> IncidentView:
            row = s.scalars(
                select(IncidentRow).where(IncidentRow.id == incident_id).with_for_update()
            ).one_or_none()
            if row is None:
                raise UnknownIncident(incident_id)
            current = row.state
            if not can_transition(current, target):
                raise IllegalTransition(incident_id, current, target)
            updates = {
                name: value
                for name, value in given.items()
                if value is not None and getattr(row, name) != value
            }
            if current == target and not updates:
                return _incident_view(s, row)
            if current == target and current.terminal:
                raise IllegalTransition(
                    incident_id,
                    current,
                    target,
                    f"its record is final; refusing to change {', '.join(sorted(updates))}",
                )
            now = self._clock()
            for name, value in updates.items():
                setattr(row, name, value)
            if "approver" in updates or "decision" in updates:
                row.decided_at = now
            if storm is not None:
                row.storm_reason = reason if storm else None
            if current != target:
                row.state = target
                if reason is not None:
                    row.reason = reason
                if target.terminal:
                    row.closed_at = now
            row.updated_at = now
            s.add(
                IncidentEventRow(
                    incident_id=row.id,
                    from_state=current,
                    to_state=target,
                    reason=reason,
                    detail=_jsonable_updates(updates) or None,
                    at=now,
                )
            )
            s.flush()
            return _incident_view(s, row)

        view = self._write("transition", work)
        _log.info(
            "incident transition",
            extra={"incident": incident_id, "job": view.job_id, "state": view.state.value},
        )
        return view

    # ------------------------------------------------------------------ actions

    def claim_action(
        self, incident_id: str, kind: str, target: str, detail: dict[str, Any] | None = None
    ) -> ActionClaim:
        """Claim the right to perform one side effect of an incident, exactly once.

        The idempotency key is ``f"{incident_id}:{kind}:{target}"``. Of concurrent callers
        exactly one wins. An action that is claimed (in flight) or succeeded is never won
        again — the caller gets ``won=False`` and the action as it stands; a failed one may be
        claimed again, counting one more attempt. Every won claim appends an event row.
        """
        _require_text("incident_id", incident_id, max_len=36)
        _require_text("kind", kind, max_len=64)
        if ":" in kind:
            raise InvalidValue(f"action kind must not contain ':': {kind!r}")
        _require_text("target", target)
        claim_detail = None if detail is None else _json_dict("detail", detail)
        key = f"{incident_id}:{kind}:{target}"

        def work(s: Session) -> ActionClaim:
            if s.get(IncidentRow, incident_id) is None:
                raise UnknownIncident(incident_id)
            row = s.scalars(
                select(ActionRow).where(ActionRow.key == key).with_for_update()
            ).one_or_none()
            now = self._clock()
            if row is None:
                row = ActionRow(
                    key=key,
                    incident_id=incident_id,
                    kind=kind,
                    target=target,
                    status=ActionStatus.CLAIMED,
                    attempts=1,
                    created_at=now,
                    started_at=now,
                    finished_at=None,
                    detail=claim_detail,
                )
                s.add(row)
                s.flush()
            elif row.status == ActionStatus.FAILED:
                row.status = ActionStatus.CLAIMED
                row.attempts += 1
                row.started_at = now
                row.finished_at = None
                if claim_detail is not None:
                    row.detail = {**(row.detail or {}), **claim_detail}
            else:
                return ActionClaim(won=False, action=_action_view(row))
            s.add(
                ActionEventRow(
                    action_key=key,
                    incident_id=incident_id,
                    status=ActionStatus.CLAIMED,
                    attempt=row.attempts,
                    detail=claim_detail,
                    at=now,
                )
            )
            s.flush()
            return ActionClaim(won=True, action=_action_view(row))

        claim = self._write("claim_action", work)
        _log.info(
            "action claim",
            extra={"incident": incident_id, "action": key, "won": claim.won},
        )
        return claim

    def finish_action(
        self, key: str, status: ActionStatus, detail: dict[str, Any] | None = None
    ) -> ActionView:
        """Record the outcome of a claimed action (``succeeded`` or ``failed``).

        Repeating the same outcome is a no-op (a retried task); finishing an action that is
        not claimed any other way raises :class:`ActionStateError`.
        """
        _require_text("key", key, max_len=512)
        outcome = _parse_enum(ActionStatus, "status", status)
        if outcome == ActionStatus.CLAIMED:
            raise InvalidValue("finish_action takes succeeded or failed; claim with claim_action")
        finish_detail = None if detail is None else _json_dict("detail", detail)

        def work(s: Session) -> ActionView:
            row = s.scalars(
                select(ActionRow).where(ActionRow.key == key).with_for_update()
            ).one_or_none()
            if row is None:
                raise UnknownAction(key)
            if row.status == outcome:
                return _action_view(row)
            if row.status != ActionStatus.CLAIMED:
                raise ActionStateError(key, row.status.value, outcome.value)
            now = self._clock()
            row.status = outcome
            row.finished_at = now
            if finish_detail is not None:
                row.detail = {**(row.detail or {}), **finish_detail}
            s.add(
                ActionEventRow(
                    action_key=key,
                    incident_id=row.incident_id,
                    status=outcome,
                    attempt=row.attempts,
                    detail=finish_detail,
                    at=now,
                )
            )
            s.flush()
            return _action_view(row)

        view = self._write("finish_action", work)
        _log.info(
            "action finished",
            extra={"incident": view.incident_id, "action": key, "status": outcome.value},
        )
        return view

    def actions(self, incident_id: str) -> list[ActionView]:
        """The incident's actions in the order they were first claimed."""

        def work(s: Session) -> list[ActionView]:
            if s.get(IncidentRow, incident_id) is None:
                raise UnknownIncident(incident_id)
            return _action_views(s, [incident_id]).get(incident_id, [])

        return self._read("actions", work)

    def action_events(self, incident_id: str) -> list[ActionEventView]:
        """The incident's append-only action trail, oldest first."""

        def work(s: Session) -> list[ActionEventView]:
            if s.get(IncidentRow, incident_id) is None:
                raise UnknownIncident(incident_id)
            rows = s.scalars(
                select(ActionEventRow)
                .where(ActionEventRow.incident_id == incident_id)
                .order_by(ActionEventRow.id)
            )
            return [
                ActionEventView(
                    id=row.id,
                    action_key=row.action_key,
                    incident_id=row.incident_id,
                    status=row.status,
                    attempt=row.attempt,
                    detail=row.detail,
                    at=row.at,
                )
                for row in rows
            ]

        return self._read("action_events", work)

    # ------------------------------------------------------------------ internals

    def _write(self, operation: str, work: Callable[[Session], _T]) -> _T:
        """Run ``work`` in one write transaction, re-running it after a lost unique-key race."""
        last: DBAPIError | None = None
        for attempt in range(1, _MAX_ATTEMPTS + 1):
            try:
                with Session(self.engine, expire_on_commit=False) as session, session.begin():
                    return work(session)
            except IntegrityError as err:
                if not _is_unique_violation(err):
                    raise LedgerError(f"{operation}: constraint violated: {err.orig}") from err
                last = err
            except DBAPIError as err:
                if _sqlstate(err) not in _RETRYABLE_SQLSTATES:
                    raise _translate(operation, err) from err
                last = err
            except PoolTimeoutError as err:
                raise LedgerUnavailable(f"{operation}: no database connection free") from err
            _log.debug("write race lost; retrying", extra={"operation": operation, "n": attempt})
        raise LedgerContention(operation, _MAX_ATTEMPTS) from last

    def _read(self, operation: str, work: Callable[[Session], _T]) -> _T:
        try:
            with Session(self._read_engine) as session, session.begin():
                return work(session)
        except DBAPIError as err:
            raise _translate(operation, err) from err
        except PoolTimeoutError as err:
            raise LedgerUnavailable(f"{operation}: no database connection free") from err

    def _ensure_job(self, s: Session, job_id: str, *, lock: bool = False) -> JobRow:
        row = _job(s, job_id, lock=lock)
        if row is None:
            row = JobRow(id=job_id, created_at=self._clock())
            s.add(row)
            s.flush()
            _log.debug("job row added", extra={"job": job_id})
        return row

    def _require_job(self, s: Session, job_id: str, *, lock: bool = False) -> JobRow:
        row = _job(s, job_id, lock=lock)
        if row is None:
            raise UnknownJob(job_id)
        return row

    def _new_incident(
        self,
        s: Session,
        job_id: str,
        *,
        start: int,
        end: int,
        suspect_nodes: list[str],
        reason: str,
    ) -> IncidentRow:
        now = self._clock()
        has_ranks = s.scalar(select(exists().where(RankRow.job_id == job_id)))
        row = IncidentRow(
            id=str(uuid.uuid4()),
            job_id=job_id,
            state=IncidentState.OPEN,
            suspect_start=start,
            suspect_end=end,
            suspect_nodes=sorted(set(suspect_nodes)),
            verdict=None,
            evidence=None,
            approver=None,
            approval_reason=None,
            decision=None,
            decided_at=None,
            reason=reason,
            ranks_missing=not has_ranks,
            storm=False,
            storm_reason=None,
            opened_at=now,
            updated_at=now,
            closed_at=None,
        )
        s.add(row)
        s.flush()  # a rival's open incident for this job surfaces here, as a unique violation
        s.add(
            IncidentEventRow(
                incident_id=row.id,
                from_state=None,
                to_state=IncidentState.OPEN,
                reason=reason,
                detail=None,
                at=now,
            )
        )
        return row

    def _record_alarms(self, s: Session, batch: Sequence[AlarmIn]) -> list[AlarmOutcome]:
        """The body of :meth:`record_alarms`: set-based, a fixed number of round trips.

        Statements per batch: look up the stored ids; lock (or create) the jobs of the new
        alarms, in id order so that concurrent batches cannot deadlock; look the ids up again
        (the locks serialised us behind any rival recording them); lock the open incidents;
        open the missing ones; widen each incident once; one executemany INSERT of the new alarms.
        """
        stored = _stored_alarm_incidents(s, [alarm.alarm_id for alarm in batch])
        fresh: dict[str, AlarmIn] = {}  # first copy of each new id: later copies are duplicates
        for alarm in batch:
            if alarm.alarm_id not in stored:
                fresh.setdefault(alarm.alarm_id, alarm)
        if not fresh:
            return [AlarmOutcome(stored[a.alarm_id], duplicate=True, opened=False) for a in batch]
        jobs = sorted({alarm.job_id for alarm in fresh.values()})
        self._lock_jobs(s, jobs)
        stored.update(_stored_alarm_incidents(s, list(fresh)))
        incidents = _active_incidents(s, jobs)
        now = self._clock()
        outcomes: list[AlarmOutcome] = []
        growth: dict[str, _Growth] = {}
        rows: list[dict[str, Any]] = []
        for alarm in batch:
            known = stored.get(alarm.alarm_id)
            if known is not None:
                outcomes.append(AlarmOutcome(known, duplicate=True, opened=False))
                continue
            nodes = [str(n) for n in alarm.suspect_nodes]
            incident = incidents.get(alarm.job_id)
            opened = incident is None
            if incident is None:
                incident = self._new_incident(
                    s,
                    alarm.job_id,
                    start=0,
                    end=alarm.step,
                    suspect_nodes=nodes or [alarm.node],
                    reason=f"alarm {alarm.alarm_id} at step {alarm.step}",
                )
                incidents[alarm.job_id] = incident
            grown = growth.get(incident.id)
            if grown is None:
                grown = growth[incident.id] = _Growth(incident, opened, alarm.step, alarm.step)
            grown.add(alarm.step, nodes or [alarm.node])
            stored[alarm.alarm_id] = incident.id  # a later copy in this batch is a duplicate
            rows.append(
                {
                    "id": alarm.alarm_id,
                    "job_id": alarm.job_id,
                    "incident_id": incident.id,
                    "step": alarm.step,
                    "rank": alarm.rank,
                    "node": alarm.node,
                    "layer": alarm.layer,
                    "phase": alarm.phase,
                    "suspect_ranks": [int(r) for r in alarm.suspect_ranks],
                    "suspect_nodes": nodes,
                    "detail": dict(alarm.detail),
                    "sent_at": None if alarm.sent_at is None else _as_utc(alarm.sent_at),
                    "received_at": now,
                }
            )
            outcomes.append(AlarmOutcome(incident.id, duplicate=False, opened=opened))
        for grown in growth.values():  # before the INSERT: it asks about earlier alarms only
            self._widen(s, grown)
        if rows:  # empty when a rival stored every one of them while we waited for the lock
            s.execute(insert(AlarmRow), rows)
        return outcomes

    def _lock_jobs(self, s: Session, job_ids: Sequence[str]) -> None:
        """Lock the jobs' rows in id order, creating the missing ones (``job_ids`` sorted).

        A rival creating the same job at the same moment ends in a unique violation on flush;
        :meth:`_write` re-runs the transaction, which then finds and locks the winner's row.
        """
        found: set[str] = set()
        for chunk in _chunks(job_ids):
            found.update(
                s.scalars(
                    select(JobRow.id)
                    .where(JobRow.id.in_(chunk))
                    .order_by(JobRow.id)
                    .with_for_update()
                )
            )
        missing = [job_id for job_id in job_ids if job_id not in found]
        if missing:
            now = self._clock()
            s.add_all(JobRow(id=job_id, created_at=now) for job_id in missing)
            s.flush()
            _log.debug("job rows added", extra={"jobs": missing})

    def _widen(self, s: Session, grown: _Growth) -> None:
        """Grow the incident's range and nodes by the alarms of this batch, incrementally.

        Invariant: the incident's stored range and nodes already cover every alarm stored
        before, so the new alarms only extend the end (max) and the nodes (union). The start is
        ``latest passed audit strictly before the earliest alarm step, + 1`` (else 0) and never
        moves up; it is recomputed only when the earliest alarm step moves down — a start of 0
        cannot move at all, and otherwise one indexed EXISTS asks whether an earlier alarm of
        the incident already lies at or before the batch's earliest step. No alarm is re-read.
        So evidence recorded after the earliest alarm (a later audit, or a job's first ring
        audit demoting its fingerprint votes) never moves the start; an earlier alarm does.
        """
        incident = grown.incident
        if grown.opened:
            incident.suspect_start = _suspect_start(s, incident.job_id, grown.first)
            incident.suspect_end = grown.last
            incident.suspect_nodes = sorted(grown.nodes)
        else:
            if incident.suspect_start > 0 and not _has_alarm_at_or_before(s, incident, grown.first):
                incident.suspect_start = min(
                    incident.suspect_start, _suspect_start(s, incident.job_id, grown.first)
                )
            incident.suspect_end = max(incident.suspect_end, grown.last)
            nodes = grown.nodes.union(incident.suspect_nodes)
            if nodes != set(incident.suspect_nodes):
                incident.suspect_nodes = sorted(nodes)
        incident.updated_at = self._clock()  # flushed with the batch: one UPDATE per incident


@dataclass
class _Growth:
    """What one batch adds to one incident: its alarms' step bounds and suspect nodes."""

    incident: IncidentRow
    opened: bool
    first: int
    last: int
    nodes: set[str] = field(default_factory=set)

    def add(self, step: int, nodes: Sequence[str]) -> None:
        self.first = min(self.first, step)
        self.last = max(self.last, step)
        self.nodes.update(nodes)


# ---------------------------------------------------------------------- query helpers


def _job(s: Session, job_id: str, *, lock: bool) -> JobRow | None:
    query = select(JobRow).where(JobRow.id == job_id)
    if lock:
        query = query.with_for_update()
    return s.scalars(query).one_or_none()


def _active_incident(s: Session, job_id: str, *, lock: bool = False) -> IncidentRow | None:
    query = select(IncidentRow).where(
        IncidentRow.job_id == job_id, IncidentRow.state.in_(_ACTIVE_STATES)
    )
    if lock:
        query = query.with_for_update()
    return s.scalars(query).one_or_none()


def _active_incidents(s: Session, job_ids: Sequence[str]) -> dict[str, IncidentRow]:
    """The jobs' non-terminal incidents by job, locked (at most one per job exists)."""
    result: dict[str, IncidentRow] = {}
    for chunk in _chunks(job_ids):
        query = (
            select(IncidentRow)
            .where(IncidentRow.job_id.in_(chunk), IncidentRow.state.in_(_ACTIVE_STATES))
            .order_by(IncidentRow.job_id)
            .with_for_update()
        )
        result.update((row.job_id, row) for row in s.scalars(query))
    return result


def _stored_alarm_incidents(s: Session, alarm_ids: Sequence[str]) -> dict[str, str]:
    """Incident id by alarm id, for the ids already stored: one primary-key lookup per chunk."""
    result: dict[str, str] = {}
    for chunk in _chunks(list(dict.fromkeys(alarm_ids))):
        rows = s.execute(select(AlarmRow.id, AlarmRow.incident_id).where(AlarmRow.id.in_(chunk)))
        result.update((alarm_id, incident_id) for alarm_id, incident_id in rows)
    return result


def _has_alarm_at_or_before(s: Session, incident: IncidentRow, step: int) -> bool:
    """Whether a stored alarm of the incident lies at or before ``step``.

    Phrased on the job's ``(job_id, step)`` index: the scan covers only the job's alarms up to
    ``step``, and stops at the first one of this incident — O(1) in a storm of equal steps.
    """
    found = s.scalar(
        select(
            exists().where(
                AlarmRow.job_id == incident.job_id,
                AlarmRow.step <= step,
                AlarmRow.incident_id == incident.id,
            )
        )
    )
    return bool(found)


def _chunks(items: Sequence[str]) -> list[Sequence[str]]:
    """Slices short enough for one ``IN (...)`` list on every backend."""
    return [items[i : i + _IN_CHUNK] for i in range(0, len(items), _IN_CHUNK)]


def _evidence_kinds(s: Session, job_id: str) -> frozenset[AuditKind]:
    """Audit kinds that count as evidence for the job: ring audits if it runs any."""
    has_ring = s.scalar(
        select(exists().where(AuditRow.job_id == job_id, AuditRow.kind.in_(list(RING_AUDIT_KINDS))))
    )
    return RING_AUDIT_KINDS if has_ring else frozenset({AuditKind.FINGERPRINT})


def _suspect_start(s: Session, job_id: str, first_alarm_step: int) -> int:
    """One past the latest passed audit before the first alarm, in the current timeline."""
    since = s.scalar(
        select(func.max(IncidentRow.closed_at)).where(
            IncidentRow.job_id == job_id, IncidentRow.state == IncidentState.RESOLVED
        )
    )
    query = select(func.max(AuditRow.step)).where(
        AuditRow.job_id == job_id,
        AuditRow.passed.is_(True),
        AuditRow.kind.in_(list(_evidence_kinds(s, job_id))),
        AuditRow.step < first_alarm_step,
    )
    if since is not None:
        query = query.where(AuditRow.at > since)
    latest = s.scalar(query)
    return 0 if latest is None else latest + 1


def _action_views(s: Session, incident_ids: Sequence[str]) -> dict[str, list[ActionView]]:
    result: dict[str, list[ActionView]] = {}
    if not incident_ids:
        return result
    rows = s.scalars(
        select(ActionRow)
        .where(ActionRow.incident_id.in_(incident_ids))
        .order_by(ActionRow.created_at, ActionRow.key)
    )
    for row in rows:
        result.setdefault(row.incident_id, []).append(_action_view(row))
    return result


def _incident_views(s: Session, rows: Sequence[IncidentRow]) -> list[IncidentView]:
    ids = [row.id for row in rows]
    alarms: dict[str, list[AlarmView]] = {}
    history: dict[str, list[IncidentEventView]] = {}
    if ids:
        for alarm in s.scalars(
            select(AlarmRow)
            .where(AlarmRow.incident_id.in_(ids))
            .order_by(AlarmRow.step, AlarmRow.received_at, AlarmRow.id)
        ):
            alarms.setdefault(alarm.incident_id, []).append(_alarm_view(alarm))
        for event in s.scalars(
            select(IncidentEventRow)
            .where(IncidentEventRow.incident_id.in_(ids))
            .order_by(IncidentEventRow.id)
        ):
            history.setdefault(event.incident_id, []).append(
                IncidentEventView(
                    from_state=event.from_state,
                    to_state=event.to_state,
                    reason=event.reason,
                    detail=event.detail,
                    at=event.at,
                )
            )
    actions = _action_views(s, ids)
    return [
        IncidentView(
            id=row.id,
            job_id=row.job_id,
            state=row.state,
            suspect_start=row.suspect_start,
            suspect_end=row.suspect_end,
            suspect_nodes=list(row.suspect_nodes),
            verdict=row.verdict,
            evidence=row.evidence,
            approver=row.approver,
            approval_reason=row.approval_reason,
            decision=row.decision,
            ranks_missing=row.ranks_missing,
            storm=row.storm,
            opened_at=row.opened_at,
            updated_at=row.updated_at,
            alarms=alarms.get(row.id, []),
            actions=actions.get(row.id, []),
            decided_at=row.decided_at,
            storm_reason=row.storm_reason,
            reason=row.reason,
            closed_at=row.closed_at,
            history=history.get(row.id, []),
        )
        for row in rows
    ]


def _incident_view(s: Session, row: IncidentRow) -> IncidentView:
    s.flush()
    return _incident_views(s, [row])[0]


# ---------------------------------------------------------------------- row → view


def _rank_view(row: RankRow) -> RankView:
    return RankView(
        job_id=row.job_id,
        rank=row.rank,
        local_rank=row.local_rank,
        node=row.node,
        instance_id=row.instance_id,
        gpu_uuid=row.gpu_uuid,
        first_seen=row.first_seen,
        last_seen=row.last_seen,
    )


def _alarm_view(row: AlarmRow) -> AlarmView:
    return AlarmView(
        alarm_id=row.id,
        job_id=row.job_id,
        incident_id=row.incident_id,
        step=row.step,
        rank=row.rank,
        node=row.node,
        layer=row.layer,
        phase=row.phase,
        suspect_ranks=list(row.suspect_ranks),
        suspect_nodes=list(row.suspect_nodes),
        detail=dict(row.detail),
        sent_at=row.sent_at,
        received_at=row.received_at,
    )


def _checkpoint_view(row: CheckpointRow) -> CheckpointView:
    return CheckpointView(
        job_id=row.job_id,
        step=row.step,
        uri=row.uri,
        sha256=row.sha256,
        fingerprint=row.fingerprint,
        nodes=list(row.nodes),
        status=row.status,
        evidence=row.evidence,
        audited_through=row.audited_through,
        reason=row.reason,
    )


def _action_view(row: ActionRow) -> ActionView:
    return ActionView(
        key=row.key,
        incident_id=row.incident_id,
        kind=row.kind,
        target=row.target,
        status=row.status,
        attempts=row.attempts,
        started_at=row.started_at,
        finished_at=row.finished_at,
        detail=None if row.detail is None else dict(row.detail),
    )


# ---------------------------------------------------------------------- validation and errors

_E = TypeVar("_E", IncidentState, Verdict, AuditKind, ActionStatus)


def _parse_enum(enum_cls: type[_E], name: str, value: object) -> _E:
    allowed = ", ".join(member.value for member in enum_cls)
    if not isinstance(value, str):
        raise InvalidValue(f"{name} must be one of {allowed}; got {value!r}")
    try:
        return enum_cls(value)
    except ValueError as err:
        raise InvalidValue(f"{name} must be one of {allowed}; got {value!r}") from err


def _require_text(name: str, value: object, *, max_len: int = _ID_MAX) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidValue(f"{name} must be a non-empty string, not {value!r}")
    if len(value) > max_len:
        raise InvalidValue(f"{name} is longer than {max_len} characters")
    return value


def _optional_text(name: str, value: str | None, *, max_len: int = _ID_MAX) -> str | None:
    return None if value is None else _require_text(name, value, max_len=max_len)


def _require_step(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidValue(f"{name} must be an integer >= 0, not {value!r}")
    return value


def _require_range(start: int, end: int | None) -> None:
    _require_step("start", start)
    if end is not None:
        _require_step("end", end)
        if start > end:
            raise InvalidRange(start, end)


def _json_dict(name: str, value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidValue(f"{name} must be a JSON object, not {type(value).__name__}")
    try:
        json.dumps(value)
    except (TypeError, ValueError) as err:
        raise InvalidValue(f"{name} is not JSON-serialisable: {err}") from err
    return dict(value)


def _validate_alarm(alarm: AlarmIn) -> None:
    _require_text("alarm_id", alarm.alarm_id, max_len=128)
    _require_text("job_id", alarm.job_id)
    _require_step("step", alarm.step)
    _require_step("rank", alarm.rank)
    _require_text("node", alarm.node)
    _require_text("layer", alarm.layer, max_len=64)
    _require_text("phase", alarm.phase, max_len=64)
    for rank in alarm.suspect_ranks:
        _require_step("suspect rank", rank)
    for node in alarm.suspect_nodes:
        _require_text("suspect node", node)
    _json_dict("detail", alarm.detail)
    if alarm.sent_at is not None and not isinstance(alarm.sent_at, datetime):
        raise InvalidValue(f"sent_at must be a datetime, not {alarm.sent_at!r}")


def _as_utc(value: datetime) -> datetime:
    """Naive datetimes are taken to be UTC already (RFC 3339 senders always give an offset)."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _jsonable_updates(updates: dict[str, Any]) -> dict[str, Any]:
    return {
        name: value.value if isinstance(value, Verdict) else value
        for name, value in updates.items()
    }


def _sqlstate(err: DBAPIError) -> str | None:
    state = getattr(err.orig, "sqlstate", None)
    return state if isinstance(state, str) else None


def _is_unique_violation(err: IntegrityError) -> bool:
    if _sqlstate(err) == "23505":
        return True
    return "UNIQUE constraint failed" in str(err.orig)


def _translate(operation: str, err: DBAPIError) -> LedgerError:
    """Map a driver error to the ledger's temporary/permanent split."""
    message = str(err.orig)
    if _sqlstate(err) == "42P01" or "no such table" in message:
        return SchemaNotReady(
            f"{operation}: the ledger tables are missing ({message.strip()}); "
            "run db.migrate.upgrade(url) first"
        )
    if isinstance(err, OperationalError):
        return LedgerUnavailable(f"{operation}: database unavailable: {message.strip()}")
    return LedgerError(f"{operation}: database error: {message.strip()}")
