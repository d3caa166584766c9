"""The nonce store: each signed request's nonce is claimed once, by whichever replica sees it.

Invariant: a nonce is claimed (``True``) exactly once while it is kept — across threads,
processes and webhook replicas, since the claim is a row under a primary key in the shared
ledger. The claim is, per chunk, a ``DELETE`` of the chunk's expired rows and one
``INSERT … ON CONFLICT DO NOTHING RETURNING``: a new nonce is inserted, an expired one is taken
over, a kept one is left alone and not returned. A rival inserting the same nonce at the same
moment holds its row until it commits or rolls back; the statement waits for it and then
answers from the winner's row, so no race needs a re-run. Nonces are kept for ``keep`` after
they were seen, which the webhook sets to more than twice its signing window: a replay later
than that is refused by its timestamp.

:func:`claim_in` runs inside the caller's transaction, so a request's nonce can be claimed in
the very transaction that records what the request asked for — then the nonce is consumed
exactly when the request's effect commits (the alarm batch does this,
:meth:`db.ledger.alarms.AlarmsMixin.record_fresh_alarms`). Claims take the nonces' rows in
sorted order, before any job row is locked, so two claiming transactions never deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import cast

from sqlalchemy import Table, bindparam, delete
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from db.errors import InvalidValue
from db.ledger._base import LedgerBase
from db.models import RequestNonceRow

__all__ = [
    "NonceClaim",
    "NonceReused",
    "NoncesMixin",
    "claim_in",
    "prune_nonces",
    "validate_claims",
]

NonceClaim = tuple[str, str]
"""``(nonce, key_id)`` of one request: the key id is kept beside the nonce for the record."""

# Rows per INSERT … VALUES statement: 3 bind parameters each, far below every backend's limit.
_ROWS_PER_STATEMENT = 500
_NONCES = cast(Table, RequestNonceRow.__table__)


@dataclass(frozen=True)
class NonceReused:
    """The outcome of a request whose nonce was claimed before: refuse it, nothing was written."""

    nonce: str
    key_id: str


def validate_claims(claims: Sequence[NonceClaim]) -> None:
    """:class:`InvalidValue` for a nonce the store cannot keep (empty, too long, no key id)."""
    for nonce, key_id in claims:
        if not nonce or len(nonce) > 64 or not key_id or len(key_id) > 255:
            raise InvalidValue("a nonce is 1-64 characters and needs a key id")


def prune_nonces(s: Session, cutoff: datetime) -> None:
    """Delete the nonces seen before ``cutoff``: only to keep the table small, since a claim
    takes over an expired nonce anyway (so pruning late or never changes no answer)."""
    s.execute(delete(RequestNonceRow).where(RequestNonceRow.seen_at < cutoff))


def claim_in(
    s: Session, claims: Sequence[NonceClaim], now: datetime, keep: timedelta
) -> list[bool]:
    """Claim each ``(nonce, key_id)`` inside ``s``'s transaction; ``True`` at its first use.

    A nonce twice in ``claims`` is claimed by its first occurrence only. The claim commits or
    rolls back with the caller's transaction.
    """
    first: dict[str, str] = {}
    for nonce, key_id in claims:
        first.setdefault(nonce, key_id)
    wanted = sorted(first)  # one lock order for every claimer
    cutoff = now - keep
    dialect = s.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    # Taking over an expired nonce is a DELETE then an INSERT, never ``ON CONFLICT DO
    # UPDATE``: the runtime role holds INSERT and DELETE on the nonce store, not UPDATE
    # (db/roles.py). A rival deleting the same expired row waits for ours, then finds it gone
    # and loses at the INSERT, which sees our committed row. One statement text for every
    # batch (the rows an executemany that SQLAlchemy sends as multi-row VALUES): compiled
    # once, not once per batch size.
    take_over = delete(RequestNonceRow).where(
        RequestNonceRow.nonce.in_(bindparam("chunk", expanding=True)),
        RequestNonceRow.seen_at < bindparam("cutoff", type_=RequestNonceRow.seen_at.type),
    )
    stmt = (  # of the table (Core): the rows are never loaded as objects
        insert(_NONCES)
        .on_conflict_do_nothing(index_elements=[RequestNonceRow.nonce])
        .returning(_NONCES.c.nonce)
    )
    won: set[str] = set()
    for start in range(0, len(wanted), _ROWS_PER_STATEMENT):
        chunk = wanted[start : start + _ROWS_PER_STATEMENT]
        s.execute(take_over, {"chunk": chunk, "cutoff": cutoff})
        rows = [{"nonce": n, "key_id": first[n], "seen_at": now} for n in chunk]
        won.update(s.scalars(stmt, rows))
    result: list[bool] = []
    for nonce, _ in claims:
        result.append(nonce in won)
        won.discard(nonce)  # a second occurrence in this batch is a replay of the first
    return result


class NoncesMixin(LedgerBase):
    """:class:`db.ledger.Ledger`'s nonce store."""

    def claim_nonces(self, claims: Sequence[NonceClaim], *, keep: timedelta) -> list[bool]:
        """Claim each ``(nonce, key_id)`` in a transaction of its own; ``True`` where this call
        is its first use. Expired nonces (seen more than ``keep`` ago) are deleted with it."""
        validate_claims(claims)
        if not claims:
            return []

        def work(s: Session) -> list[bool]:
            now = self._clock()
            prune_nonces(s, now - keep)
            return claim_in(s, claims, now, keep)

        return self._write("claim_nonces", work)
