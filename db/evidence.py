"""The part of an incident's evidence the ledger itself acts on: the approval.

An incident's ``evidence`` is a JSON object the incident flow fills (telemetry, the verdict, the
storm check, …) and the ledger keeps without reading — except the approval: the request put to
an approver (its deadline closes an unanswered approval, :meth:`Ledger.expire_overdue_approval`)
and the decision recorded (withdrawn or cleared with the approval stage,
:meth:`Ledger.withdraw_decision`, :meth:`Ledger.retry_incident`). Those keys are named here once,
for the flow that writes them and the ledger that reads them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final

__all__ = [
    "APPROVAL",
    "APPROVAL_REQUEST",
    "APPROVAL_STAGE",
    "approval_deadline",
    "approved_nodes",
    "without_approval",
]

APPROVAL: Final = "approval"
"""The decision recorded: ``decision``, ``approver``, ``reason``, ``uncordon_on_reject``,
``nodes`` (those the approver chose to fix)."""
APPROVAL_REQUEST: Final = "approval_request"
"""The request put to the approver: at least its ``deadline`` (ISO 8601)."""
APPROVAL_STAGE: Final = "approval"
"""The flow's stage that asks: reopened when a decision is cleared, so the next run asks again."""


def approval_deadline(evidence: dict[str, Any] | None) -> datetime | None:
    """The deadline of the approval request, if one was put to an approver."""
    request = (evidence or {}).get(APPROVAL_REQUEST) or {}
    deadline = request.get("deadline")
    return datetime.fromisoformat(str(deadline)) if deadline else None


def approved_nodes(evidence: dict[str, Any] | None) -> list[str]:
    """The nodes of the recorded decision (none without one)."""
    return list(((evidence or {}).get(APPROVAL) or {}).get("nodes") or [])


def without_approval(evidence: dict[str, Any] | None) -> dict[str, Any]:
    """The evidence with the request and the decision taken out."""
    return {k: v for k, v in (evidence or {}).items() if k not in (APPROVAL, APPROVAL_REQUEST)}
