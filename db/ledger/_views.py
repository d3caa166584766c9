"""Row to view: the frozen copies the ledger hands out instead of its ORM rows.

Invariant: a view shares no mutable state with a row (lists and dicts are copied), so a caller
can neither write to the database behind the ledger's back nor see a later change.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from db.models import (
    ActionEventRow,
    ActionRow,
    AlarmRow,
    CheckpointRow,
    IncidentEventRow,
    IncidentRow,
    RankRow,
)
from db.views import (
    ActionEventView,
    ActionView,
    AlarmView,
    CheckpointView,
    IncidentEventView,
    IncidentView,
    RankView,
)


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
            history.setdefault(event.incident_id, []).append(_incident_event_view(event))
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
            outside_rank_map=list(row.outside_rank_map or []),
        )
        for row in rows
    ]


def _incident_view(s: Session, row: IncidentRow) -> IncidentView:
    s.flush()
    return _incident_views(s, [row])[0]


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
        outside_rank_map=list(row.outside_rank_map or []),
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
        owner=row.owner,
        lease_expires_at=row.lease_expires_at,
    )


def _action_event_view(row: ActionEventRow) -> ActionEventView:
    return ActionEventView(
        id=row.id,
        action_key=row.action_key,
        incident_id=row.incident_id,
        status=row.status,
        attempt=row.attempt,
        detail=row.detail,
        at=row.at,
    )


def _incident_event_view(row: IncidentEventRow) -> IncidentEventView:
    return IncidentEventView(
        from_state=row.from_state,
        to_state=row.to_state,
        reason=row.reason,
        detail=row.detail,
        at=row.at,
    )
