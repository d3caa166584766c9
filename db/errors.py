"""Typed errors of the ledger.

The split callers act on: :class:`LedgerTemporaryError` (the database is unreachable, locked or
lost a race too often — retry later) versus every other :class:`LedgerError` (the request
itself is wrong — retrying the same call cannot help). Whenever a ledger method raises, its
transaction was rolled back: nothing is half-written.
"""

from __future__ import annotations

__all__ = [
    "ActionStateError",
    "CheckpointNotFound",
    "ClaimLost",
    "IllegalTransition",
    "IncidentConflict",
    "InvalidRange",
    "InvalidValue",
    "LedgerContention",
    "LedgerError",
    "LedgerTemporaryError",
    "LedgerUnavailable",
    "SchemaNotReady",
    "UnknownAction",
    "UnknownIncident",
    "UnknownJob",
]


class LedgerError(Exception):
    """A ledger call failed and changed nothing."""


class LedgerTemporaryError(LedgerError):
    """Worth retrying later: the same call may succeed once the database is reachable again."""


class LedgerUnavailable(LedgerTemporaryError):
    """The database could not be reached, or stayed locked past the busy timeout."""


class LedgerContention(LedgerTemporaryError):
    """Concurrent writers kept winning the same race; the call gave up after its retries."""

    def __init__(self, operation: str, attempts: int) -> None:
        super().__init__(f"{operation}: lost a write race {attempts} times in a row")
        self.operation = operation
        self.attempts = attempts


class SchemaNotReady(LedgerError):
    """The ledger tables are missing: migrations create them, never the ledger itself."""


class InvalidValue(LedgerError):
    """An argument is outside what the ledger accepts (empty id, negative step, unknown kind)."""


class UnknownJob(LedgerError):
    """Checkpoints, audits and explicit incidents need a job the ledger already knows."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"unknown job {job_id!r}: register its ranks or send an alarm first")
        self.job_id = job_id


class UnknownIncident(LedgerError):
    def __init__(self, incident_id: str) -> None:
        super().__init__(f"unknown incident {incident_id!r}")
        self.incident_id = incident_id


class UnknownAction(LedgerError):
    def __init__(self, key: str) -> None:
        super().__init__(f"unknown action {key!r}: claim it before finishing it")
        self.key = key


class CheckpointNotFound(LedgerError):
    def __init__(self, job_id: str, step: int) -> None:
        super().__init__(f"job {job_id!r} has no checkpoint at step {step}")
        self.job_id = job_id
        self.step = step


class InvalidRange(LedgerError):
    """A step range whose start lies after its end, or below step 0."""

    def __init__(self, start: int, end: int | None) -> None:
        shown = "∞" if end is None else str(end)
        super().__init__(f"invalid step range [{start}, {shown}]: need 0 <= start <= end")
        self.start = start
        self.end = end


class IncidentConflict(LedgerError):
    """A job has at most one non-terminal incident at a time."""

    def __init__(self, job_id: str, incident_id: str) -> None:
        super().__init__(f"job {job_id!r} already has incident {incident_id} open")
        self.job_id = job_id
        self.incident_id = incident_id


class AlarmConflict(LedgerError):
    """An ``alarm_id`` stored before arrives again with different content.

    A re-send is the same alarm and a duplicate; the same id with another step, rank or detail
    is either a sender bug or a forgery, and silently keeping the first would hide both.
    """

    def __init__(self, alarm_id: str, fields: list[str]) -> None:
        super().__init__(f"alarm {alarm_id} was recorded before with different {', '.join(fields)}")
        self.alarm_id = alarm_id
        self.fields = fields


class StaleRegistration(LedgerError):
    """A rank registration older than the one the ledger holds: it must not overwrite it."""

    def __init__(self, job_id: str, generation: int, current: int) -> None:
        super().__init__(
            f"ranks of job {job_id!r} are at generation {current}; generation {generation} "
            "is older and was not applied"
        )
        self.job_id = job_id
        self.generation = generation
        self.current = current


class IllegalTransition(LedgerError):
    """A state change the incident state machine forbids, or a rewrite of a closed record."""

    def __init__(self, incident_id: str, current: str, to: str, why: str | None = None) -> None:
        message = f"incident {incident_id}: {current} → {to} is not allowed"
        super().__init__(f"{message}: {why}" if why else message)
        self.incident_id = incident_id
        self.current = current
        self.to = to


class ClaimLost(LedgerError):
    """The caller's claim on an action is no longer its own: another run took it over.

    Raised before a destructive call (:meth:`db.Ledger.hold_claim`) and on a finish by a run
    that lost the claim; the loser must stop acting and must not mark the incident.
    """

    def __init__(self, key: str, owner: str, holder: str | None) -> None:
        super().__init__(f"action {key!r} is held by {holder or 'nobody'}, not {owner}")
        self.key = key
        self.owner = owner
        self.holder = holder


class ActionStateError(LedgerError):
    """Finishing an action that is not claimed, or finishing it a second way."""

    def __init__(self, key: str, current: str, requested: str) -> None:
        super().__init__(f"action {key!r} is {current}; cannot mark it {requested}")
        self.key = key
        self.current = current
        self.requested = requested
