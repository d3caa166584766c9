"""An approval nobody answered closes itself on time, with no flow run left to do it.

Prefect fails a suspended run whose pause timed out without running the flow's code; the
webhook service's sweep (:mod:`flows.incident.expiry`) closes the incident ``expired`` instead. The
ledger's clock is moved by hand; the sweep's own thread is shown once, awaited, not slept on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from db import IncidentState, Ledger, RankIn
from flows.incident.expiry import ExpirySweeper, close_overdue_approvals
from flows.settings import ExpirySettings

pytestmark = pytest.mark.usefixtures("prefect_api")

JOB = "job-1"
DEADLINE = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = DEADLINE - timedelta(minutes=30)

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def timed(sqlite_database_url: str, clock: Clock) -> Iterator[Ledger]:
    with Ledger.from_url(sqlite_database_url, clock=clock) as ledger:
        ledger.register_ranks(JOB, [RankIn(0, 0, "node-1")])
        yield ledger


def _awaiting(ledger: Ledger) -> str:
    """An incident whose suspended run asked for a decision by ``DEADLINE``."""
    incident = ledger.open_incident(JOB, start=10, end=20, suspect_nodes=["node-1"])
    ledger.transition(incident.id, IncidentState.AWAITING_APPROVAL, reason="waiting")
    request = {"nodes": ["node-1"], "deadline": DEADLINE.isoformat()}
    ledger.transition(
        incident.id, IncidentState.AWAITING_APPROVAL, evidence={"approval_request": request}
    )
    return incident.id


def test_an_overdue_approval_is_closed_expired_and_a_decided_one_is_not(
    timed: Ledger, clock: Clock
) -> None:
    overdue = _awaiting(timed)
    assert close_overdue_approvals(timed, grace_s=60) == []  # before the deadline: nothing
    clock.now = DEADLINE + timedelta(seconds=30)
    assert close_overdue_approvals(timed, grace_s=60) == []  # the run's own grace
    clock.now = DEADLINE + timedelta(seconds=61)

    (closed,) = close_overdue_approvals(timed, grace_s=60)

    assert closed.id == overdue
    incident = timed.get_incident(overdue)
    assert incident.state is IncidentState.EXPIRED
    assert incident.decision == "expire"
    assert incident.closed_at == clock.now
    assert "no decision by the deadline" in (incident.reason or "")
    assert (incident.evidence or {})["approval"]["decision"] == "expire"
    last = incident.history[-1]
    assert (last.from_state, last.to_state) == (
        IncidentState.AWAITING_APPROVAL,
        IncidentState.EXPIRED,
    )
    assert close_overdue_approvals(timed, grace_s=60) == []  # closed once
    # retried, it waits for a new decision: overdue by the old deadline no more
    timed.retry_incident(overdue, by="oncall", reason="back")
    assert close_overdue_approvals(timed, grace_s=60) == []


def test_a_decision_recorded_in_time_is_never_expired(timed: Ledger, clock: Clock) -> None:
    decided = _awaiting(timed)
    timed.transition(decided, IncidentState.AWAITING_APPROVAL, decision="approve", approver="alice")
    clock.now = DEADLINE + timedelta(hours=1)  # the fix is waiting for the fleet's slot
    assert close_overdue_approvals(timed, grace_s=0) == []
    assert timed.get_incident(decided).state is IncidentState.AWAITING_APPROVAL


def test_the_sweeper_closes_it_without_a_flow_run(timed: Ledger, clock: Clock) -> None:
    overdue = _awaiting(timed)
    clock.now = DEADLINE + timedelta(minutes=5)
    bound = time.monotonic() + 30
    pace = threading.Event()  # never set: a bounded wait between looks, not a sleep to pass
    with ExpirySweeper(timed, ExpirySettings(interval_s=0.01, grace_s=60)):
        while timed.get_incident(overdue).state is not IncidentState.EXPIRED:
            assert time.monotonic() < bound, "the sweeper closed nothing"
            pace.wait(0.01)
    assert timed.get_incident(overdue).decision == "expire"
