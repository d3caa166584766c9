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

The package holds one module per job, each a mixin of :class:`Ledger` over the transaction
helpers in ``_base``: ``jobs`` (jobs, rank registration), ``alarms`` (recording, batching,
validation), ``checkpoints`` (checkpoints, audits, quarantine, resume candidates),
``incidents`` (incidents, transitions, listing), ``actions`` (claims and outcomes),
``nonces`` (the nonce store of signed requests) and ``pages`` (incidents a page at a time).
"""

from __future__ import annotations

from types import TracebackType

from db.engine import create_engine_for
from db.ledger._base import Clock
from db.ledger.actions import ActionsMixin
from db.ledger.alarms import AlarmsMixin
from db.ledger.checkpoints import CheckpointsMixin
from db.ledger.incidents import IncidentsMixin
from db.ledger.jobs import JobsMixin
from db.ledger.nonces import NonceClaim, NonceReused, NoncesMixin
from db.ledger.pages import IncidentPage, PagesMixin
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
    "IncidentPage",
    "IncidentView",
    "Ledger",
    "NonceClaim",
    "NonceReused",
    "RankIn",
    "RankView",
]


class Ledger(
    JobsMixin,
    AlarmsMixin,
    CheckpointsMixin,
    IncidentsMixin,
    ActionsMixin,
    NoncesMixin,
    PagesMixin,
):
    """Ledger queries on one engine; safe to share between threads.

    Build the engine with :func:`db.engine.create_engine_for` (or use :meth:`from_url`): the
    SQLite settings the ledger relies on (WAL, busy timeout, ``BEGIN IMMEDIATE``) live there.
    ``clock`` returns the current time as an aware datetime; tests may pin it.
    """

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
