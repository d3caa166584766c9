"""The ledger's closed vocabularies, and the incident state machine.

Every value here crosses the wire (webhook JSON, CLI tables, report JSON), so each is a
``StrEnum`` whose value is the exact string stored in the database and shown to people.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "RING_AUDIT_KINDS",
    "TERMINAL_STATES",
    "ActionStatus",
    "AuditKind",
    "CheckpointEvidence",
    "CheckpointStatus",
    "IncidentState",
    "Verdict",
    "can_transition",
]


class IncidentState(StrEnum):
    """Where an incident stands.

    The happy path runs ``open → stopping → cordoned → diagnosing → awaiting_approval →
    replacing → resuming → resolved``; ``rejected`` (approver said no), ``expired`` (no answer in
    time: stays cordoned, nothing replaced) and ``failed`` (an action failed after its retries)
    end it elsewhere.
    """

    OPEN = "open"
    STOPPING = "stopping"
    CORDONED = "cordoned"
    DIAGNOSING = "diagnosing"
    AWAITING_APPROVAL = "awaiting_approval"
    REPLACING = "replacing"
    RESUMING = "resuming"
    RESOLVED = "resolved"
    REJECTED = "rejected"
    EXPIRED = "expired"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        """A terminal incident is history: it never changes state again."""
        return self in TERMINAL_STATES


TERMINAL_STATES: frozenset[IncidentState] = frozenset(
    {IncidentState.RESOLVED, IncidentState.REJECTED, IncidentState.EXPIRED, IncidentState.FAILED}
)

# The forward chain; a move may skip states forward but never go back.
_CHAIN: tuple[IncidentState, ...] = (
    IncidentState.OPEN,
    IncidentState.STOPPING,
    IncidentState.CORDONED,
    IncidentState.DIAGNOSING,
    IncidentState.AWAITING_APPROVAL,
    IncidentState.REPLACING,
    IncidentState.RESUMING,
    IncidentState.RESOLVED,
)


def can_transition(current: IncidentState, to: IncidentState) -> bool:
    """Whether ``current → to`` is a legal move.

    Legal: staying put (an idempotent no-op, also for terminal states, so a retried step is
    harmless); forward along the chain, skips allowed; any non-terminal state to ``failed``;
    ``awaiting_approval`` to ``rejected`` or ``expired``. Nothing leaves a terminal state.
    """
    if current == to:
        return True
    if current.terminal:
        return False
    if to == IncidentState.FAILED:
        return True
    if to in (IncidentState.REJECTED, IncidentState.EXPIRED):
        return current == IncidentState.AWAITING_APPROVAL
    return _CHAIN.index(to) > _CHAIN.index(current)


class CheckpointStatus(StrEnum):
    """Provenance of a checkpoint; only ``verified`` ones are ever resumed from."""

    PENDING = "pending"
    VERIFIED = "verified"
    QUARANTINED = "quarantined"
    CORRUPT = "corrupt"


class CheckpointEvidence(StrEnum):
    """What verified a checkpoint.

    ``ring-audit`` (a passed loss/gradient re-execution) is the strong evidence;
    ``fingerprint-vote`` (replicas agreed on their weights) is weaker: it cannot see a
    corruption that was averaged into every replica before the all-reduce.
    """

    RING_AUDIT = "ring-audit"
    FINGERPRINT_VOTE = "fingerprint-vote"


class ActionStatus(StrEnum):
    """Life of one idempotent recovery action."""

    CLAIMED = "claimed"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class Verdict(StrEnum):
    """Diagnosis of an incident: is the hardware at fault?"""

    HARDWARE = "hardware"
    SOFTWARE = "software"
    INCONCLUSIVE = "inconclusive"


class AuditKind(StrEnum):
    """What an audit compared: a ring re-execution (loss, gradient) or a fingerprint vote."""

    LOSS = "loss"
    GRADIENT = "gradient"
    FINGERPRINT = "fingerprint"


RING_AUDIT_KINDS: frozenset[AuditKind] = frozenset({AuditKind.LOSS, AuditKind.GRADIENT})
