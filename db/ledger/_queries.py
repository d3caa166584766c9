"""Row lookups and inserts that more than one part of the ledger runs inside its transaction.

Each helper takes the caller's session and neither commits nor rolls back: the public method
that called it owns the transaction. ``lock=True`` adds ``FOR UPDATE`` (a no-op on SQLite,
whose write transactions are serialised by ``BEGIN IMMEDIATE``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Select, exists, select
from sqlalchemy.orm import Session

from db.enums import RING_AUDIT_KINDS, TERMINAL_STATES, AuditKind, IncidentState
from db.errors import UnknownIncident
from db.models import ActionRow, AuditRow, IncidentEventRow, IncidentRow, JobRow, RankRow

_R = TypeVar("_R")

_ACTIVE_STATES = tuple(s for s in IncidentState if s not in TERMINAL_STATES)
# Ids per IN list: far below SQLite's and PostgreSQL's bind-parameter limits.
_IN_CHUNK = 1000


def _one(s: Session, query: Select[_R], *, lock: bool) -> _R | None:
    """The single row ``query`` selects, or None; locked for update when ``lock``."""
    if lock:
        query = query.with_for_update()
    return s.scalars(query).one_or_none()


def _job(s: Session, job_id: str, *, lock: bool) -> JobRow | None:
    return _one(s, select(JobRow).where(JobRow.id == job_id), lock=lock)


def _active_incident(s: Session, job_id: str, *, lock: bool = False) -> IncidentRow | None:
    query = select(IncidentRow).where(
        IncidentRow.job_id == job_id, IncidentRow.state.in_(_ACTIVE_STATES)
    )
    return _one(s, query, lock=lock)


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


def _require_incident(s: Session, incident_id: str, *, lock: bool = False) -> IncidentRow:
    """The incident's row; :class:`UnknownIncident` when there is none."""
    if lock:
        row = _one(s, select(IncidentRow).where(IncidentRow.id == incident_id), lock=True)
    else:
        row = s.get(IncidentRow, incident_id)
    if row is None:
        raise UnknownIncident(incident_id)
    return row


def _action(s: Session, key: str) -> ActionRow | None:
    """The action with this idempotency key, locked: claims and outcomes of it serialise."""
    return _one(s, select(ActionRow).where(ActionRow.key == key), lock=True)


def _chunks(items: Sequence[str]) -> list[Sequence[str]]:
    """Slices short enough for one ``IN (...)`` list on every backend."""
    return [items[i : i + _IN_CHUNK] for i in range(0, len(items), _IN_CHUNK)]


def _evidence_kinds(s: Session, job_id: str) -> frozenset[AuditKind]:
    """Audit kinds that count as evidence for the job: ring audits if it runs any."""
    has_ring = s.scalar(
        select(exists().where(AuditRow.job_id == job_id, AuditRow.kind.in_(list(RING_AUDIT_KINDS))))
    )
    return RING_AUDIT_KINDS if has_ring else frozenset({AuditKind.FINGERPRINT})


def _new_incident(
    s: Session,
    job_id: str,
    *,
    now: datetime,
    start: int,
    end: int,
    suspect_nodes: list[str],
    reason: str,
) -> IncidentRow:
    """Insert an open incident and its first history row; the caller checked none is active.

    Invariant: at most one non-terminal incident per job. A rival's open incident for the job
    surfaces here as a unique violation, and the caller's transaction is re-run.
    """
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
    _append_event(s, row, None, IncidentState.OPEN, reason, None, now)
    return row


def _append_event(
    s: Session,
    row: IncidentRow,
    from_state: IncidentState | None,
    to_state: IncidentState,
    reason: str | None,
    detail: dict[str, Any] | None,
    at: datetime,
) -> None:
    """One row of the incident's append-only history: a state change, or a change in place."""
    s.add(
        IncidentEventRow(
            incident_id=row.id,
            from_state=from_state,
            to_state=to_state,
            reason=reason,
            detail=detail,
            at=at,
        )
    )
