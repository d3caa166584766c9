"""Incidents: their state machine, the fields recorded with each move, and how to list them.

Invariants: at most one non-terminal incident per job; every move is legal by
:func:`db.enums.can_transition` and appends a row to the incident's history; a terminal
incident's record is final — except that an operator may *retry* a ``failed`` or ``expired``
one (:meth:`IncidentsMixin.retry_incident`): it goes back to the live state it left, in the
history like any move, and a new flow run continues it from the ledger. A recorded decision
that nothing has acted on yet may be *withdrawn* (:meth:`IncidentsMixin.withdraw_decision`):
the incident stays ``awaiting_approval``, a human is asked again, and the history says who
withdrew what and why.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from db.enums import ActionStatus, IncidentState, Verdict, can_transition
from db.errors import IllegalTransition, IncidentConflict, InvalidValue
from db.evidence import (
    APPROVAL,
    APPROVAL_STAGE,
    approval_deadline,
    approved_nodes,
    without_approval,
)
from db.ledger._base import LedgerBase, _log
from db.ledger._queries import _active_incident, _append_event, _new_incident, _require_incident
from db.ledger._validate import (
    _json_dict,
    _jsonable_updates,
    _optional_text,
    _parse_enum,
    _require_range,
    _require_text,
)
from db.ledger._views import _incident_view, _incident_views
from db.models import ActionEventRow, ActionRow, IncidentEventRow, IncidentRow
from db.views import STAGE_KIND, IncidentView, action_key


class IncidentsMixin(LedgerBase):
    """:class:`db.ledger.Ledger`'s incident methods."""

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
            row = _new_incident(
                s,
                job_id,
                now=self._clock(),
                start=start,
                end=end,
                suspect_nodes=nodes,
                reason="opened by request",
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
            return _incident_view(s, _require_incident(s, incident_id))

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
            row = _require_incident(s, incident_id, lock=True)
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
            _append_event(s, row, current, target, reason, _jsonable_updates(updates) or None, now)
            s.flush()
            return _incident_view(s, row)

        view = self._write("transition", work)
        _log.info(
            "incident transition",
            extra={"incident": incident_id, "job": view.job_id, "state": view.state.value},
        )
        return view

    def retry_incident(self, incident_id: str, *, by: str, reason: str) -> IncidentView:
        """Move a ``failed`` or ``expired`` incident back to the live state it ended from.

        ``failed``: the failed stage and actions stay ``failed`` and are claimed again by the
        next run, which looks at the outside systems before acting. ``expired``: the decision
        is cleared and the approval stage reopened, so the next run asks again with a new
        deadline. Refused (:class:`IllegalTransition`) for any other state, and
        (:class:`IncidentConflict`) while the job has another live incident. The history row
        carries ``{"retry": n, "by": by}``; ``n`` counts this incident's retries from 1.
        """
        who = _require_text("by", by, max_len=255)
        why = _require_text("reason", reason, max_len=2000)

        def work(s: Session) -> IncidentView:
            # the job first, then the incident: the order open_incident takes them in
            self._require_job(s, _require_incident(s, incident_id).job_id, lock=True)
            row = _require_incident(s, incident_id, lock=True)
            current = row.state
            if current not in _RETRYABLE:
                raise IllegalTransition(
                    incident_id,
                    current,
                    current,
                    "only a failed or expired incident can be retried",
                )
            active = _active_incident(s, row.job_id)
            if active is not None and active.id != row.id:
                raise IncidentConflict(row.job_id, active.id)
            events = list(
                s.scalars(
                    select(IncidentEventRow)
                    .where(IncidentEventRow.incident_id == row.id)
                    .order_by(IncidentEventRow.id)
                )
            )
            back = next(
                (
                    e.from_state
                    for e in reversed(events)
                    if e.to_state == current
                    and e.from_state is not None
                    and not e.from_state.terminal
                ),
                IncidentState.OPEN,
            )
            retries = 1 + sum(1 for e in events if (e.detail or {}).get("retry"))
            now = self._clock()
            if current == IncidentState.EXPIRED:
                back = IncidentState.AWAITING_APPROVAL
                _clear_decision(s, row, now, outcome="reopened by a retry")
            row.state = back
            row.closed_at = None
            row.reason = f"retried by {who}: {why}"
            row.updated_at = now
            _append_event(s, row, current, back, row.reason, {"retry": retries, "by": who}, now)
            s.flush()
            return _incident_view(s, row)

        view = self._write("retry_incident", work)
        _log.info(
            "incident retried",
            extra={"incident": incident_id, "job": view.job_id, "state": view.state.value},
        )
        return view

    def withdraw_decision(self, incident_id: str, *, by: str, reason: str) -> IncidentView:
        """Withdraw the recorded decision of an incident still ``awaiting_approval``.

        For a decision nothing has acted on yet — e.g. the policy's automatic approval, when
        alarms that arrived since make it a storm. The decision, its approver and the request
        put to the approver are cleared and the approval stage reopened, so the next run asks a
        human afresh (new nodes, new deadline); the incident never leaves
        ``awaiting_approval``. The history row carries ``{"withdrawn": {decision, approver,
        nodes}, "by": by}``. Refused (:class:`IllegalTransition`) in any other state or with no
        decision recorded: a decision the fix already acted on cannot be taken back.
        """
        who = _require_text("by", by, max_len=255)
        why = _require_text("reason", reason, max_len=2000)

        def work(s: Session) -> IncidentView:
            row = _require_incident(s, incident_id, lock=True)
            current = row.state
            if current != IncidentState.AWAITING_APPROVAL or row.decision is None:
                raise IllegalTransition(
                    incident_id,
                    current,
                    current,
                    "only a decision recorded while awaiting approval can be withdrawn",
                )
            withdrawn = {
                "decision": row.decision,
                "approver": row.approver,
                "nodes": approved_nodes(row.evidence),
            }
            now = self._clock()
            _clear_decision(s, row, now, outcome=f"decision withdrawn: {why}")
            row.reason = f"decision withdrawn by {who}: {why}"
            row.updated_at = now
            _append_event(
                s, row, current, current, row.reason, {"withdrawn": withdrawn, "by": who}, now
            )
            s.flush()
            return _incident_view(s, row)

        view = self._write("withdraw_decision", work)
        _log.info(
            "decision withdrawn",
            extra={"incident": incident_id, "job": view.job_id, "by": who},
        )
        return view

    def expire_overdue_approval(
        self, incident_id: str, *, grace_s: float = 0.0, reason: str | None = None
    ) -> IncidentView | None:
        """Close ``expired`` an incident whose approval deadline passed with no decision.

        For a suspended approval: when its pause times out Prefect fails the suspended run
        without running any of its code, so nothing else would close the incident. Atomic
        with the decision: only an incident still ``awaiting_approval``, with no decision and
        a recorded request whose deadline is more than ``grace_s`` past, is closed (the
        decision ``expire`` recorded with it, as the flow records it); anything else is left
        alone and None returned.
        """
        if grace_s < 0:
            raise InvalidValue(f"grace_s must be >= 0, not {grace_s!r}")

        def work(s: Session) -> IncidentView | None:
            row = _require_incident(s, incident_id, lock=True)
            deadline = approval_deadline(row.evidence)
            if (
                row.state != IncidentState.AWAITING_APPROVAL
                or row.decision is not None
                or deadline is None
            ):
                return None
            now = self._clock()
            if now < deadline + timedelta(seconds=grace_s):
                return None
            why = reason or (
                f"no decision by the deadline {deadline.isoformat()}: nodes stay cordoned, "
                "nothing replaced, training stays stopped"
            )
            record: dict[str, Any] = {
                "decision": "expire",
                "approver": None,
                "reason": why,
                "uncordon_on_reject": False,
                "nodes": [],
            }
            row.decision = "expire"
            row.approval_reason = why
            row.decided_at = now
            row.evidence = {**(row.evidence or {}), APPROVAL: record}
            row.state = IncidentState.EXPIRED
            row.reason = why
            row.closed_at = row.updated_at = now
            _append_event(
                s,
                row,
                IncidentState.AWAITING_APPROVAL,
                IncidentState.EXPIRED,
                why,
                {"decision": "expire", "deadline": deadline.isoformat()},
                now,
            )
            s.flush()
            return _incident_view(s, row)

        view = self._write("expire_overdue_approval", work)
        if view is not None:
            _log.info(
                "overdue approval expired", extra={"incident": incident_id, "job": view.job_id}
            )
        return view


_RETRYABLE = frozenset({IncidentState.FAILED, IncidentState.EXPIRED})


def _clear_decision(s: Session, row: IncidentRow, now: Any, *, outcome: str) -> None:
    """Forget an incident's decision and the request put to its approver, and reopen the
    approval stage, so the next run asks a human afresh (new nodes, new deadline)."""
    row.decision = row.approver = row.approval_reason = None
    row.decided_at = None
    row.evidence = without_approval(row.evidence)
    _reopen_stage(s, row.id, APPROVAL_STAGE, now, outcome=outcome)


def _reopen_stage(
    s: Session, incident_id: str, stage: str, now: Any, *, outcome: str = "reopened by a retry"
) -> None:
    """Mark a succeeded stage ``failed`` ("reopened"), so the next run performs it again."""
    row = s.get(ActionRow, action_key(incident_id, STAGE_KIND, stage))
    if row is None or row.status != ActionStatus.SUCCEEDED:
        return
    row.status = ActionStatus.FAILED
    row.finished_at = now
    detail = {"outcome": outcome, "reopened": True}
    row.detail = {**(row.detail or {}), **detail}
    s.add(
        ActionEventRow(
            action_key=row.key,
            incident_id=incident_id,
            status=ActionStatus.FAILED,
            attempt=row.attempts,
            detail=detail,
            at=now,
        )
    )
    s.flush()


def retry_count(incident: IncidentView) -> int:
    """How many times the incident has been retried (0 for never)."""
    return sum(1 for e in incident.history if (e.detail or {}).get("retry"))
