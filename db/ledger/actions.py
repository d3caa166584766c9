"""Actions: each side effect of an incident (drain a node, restart a job) is performed once.

Invariants: an action's idempotency key is ``incident:kind:target``; of concurrent claimers
exactly one wins; a succeeded action is never won again, a failed one may be, one attempt more.
A claim names its *owner* (the flow run) and a lease: the owner may continue its own claim (a
task retry, a suspended run re-entered), and another run wins a claimed action only once the
lease has expired, or at once when the caller shows the owner is dead (its flow run crashed or
is gone) — a *takeover*, recorded in the trail with the previous owner and why. A run that
lost its claim can neither finish it nor pass :meth:`ActionsMixin.hold_claim`, which every
destructive call is preceded by. Every won claim and every outcome appends a row to the trail.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from db.enums import ActionStatus
from db.errors import ActionStateError, ClaimLost, InvalidValue, UnknownAction
from db.ledger._base import LedgerBase, _log
from db.ledger._queries import _action, _require_incident
from db.ledger._validate import _json_dict, _parse_enum, _require_text
from db.ledger._views import _action_event_view, _action_view, _action_views
from db.models import ActionEventRow, ActionRow
from db.views import ActionClaim, ActionEventView, ActionView, action_key


class ActionsMixin(LedgerBase):
    """:class:`db.ledger.Ledger`'s action methods."""

    def claim_action(
        self,
        incident_id: str,
        kind: str,
        target: str,
        detail: dict[str, Any] | None = None,
        *,
        owner: str | None = None,
        lease_s: float | None = None,
        dead_owner: str | None = None,
        dead_reason: str | None = None,
    ) -> ActionClaim:
        """Claim the right to perform one side effect of an incident, exactly once.

        The idempotency key is ``f"{incident_id}:{kind}:{target}"``. Of concurrent callers
        exactly one wins. An action that is claimed (in flight) or succeeded is never won
        again — the caller gets ``won=False`` and the action as it stands; a failed one may be
        claimed again, counting one more attempt. Every won claim appends an event row.

        ``owner`` (a flow run id) and ``lease_s`` make the claim a lease: a claimed action is
        won again by its own owner (one attempt more), or by another owner once the lease has
        expired (a takeover: the event's detail names ``taken_over_from``); an ownerless claim
        (before owners existed) is taken over by any owner. Without ``owner`` the old rule holds.

        ``dead_owner``: the caller found that this owner is dead (``dead_reason`` says how, e.g.
        "flow run Crashed"); a claim it holds is taken over without waiting for its lease, and
        the takeover event records the reason. A claim by anyone else is unaffected.
        """
        _require_text("incident_id", incident_id, max_len=36)
        _require_text("kind", kind, max_len=64)
        if ":" in kind:
            raise InvalidValue(f"action kind must not contain ':': {kind!r}")
        _require_text("target", target)
        claim_detail = None if detail is None else _json_dict("detail", detail)
        key = action_key(incident_id, kind, target)
        if lease_s is not None and lease_s <= 0:
            raise InvalidValue(f"lease_s must be positive, not {lease_s!r}")

        def work(s: Session) -> ActionClaim:
            _require_incident(s, incident_id)
            row = _action(s, key)
            now = self._clock()
            event_detail = claim_detail
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
            elif row.status == ActionStatus.FAILED or (
                row.status == ActionStatus.CLAIMED and _may_take(row, owner, now, dead_owner)
            ):
                if row.status == ActionStatus.CLAIMED and row.owner != owner:
                    event_detail = {
                        **(claim_detail or {}),
                        "taken_over_from": row.owner,
                        "lease_expired_at": (
                            None
                            if row.lease_expires_at is None
                            else row.lease_expires_at.isoformat()
                        ),
                    }
                    if dead_owner is not None and row.owner == dead_owner:
                        event_detail["owner_dead"] = dead_reason or "owner is dead"
                row.status = ActionStatus.CLAIMED
                row.attempts += 1
                row.started_at = now
                row.finished_at = None
                if claim_detail is not None:
                    row.detail = {**(row.detail or {}), **claim_detail}
            else:
                return ActionClaim(won=False, action=_action_view(row))
            if owner is not None:
                row.owner = owner
                row.lease_expires_at = None if lease_s is None else now + timedelta(seconds=lease_s)
            _append_event(s, row, ActionStatus.CLAIMED, event_detail, now)
            return ActionClaim(won=True, action=_action_view(row))

        claim = self._write("claim_action", work)
        _log.info(
            "action claim",
            extra={"incident": incident_id, "action": key, "won": claim.won, "owner": owner},
        )
        return claim

    def hold_claim(self, key: str, owner: str, lease_s: float | None = None) -> ActionView:
        """Check that ``owner`` still holds the claim on ``key``, and renew its lease.

        Called before every destructive call: raises :class:`ClaimLost` when the action is not
        claimed by ``owner`` any more (taken over after the lease expired, or finished).
        """
        _require_text("key", key, max_len=512)
        _require_text("owner", owner, max_len=255)

        def work(s: Session) -> ActionView:
            row = _action(s, key)
            if row is None:
                raise UnknownAction(key)
            if row.status != ActionStatus.CLAIMED or row.owner != owner:
                raise ClaimLost(key, owner, row.owner)
            if lease_s is not None:
                row.lease_expires_at = self._clock() + timedelta(seconds=lease_s)
            return _action_view(row)

        return self._write("hold_claim", work)

    def finish_action(
        self,
        key: str,
        status: ActionStatus,
        detail: dict[str, Any] | None = None,
        *,
        owner: str | None = None,
    ) -> ActionView:
        """Record the outcome of a claimed action (``succeeded`` or ``failed``).

        Repeating the same outcome is a no-op (a retried task); finishing an action that is
        not claimed any other way raises :class:`ActionStateError`. With ``owner``, a run that
        no longer holds the claim gets :class:`ClaimLost` and changes nothing.
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
            if owner is not None and row.owner is not None and row.owner != owner:
                raise ClaimLost(key, owner, row.owner)
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


def _may_take(row: ActionRow, owner: str | None, now: datetime, dead: str | None) -> bool:
    """Whether ``owner`` may win a claimed action: its own, ownerless, its holder shown dead,
    or its lease expired."""
    if owner is None:
        return False
    if row.owner is None or row.owner == owner:
        return True
    if dead is not None and row.owner == dead:
        return True
    return row.lease_expires_at is not None and row.lease_expires_at <= now


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
