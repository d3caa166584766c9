"""Actions: each side effect of an incident (drain a node, restart a job) is performed once.

Invariants: an action's idempotency key is ``incident:kind:target``; of concurrent claimers
exactly one wins; a claimed or succeeded action is never won again, a failed one may be, one
attempt more. Every won claim and every outcome appends a row to the action trail.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from db.enums import ActionStatus
from db.errors import ActionStateError, InvalidValue, UnknownAction
from db.ledger._base import LedgerBase, _log
from db.ledger._queries import _action, _require_incident
from db.ledger._validate import _json_dict, _parse_enum, _require_text
from db.ledger._views import _action_event_view, _action_view, _action_views
from db.models import ActionEventRow, ActionRow
from db.views import ActionClaim, ActionEventView, ActionView


class ActionsMixin(LedgerBase):
    """:class:`db.ledger.Ledger`'s action methods."""

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
            _require_incident(s, incident_id)
            row = _action(s, key)
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
            _append_event(s, row, ActionStatus.CLAIMED, claim_detail, now)
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
            row = _action(s, key)
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
            _append_event(s, row, outcome, finish_detail, now)
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
            _require_incident(s, incident_id)
            return _action_views(s, [incident_id]).get(incident_id, [])

        return self._read("actions", work)

    def action_events(self, incident_id: str) -> list[ActionEventView]:
        """The incident's append-only action trail, oldest first."""

        def work(s: Session) -> list[ActionEventView]:
            _require_incident(s, incident_id)
            rows = s.scalars(
                select(ActionEventRow)
                .where(ActionEventRow.incident_id == incident_id)
                .order_by(ActionEventRow.id)
            )
            return [_action_event_view(row) for row in rows]

        return self._read("action_events", work)


def _append_event(
    s: Session, row: ActionRow, status: ActionStatus, detail: dict[str, Any] | None, at: datetime
) -> None:
    """Append one row to the action trail: the action's attempt moved to ``status``."""
    s.add(
        ActionEventRow(
            action_key=row.key,
            incident_id=row.incident_id,
            status=status,
            attempt=row.attempts,
            detail=detail,
            at=at,
        )
    )
    s.flush()
