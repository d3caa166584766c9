"""The replay store: each signed request's nonce is claimed once, by whichever replica sees it.

Invariant: :meth:`NoncesMixin.claim_nonces` returns ``True`` for a nonce exactly once while it
is kept — across threads, processes and webhook replicas, since the claim is a row under a
primary key in the shared ledger (a rival inserting the same nonce loses the unique-key race,
re-runs, and then sees the winner's row). Nonces are kept for ``keep`` after they were seen,
which the webhook sets to twice its signing window: a replay later than that is refused by its
timestamp instead. Claims come in batches, so an alarm storm costs a few transactions, not
one per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from sqlalchemy import delete, insert, select
from sqlalchemy.orm import Session

from db.errors import InvalidValue
from db.ledger._base import LedgerBase
from db.ledger._queries import _chunks
from db.models import RequestNonceRow

__all__ = ["NoncesMixin"]


class NoncesMixin(LedgerBase):
    """:class:`db.ledger.Ledger`'s replay store."""

    def claim_nonces(self, claims: Sequence[tuple[str, str]], *, keep: timedelta) -> list[bool]:
        """Claim each ``(nonce, key_id)``; ``True`` where this call is its first use.

        A nonce twice in one batch is claimed by its first occurrence only. Expired nonces
        (seen more than ``keep`` ago) are deleted in the same transaction.
        """
        for nonce, key_id in claims:
            if not nonce or len(nonce) > 64 or not key_id or len(key_id) > 255:
                raise InvalidValue("a nonce is 1-64 characters and needs a key id")
        if not claims:
            return []

        def work(s: Session) -> list[bool]:
            now = self._clock()
            s.execute(delete(RequestNonceRow).where(RequestNonceRow.seen_at < now - keep))
            wanted = list(dict.fromkeys(nonce for nonce, _ in claims))
            seen: set[str] = set()
            for chunk in _chunks(wanted):
                seen.update(
                    s.scalars(select(RequestNonceRow.nonce).where(RequestNonceRow.nonce.in_(chunk)))
                )
            result: list[bool] = []
            rows: list[dict[str, object]] = []
            for nonce, key_id in claims:
                fresh = nonce not in seen
                result.append(fresh)
                if fresh:
                    seen.add(nonce)
                    rows.append({"nonce": nonce, "key_id": key_id, "seen_at": now})
            if rows:
                s.execute(insert(RequestNonceRow), rows)
            return result

        return self._write("claim_nonces", work)
