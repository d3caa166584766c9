"""The nonce store: each nonce claimed once, across ledgers on one database, until it expires;
and alarms recorded with their request's nonce claimed in the same transaction."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from db import AlarmConflict, AlarmIn, AlarmOutcome, Ledger, NonceReused

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


def _alarm(rank: int, alarm_id: str | None = None, step: int = 7) -> AlarmIn:
    return AlarmIn(
        alarm_id=alarm_id or str(uuid.uuid4()),
        job_id="job-n",
        step=step,
        rank=rank,
        node=f"node-{rank}",
        layer="audit",
        phase="gradient",
        suspect_ranks=[rank],
        suspect_nodes=[f"node-{rank}"],
        detail={},
        sent_at=None,
    )


def test_an_alarm_is_recorded_only_with_a_fresh_nonce_claimed_in_its_transaction(
    database_url: str,
) -> None:
    """A nonce used before, or twice in one batch, is ``NonceReused`` and its alarm not written;
    the nonce of a recorded alarm is claimed for every other caller too."""
    with Ledger.from_url(database_url) as ledger, Ledger.from_url(database_url) as other:
        assert ledger.claim_nonces([("used" * 8, "k")], keep=KEEP) == [True]
        alarms = [_alarm(0), _alarm(1), _alarm(2), _alarm(3)]
        nonces = [("used" * 8, "k"), ("n1" * 16, "k"), ("n1" * 16, "k"), None]
        results = ledger.record_fresh_alarms(alarms, nonces, keep=KEEP)
        assert results[0] == NonceReused("used" * 8, "k")
        assert results[2] == NonceReused("n1" * 16, "k")
        assert isinstance(results[1], AlarmOutcome)
        assert results[1].opened
        assert isinstance(results[3], AlarmOutcome)
        assert not results[3].opened
        [incident] = ledger.list_incidents("job-n")
        assert sorted(a.rank for a in incident.alarms) == [1, 3]
        assert other.claim_nonces([("n1" * 16, "k2")], keep=KEEP) == [False]
        assert other.record_fresh_alarms([_alarm(5)], [("n1" * 16, "k")], keep=KEEP) == [
            NonceReused("n1" * 16, "k")
        ]


def test_a_refused_batch_consumes_no_nonce(database_url: str) -> None:
    """The same alarm id with other content refuses the whole batch: nothing is written, and
    every nonce of it is still free (re-sent, the good alarms are recorded)."""
    with Ledger.from_url(database_url) as ledger:
        stored = _alarm(0)
        ledger.record_alarm(stored)
        conflicting = _alarm(0, alarm_id=stored.alarm_id, step=8)
        good = _alarm(1)
        nonces = [("c1" * 16, "k"), ("c2" * 16, "k")]
        with pytest.raises(AlarmConflict):
            ledger.record_fresh_alarms([good, conflicting], nonces, keep=KEEP)
        [incident] = ledger.list_incidents("job-n")
        assert [a.rank for a in incident.alarms] == [0]
        [outcome] = ledger.record_fresh_alarms([good], nonces[:1], keep=KEEP)
        assert isinstance(outcome, AlarmOutcome)
        assert not outcome.duplicate
        assert ledger.claim_nonces(nonces, keep=KEEP) == [False, True]


def test_an_expired_nonce_is_taken_over_without_pruning(database_url: str) -> None:
    now = [datetime(2026, 1, 1, 12, 0, tzinfo=UTC)]
    with Ledger.from_url(database_url, clock=lambda: now[0]) as ledger:
        assert ledger.claim_nonces([("x" * 32, "k")], keep=KEEP) == [True]
        now[0] += KEEP + timedelta(seconds=1)
        [outcome] = ledger.record_fresh_alarms([_alarm(0)], [("x" * 32, "k")], keep=KEEP)
        assert isinstance(outcome, AlarmOutcome)
        [again] = ledger.record_fresh_alarms([_alarm(1)], [("x" * 32, "k")], keep=KEEP)
        assert again == NonceReused("x" * 32, "k")
