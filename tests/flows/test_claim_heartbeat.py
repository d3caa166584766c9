"""A stage's claim is kept alive by its heartbeat while it runs, and only while it runs.

Real ledgers (SQLite and PostgreSQL), the real clock and a lease of ``LEASE_S`` seconds, so that
"several lease lengths" takes seconds. Another run (``RIVAL``) tries to claim the stage the way
a retry or a zombie would, through the ledger. What is shown:

* a stage that runs for several lease lengths keeps its claim (every rival attempt loses) and
  then performs its side effect;
* a run whose heartbeat stopped without the stage finishing — a worker SIGKILLed before
  Prefect marked its run ``Crashed`` — is taken over once the lease has run out, not before,
  and the takeover is in the trail;
* a run whose heartbeat found the claim lost makes no further destructive call and records
  nothing;
* the heartbeat stops when the stage ends, however it ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from db import ActionStatus, ActionView, ClaimLost, Ledger
from flows.incident.coordination import claim_owner
from flows.incident.stages import Action, Stage, perform, record_stage
from flows.incident.stages._heartbeat import ClaimHeartbeat, current_heartbeat
from flows.incident.wiring import use_backends
from tests.db.support import make_alarm
from tests.flows.conftest import ledger_only

LEASE_S = 2.0
RIVAL = "flow-run-rival"


@pytest.fixture
def leased(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> Iterator[Ledger]:
    """The ledger as the only backend, with claims leased for ``LEASE_S`` seconds."""
    monkeypatch.setenv("SDCGUARD_FLOW_CLAIM_LEASE_S", str(LEASE_S))
    with use_backends(ledger_only(ledger)):
        yield ledger


def _await(what: str, condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:g} s"
        time.sleep(0.02)


def _await_renewal(heartbeat: ClaimHeartbeat, *, after: int) -> None:
    """Until the heartbeat renewed once more; a missed renewal is a lease that runs out."""
    _await("a renewal", lambda: heartbeat.beats > after, timeout_s=LEASE_S)


def _heartbeat() -> ClaimHeartbeat:
    heartbeat = current_heartbeat.get()
    assert heartbeat is not None, "a stage body runs with its heartbeat"
    return heartbeat


def _stage(ledger: Ledger, incident_id: str) -> ActionView:
    return next(a for a in ledger.actions(incident_id) if a.target == Stage.REPLACE.value)


def _rival_claims(ledger: Ledger, incident_id: str) -> bool:
    claim = ledger.claim_action(
        incident_id, "stage", Stage.REPLACE.value, owner=RIVAL, lease_s=LEASE_S
    )
    return claim.won


def _takeovers(ledger: Ledger, incident_id: str) -> list[dict[str, Any]]:
    return [
        e.detail
        for e in ledger.action_events(incident_id)
        if e.detail and e.detail.get("taken_over_from")
    ]


def test_a_long_stage_keeps_its_claim_past_several_leases(leased: Ledger) -> None:
    incident_id = leased.record_alarm(make_alarm()).incident_id
    calls: list[bool] = []
    seen: dict[str, Any] = {}

    def long_replacement() -> dict[str, Any]:
        heartbeat = _heartbeat()
        seen["heartbeat"] = heartbeat
        started = time.monotonic()
        attempts = 0
        # three lease lengths, and a rival attempt after each renewal: none may win
        while time.monotonic() - started < 3 * LEASE_S:
            _await_renewal(heartbeat, after=heartbeat.beats)
            assert not _rival_claims(leased, incident_id), "taken over while the stage ran"
            attempts += 1
            lease = _stage(leased, incident_id).lease_expires_at
            assert lease is not None
            assert lease > datetime.now(UTC)
        seen["attempts"] = attempts
        return perform(
            incident_id,
            Action.REPLACE,
            "node-2",
            lambda first: calls.append(first) or {"replaced": True},
        )

    outcome = record_stage(Stage.REPLACE, incident_id, long_replacement)

    assert outcome["replaced"] is True
    assert calls == [True]  # the side effect ran once, as the stage's first attempt
    assert seen["attempts"] >= 6  # renewals every third of the lease, for three leases
    stage = _stage(leased, incident_id)
    assert (stage.status, stage.owner, stage.attempts) == (
        ActionStatus.SUCCEEDED,
        claim_owner(),
        1,
    )
    assert _takeovers(leased, incident_id) == []
    assert not seen["heartbeat"].running  # stopped with its stage


def test_a_run_whose_heartbeat_stopped_is_taken_over_after_the_lease(leased: Ledger) -> None:
    incident_id = leased.record_alarm(make_alarm()).incident_id
    calls: list[bool] = []
    seen: dict[str, Any] = {}

    def killed_then_waking() -> dict[str, Any]:
        _heartbeat().stop()  # the worker is SIGKILLed: nothing renews the lease any more
        expiry = _stage(leased, incident_id).lease_expires_at
        assert expiry is not None
        seen["expiry"] = expiry
        _await("the rival takes the stage over", lambda: _rival_claims(leased, incident_id), 30)
        seen["taken_at"] = datetime.now(UTC)
        # the process was only frozen (a zombie): it wakes and goes on to its side effect
        return perform(
            incident_id, Action.REPLACE, "node-2", lambda first: calls.append(first) or {}
        )

    with pytest.raises(ClaimLost):
        record_stage(Stage.REPLACE, incident_id, killed_then_waking)

    assert calls == []  # no destructive call after the takeover
    assert seen["taken_at"] >= seen["expiry"]  # not before the lease ran out
    stage = _stage(leased, incident_id)
    assert (stage.status, stage.owner) == (ActionStatus.CLAIMED, RIVAL)
    (takeover,) = _takeovers(leased, incident_id)
    assert takeover["taken_over_from"] == claim_owner()
    assert datetime.fromisoformat(takeover["lease_expired_at"]) == seen["expiry"]


def test_a_run_whose_heartbeat_found_the_claim_lost_makes_no_destructive_call(
    leased: Ledger,
) -> None:
    """A rival that believed this run dead took the stage at once; the next renewal finds out,
    and the check before the side effect stops the stage with the heartbeat's ``ClaimLost``."""
    incident_id = leased.record_alarm(make_alarm()).incident_id
    calls: list[bool] = []
    seen: dict[str, Any] = {}

    def outlived() -> dict[str, Any]:
        heartbeat = _heartbeat()
        seen["heartbeat"] = heartbeat
        taken = leased.claim_action(
            incident_id,
            "stage",
            Stage.REPLACE.value,
            owner=RIVAL,
            lease_s=LEASE_S,
            dead_owner=claim_owner(),
            dead_reason="flow run CRASHED",
        )
        assert taken.won
        _await("the heartbeat finds the claim lost", lambda: heartbeat.lost is not None, 10)
        _await("the heartbeat stops renewing a lost claim", lambda: not heartbeat.running, 10)
        return perform(
            incident_id, Action.REPLACE, "node-2", lambda first: calls.append(first) or {}
        )

    with pytest.raises(ClaimLost) as raised:
        record_stage(Stage.REPLACE, incident_id, outlived)

    assert raised.value is seen["heartbeat"].lost  # stopped by what the heartbeat found
    assert raised.value.holder == RIVAL
    assert calls == []
    stage = _stage(leased, incident_id)
    assert (stage.status, stage.owner) == (ActionStatus.CLAIMED, RIVAL)  # nothing recorded
    (takeover,) = _takeovers(leased, incident_id)
    assert takeover["owner_dead"] == "flow run CRASHED"


