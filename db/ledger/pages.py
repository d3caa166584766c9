"""Incidents a page at a time, for the read API: a bounded answer whatever the ledger holds.

Invariant: walking the pages from no cursor until ``next_after`` is ``None`` yields every
incident that existed when the walk began exactly once, newest first, even while new
incidents open (they sort before the cursor and are not repeated). The order is
``(opened_at desc, id asc)``; a cursor is the last row's pair, so each page is one indexed
range scan, not an OFFSET that rescans what came before.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from db.enums import IncidentState
from db.errors import InvalidValue
from db.ledger._base import LedgerBase
from db.ledger._validate import _parse_enum
from db.models import AlarmRow, IncidentRow

__all__ = ["IncidentPage", "PagesMixin"]

MAX_PAGE = 200


_SUMMARY = (
    "id",
    "job_id",
    "state",
    "suspect_start",
    "suspect_end",
    "suspect_nodes",
    "verdict",
    "decision",
    "ranks_missing",
    "storm",
    "outside_rank_map",
    "opened_at",
    "updated_at",
    "closed_at",
)


@dataclass(frozen=True)
class IncidentPage:
    """One page of incident summaries (JSON-safe dicts: the incident's own fields, its alarm
    count, ``needs_review``; no alarms, actions or history — ``get_incident`` has those, so a
    page costs the same whether an incident holds one alarm or a storm of 4,096).
    ``next_after`` is the cursor of the next page, ``None`` on the last one."""

    incidents: list[dict[str, Any]]
    next_after: tuple[datetime, str] | None


class PagesMixin(LedgerBase):
    """:class:`db.ledger.Ledger`'s paginated incident listing."""

    def list_incidents_page(
        self,
        job_id: str | None = None,
        state: IncidentState | None = None,
        *,
        limit: int = 50,
        after: tuple[datetime, str] | None = None,
        jobs: frozenset[str] | None = None,
    ) -> IncidentPage:
        """Up to ``limit`` incidents after the cursor ``after``, newest first.

        ``jobs``, when given, restricts the listing to those job ids (a reader scoped to some
        jobs never sees the others, not even as a count).
        """
        if isinstance(limit, bool) or not 1 <= limit <= MAX_PAGE:
            raise InvalidValue(f"limit must be between 1 and {MAX_PAGE}")
        wanted = None if state is None else _parse_enum(IncidentState, "state", state)

        def work(s: Session) -> IncidentPage:
            query = select(IncidentRow)
            if job_id is not None:
                query = query.where(IncidentRow.job_id == job_id)
            if jobs is not None:
                query = query.where(IncidentRow.job_id.in_(sorted(jobs)))
            if wanted is not None:
                query = query.where(IncidentRow.state == wanted)
            if after is not None:
                at, last_id = after
                query = query.where(
                    or_(
                        IncidentRow.opened_at < at,
                        and_(IncidentRow.opened_at == at, IncidentRow.id > last_id),
                    )
                )
            rows = list(
                s.scalars(
                    query.order_by(IncidentRow.opened_at.desc(), IncidentRow.id).limit(limit + 1)
                )
            )
            more = len(rows) > limit
            rows = rows[:limit]
            cursor = (rows[-1].opened_at, rows[-1].id) if more and rows else None
            counts: dict[str, int] = {}
            if rows:
                counted = s.execute(
                    select(AlarmRow.incident_id, func.count())
                    .where(AlarmRow.incident_id.in_([row.id for row in rows]))
                    .group_by(AlarmRow.incident_id)
                )
                counts = {incident_id: int(n) for incident_id, n in counted}
            return IncidentPage([_summary(row, counts.get(row.id, 0)) for row in rows], cursor)

        return self._read("list_incidents_page", work)


def _summary(row: IncidentRow, alarms: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in _SUMMARY:
        value = getattr(row, name)
        if isinstance(value, datetime):
            value = value.isoformat()
        elif hasattr(value, "value"):
            value = value.value
        elif isinstance(value, list):
            value = list(value)
        out[name] = value
    out["outside_rank_map"] = list(row.outside_rank_map or [])
    out["needs_review"] = bool(out["outside_rank_map"])
    out["alarm_count"] = alarms
    return out
