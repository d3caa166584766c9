"""A run that lost its claim to a takeover makes no destructive call and records nothing;
a claim whose flow run is dead (crashed, or unknown to Prefect) is taken over at once.

Run A holds the ``replace`` stage; its lease runs out while it is stuck (the clock is moved by
hand); run B takes the stage over (a trail event names A); when A gets to its side effect, the
check before the call finds the stage is not A's any more: the call is never made.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.states import Crashed, Running, State

from db import ActionStatus, ClaimLost, Ledger
from flows.incident.coordination import claim_owner
from flows.incident.stages import Action, Stage, perform, record_stage
from flows.incident.wiring import use_backends
from tests.db.support import make_alarm
from tests.flows.conftest import ledger_only

LEASE_S = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def timed(
    sqlite_database_url: str, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Ledger]:
    monkeypatch.setenv("SDCGUARD_FLOW_CLAIM_LEASE_S", str(LEASE_S))
    with (
        Ledger.from_url(sqlite_database_url, clock=clock) as ledger,
        use_backends(
            ledger_only(ledger)  # no stage body here reaches another backend
        ),
    ):
        yield ledger


def test_a_run_whose_stage_was_taken_over_makes_no_destructive_call(
    timed: Ledger, clock: Clock
) -> None:
    incident_id = timed.record_alarm(make_alarm()).incident_id
    calls: list[bool] = []

    def stuck_then_acting() -> dict[str, Any]:
        clock.now += timedelta(seconds=LEASE_S + 1)  # A hung past its lease
        taken = timed.claim_action(
            incident_id, "stage", Stage.REPLACE.value, owner="flow-run-b", lease_s=LEASE_S
        )
        assert taken.won  # B took the stage over
        return perform(
            incident_id, Action.REPLACE, "node-2", lambda first: calls.append(first) or {}
        )

    with pytest.raises(ClaimLost):
        record_stage(Stage.REPLACE, incident_id, stuck_then_acting)

    assert calls == []  # the replace was never called
    stage = next(a for a in timed.actions(incident_id) if a.target == Stage.REPLACE.value)
    assert (stage.status, stage.owner) == (ActionStatus.CLAIMED, "flow-run-b")
    takeover = [
        e for e in timed.action_events(incident_id) if (e.detail or {}).get("taken_over_from")
    ]
    assert [e.detail["taken_over_from"] for e in takeover if e.detail] == [claim_owner()]
    # A's side-effect claim was made before the check and is left for B to continue
    replace = next(a for a in timed.actions(incident_id) if a.kind == Action.REPLACE.value)
    assert replace.owner == claim_owner()


def test_the_same_run_continues_its_own_claim(timed: Ledger) -> None:
    """A task retry (same flow run) is not a takeover: it goes on, one attempt more."""
    incident_id = timed.record_alarm(make_alarm()).incident_id
    first = timed.claim_action(
        incident_id, "stage", Stage.REPLACE.value, owner=claim_owner(), lease_s=LEASE_S
    )
    assert first.won
    outcome = record_stage(Stage.REPLACE, incident_id, lambda: {"outcome": "done"})
    assert outcome["outcome"] == "done"
    stage = next(a for a in timed.actions(incident_id) if a.target == Stage.REPLACE.value)
    assert (stage.status, stage.attempts) == (ActionStatus.SUCCEEDED, 2)


@flow(name="claim-owner-stand-in")
def _stand_in() -> None:
    """Only its flow runs are used: owners of claims, in a state the test sets."""


def _flow_run_owner(state: State[Any]) -> str:
    with get_client(sync_client=True) as client:
        run = client.create_flow_run(_stand_in, state=state)
    return f"flow-run-{run.id}"


@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize(
    ("holder", "why"),
    [
        (lambda: _flow_run_owner(Crashed(message="SIGKILL")), "flow run CRASHED"),
        (lambda: f"flow-run-{uuid.uuid4()}", "flow run not found"),
    ],
    ids=["crashed", "gone"],
)
def test_a_claim_of_a_dead_flow_run_is_taken_over_at_once(
    timed: Ledger, holder: Callable[[], str], why: str
) -> None:
    """No lease is waited out (the clock stands still): Prefect says the holder is dead."""
    incident_id = timed.record_alarm(make_alarm()).incident_id
    dead = holder()
    timed.claim_action(incident_id, "stage", Stage.REPLACE.value, owner=dead, lease_s=3600)

    outcome = record_stage(Stage.REPLACE, incident_id, lambda: {"outcome": "continued"})

    assert outcome["outcome"] == "continued"
    stage = next(a for a in timed.actions(incident_id) if a.target == Stage.REPLACE.value)
    assert (stage.status, stage.owner) == (ActionStatus.SUCCEEDED, claim_owner())
    (takeover,) = [
        e for e in timed.action_events(incident_id) if (e.detail or {}).get("taken_over_from")
    ]
    assert takeover.detail == {
        "taken_over_from": dead,
        "lease_expired_at": (datetime(2026, 1, 1, 13, 0, tzinfo=UTC)).isoformat(),
        "owner_dead": why,
    }


@pytest.mark.usefixtures("prefect_api")
def test_a_live_flow_run_keeps_its_claim(timed: Ledger) -> None:
    incident_id = timed.record_alarm(make_alarm()).incident_id
    live = _flow_run_owner(Running())
    timed.claim_action(incident_id, "stage", Stage.REPLACE.value, owner=live, lease_s=3600)
    ran: list[bool] = []

    with pytest.raises(ClaimLost):
        record_stage(Stage.REPLACE, incident_id, lambda: ran.append(True) or {})

    assert ran == []
    stage = next(a for a in timed.actions(incident_id) if a.target == Stage.REPLACE.value)
    assert (stage.status, stage.owner) == (ActionStatus.CLAIMED, live)
    assert not any(
        (e.detail or {}).get("taken_over_from") for e in timed.action_events(incident_id)
    )