class _EngineSignal(BaseException):
    """Stands in for what the engine raises through a task (a cancellation, a pause)."""


def _returns() -> dict[str, Any]:
    return {"outcome": "done"}


def _fails() -> dict[str, Any]:
    raise RuntimeError("HyperPod said no")


def _signalled() -> dict[str, Any]:
    raise _EngineSignal()


@pytest.mark.parametrize(
    ("body", "raised", "status"),
    [
        (_returns, None, ActionStatus.SUCCEEDED),
        (_fails, RuntimeError, ActionStatus.FAILED),
        (_signalled, _EngineSignal, ActionStatus.FAILED),
    ],
    ids=["success", "failure", "engine-signal"],
)
def test_the_heartbeat_stops_when_the_stage_ends(
    leased: Ledger,
    body: Callable[[], dict[str, Any]],
    raised: type[BaseException] | None,
    status: ActionStatus,
) -> None:
    incident_id = leased.record_alarm(make_alarm()).incident_id
    seen: list[ClaimHeartbeat] = []

    def observed() -> dict[str, Any]:
        seen.append(_heartbeat())
        assert seen[0].running
        return body()

    if raised is None:
        record_stage(Stage.REPLACE, incident_id, observed)
    else:
        with pytest.raises(raised):
            record_stage(Stage.REPLACE, incident_id, observed)

    (heartbeat,) = seen
    assert not heartbeat.running
    assert heartbeat.lost is None  # the finished claim was never renewed after the outcome
    assert current_heartbeat.get() is None
    assert _stage(leased, incident_id).status is status
