"""Claims with an owner and a lease: only the owner continues its claim, another run takes it
over only after the lease expired (an event in the trail), and a run that lost its claim can
neither pass ``hold_claim`` nor finish the action. On SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from db import ActionStatus, ClaimLost, Ledger, upgrade
from db.migrate import downgrade
from tests.db.support import make_alarm


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def timed(database_url: str, clock: Clock) -> Iterator[Ledger]:
    with Ledger.from_url(database_url, clock=clock) as ledger:
        yield ledger


@pytest.fixture
def incident_id(timed: Ledger) -> str:
    return timed.record_alarm(make_alarm()).incident_id


def test_a_live_claim_is_not_taken_and_its_owner_continues_it(
    timed: Ledger, incident_id: str, clock: Clock
) -> None:
    a = timed.claim_action(incident_id, "replace", "node-2", owner="run-a", lease_s=60)
    assert a.won
    assert a.action.owner == "run-a"
    assert a.action.lease_expires_at == clock.now + timedelta(seconds=60)
    clock.advance(59)
    b = timed.claim_action(incident_id, "replace", "node-2", owner="run-b", lease_s=60)
    assert not b.won
    assert b.action.owner == "run-a"
    again = timed.claim_action(incident_id, "replace", "node-2", owner="run-a", lease_s=60)
    assert again.won  # a task retry or a re-entered run of the same flow run
    assert again.action.attempts == 2


def test_an_expired_claim_is_taken_over_and_the_trail_says_so(
    timed: Ledger, incident_id: str, clock: Clock
) -> None:
    key = timed.claim_action(incident_id, "replace", "node-2", owner="run-a", lease_s=60)
    clock.advance(61)
    b = timed.claim_action(incident_id, "replace", "node-2", owner="run-b", lease_s=60)
    assert b.won
    assert (b.action.owner, b.action.attempts) == ("run-b", 2)
    takeover = timed.action_events(incident_id)[-1]
    assert takeover.status is ActionStatus.CLAIMED
    assert takeover.detail is not None
    assert takeover.detail["taken_over_from"] == "run-a"
    assert takeover.detail["lease_expired_at"] is not None

    # the loser: no destructive call past hold_claim, and its outcome is refused
    with pytest.raises(ClaimLost):
        timed.hold_claim(key.action.key, "run-a", 60)
    with pytest.raises(ClaimLost):
        timed.finish_action(key.action.key, ActionStatus.FAILED, {"error": "x"}, owner="run-a")
    assert timed.hold_claim(key.action.key, "run-b", 60).owner == "run-b"
    done = timed.finish_action(key.action.key, ActionStatus.SUCCEEDED, owner="run-b")
    assert done.status is ActionStatus.SUCCEEDED
    # a late loser's finish on the succeeded row is refused as lost, the row stays succeeded
    with pytest.raises(ClaimLost):
        timed.finish_action(key.action.key, ActionStatus.FAILED, owner="run-a")
    assert timed.actions(incident_id)[0].status is ActionStatus.SUCCEEDED


def test_hold_claim_renews_the_lease(timed: Ledger, incident_id: str, clock: Clock) -> None:
    key = timed.claim_action(incident_id, "stage", "replace", owner="run-a", lease_s=60)
    clock.advance(50)
    timed.hold_claim(key.action.key, "run-a", 60)
    clock.advance(50)  # 100 s after the claim, 50 s after the renewal
    assert not timed.claim_action(incident_id, "stage", "replace", owner="run-b", lease_s=60).won


def test_an_ownerless_claim_from_before_owners_is_continued(
    timed: Ledger, incident_id: str
) -> None:
    timed.claim_action(incident_id, "cordon", "node-2")
    taken = timed.claim_action(incident_id, "cordon", "node-2", owner="run-a", lease_s=60)
    assert taken.won
    assert taken.action.owner == "run-a"


def test_migration_0002_adds_and_removes_the_claim_columns(empty_database_url: str) -> None:
    upgrade(empty_database_url, "0001")
    engine = sa.create_engine(empty_database_url)
    try:
        before = {c["name"] for c in sa.inspect(engine).get_columns("actions")}
        upgrade(empty_database_url)
        engine.dispose()
        after = {c["name"] for c in sa.inspect(engine).get_columns("actions")}
        downgrade(empty_database_url, "0001")
        engine.dispose()
        back = {c["name"] for c in sa.inspect(engine).get_columns("actions")}
    finally:
        engine.dispose()
    assert after - before == {"owner", "lease_expires_at"}
    assert back == before
