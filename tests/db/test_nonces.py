"""The replay store: each nonce claimed once, across ledgers on one database, until it expires."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from db import Ledger

KEEP = timedelta(minutes=11)


def test_a_nonce_is_claimed_once_across_ledgers(database_url: str) -> None:
    with Ledger.from_url(database_url) as one, Ledger.from_url(database_url) as other:
        assert one.claim_nonces([("a" * 32, "k1"), ("b" * 32, "k1")], keep=KEEP) == [True, True]
        assert other.claim_nonces([("a" * 32, "k2"), ("c" * 32, "k2")], keep=KEEP) == [False, True]
        assert one.claim_nonces([("d" * 32, "k1"), ("d" * 32, "k1")], keep=KEEP) == [True, False]
        assert one.claim_nonces([], keep=KEEP) == []


def test_an_expired_nonce_is_forgotten(database_url: str) -> None:
    now = [datetime(2026, 1, 1, 12, 0, tzinfo=UTC)]
    with Ledger.from_url(database_url, clock=lambda: now[0]) as ledger:
        assert ledger.claim_nonces([("e" * 32, "k")], keep=KEEP) == [True]
        now[0] += KEEP - timedelta(seconds=1)
        assert ledger.claim_nonces([("e" * 32, "k")], keep=KEEP) == [False]
        now[0] += timedelta(seconds=2)  # past the keep time: the timestamp check refuses it now
        assert ledger.claim_nonces([("e" * 32, "k")], keep=KEEP) == [True]
