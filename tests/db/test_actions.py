"""Idempotent actions: won once, a success never re-won, a failure re-claimable; every claim and
finish is an append-only event row that the database itself refuses to change."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from db import (
    ActionStateError,
    ActionStatus,
    InvalidValue,
    Ledger,
    UnknownAction,
    UnknownIncident,
)
from tests.db.support import make_alarm, row_counts


@pytest.fixture
def incident_id(ledger: Ledger) -> str:
    return ledger.record_alarm(make_alarm()).incident_id


def test_first_claim_wins_and_a_second_does_not(ledger: Ledger, incident_id: str) -> None:
    first = ledger.claim_action(incident_id, "cordon", "node-2", {"by": "flow-run-1"})
    assert first.won is True
    assert first.action.key == f"{incident_id}:cordon:node-2"
    assert (first.action.status, first.action.attempts) == (ActionStatus.CLAIMED, 1)
    assert first.action.detail == {"by": "flow-run-1"}
    second = ledger.claim_action(incident_id, "cordon", "node-2")
    assert second.won is False
    assert second.action.status == ActionStatus.CLAIMED
    assert [a.key for a in ledger.actions(incident_id)] == [first.action.key]


def test_a_succeeded_action_is_never_won_again(ledger: Ledger, incident_id: str) -> None:
    key = ledger.claim_action(incident_id, "replace", "node-2").action.key
    done = ledger.finish_action(key, ActionStatus.SUCCEEDED, {"new_instance": "i-9"})
    assert done.finished_at is not None
    again = ledger.claim_action(incident_id, "replace", "node-2")
    assert again.won is False
    assert again.action.status == ActionStatus.SUCCEEDED
    assert again.action.attempts == 1
    assert again.action.detail == {"new_instance": "i-9"}


def test_a_failed_action_may_be_claimed_again(ledger: Ledger, incident_id: str) -> None:
    key = ledger.claim_action(incident_id, "resume", "job-1").action.key
    ledger.finish_action(key, ActionStatus.FAILED, {"error": "timeout"})
    retry = ledger.claim_action(incident_id, "resume", "job-1")
    assert retry.won is True
    assert (retry.action.status, retry.action.attempts) == (ActionStatus.CLAIMED, 2)
    assert retry.action.finished_at is None
    assert ledger.claim_action(incident_id, "resume", "job-1").won is False


def test_every_claim_and_finish_is_an_event_row(ledger: Ledger, incident_id: str) -> None:
    key = ledger.claim_action(incident_id, "resume", "job-1").action.key
    ledger.claim_action(incident_id, "resume", "job-1")  # lost: no event
    ledger.finish_action(key, ActionStatus.FAILED, {"error": "timeout"})
    ledger.claim_action(incident_id, "resume", "job-1")
    ledger.finish_action(key, ActionStatus.SUCCEEDED)
    ledger.finish_action(key, ActionStatus.SUCCEEDED)  # a retried finish: no event
    events = ledger.action_events(incident_id)
    assert [(e.status.value, e.attempt) for e in events] == [
        ("claimed", 1),
        ("failed", 1),
        ("claimed", 2),
        ("succeeded", 2),
    ]
    assert events[1].detail == {"error": "timeout"}
    assert [e.id for e in events] == sorted(e.id for e in events)


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE action_events SET attempt = 99",
        "DELETE FROM action_events",
        "UPDATE incident_events SET reason = 'rewritten'",
        "DELETE FROM incident_events",
    ],
)
def test_event_tables_are_append_only_in_the_database(
    ledger: Ledger, incident_id: str, statement: str
) -> None:
    ledger.claim_action(incident_id, "cordon", "node-2")
    counts = row_counts(ledger.engine)
    with pytest.raises(sa.exc.DBAPIError, match="append-only"), ledger.engine.begin() as conn:
        conn.exec_driver_sql(statement)
    assert row_counts(ledger.engine) == counts
    assert ledger.action_events(incident_id)[0].attempt == 1


def test_finishing_wrongly_is_refused(ledger: Ledger, incident_id: str) -> None:
    with pytest.raises(UnknownAction):
        ledger.finish_action(f"{incident_id}:cordon:node-7", ActionStatus.SUCCEEDED)
    key = ledger.claim_action(incident_id, "cordon", "node-2").action.key
    with pytest.raises(InvalidValue, match="succeeded or failed"):
        ledger.finish_action(key, ActionStatus.CLAIMED)
    ledger.finish_action(key, ActionStatus.SUCCEEDED)
    counts = row_counts(ledger.engine)
    with pytest.raises(ActionStateError, match="is succeeded; cannot mark it failed"):
        ledger.finish_action(key, ActionStatus.FAILED)
    assert row_counts(ledger.engine) == counts
    assert ledger.actions(incident_id)[0].status == ActionStatus.SUCCEEDED


def test_claims_need_a_known_incident_and_a_clean_kind(ledger: Ledger, incident_id: str) -> None:
    counts = row_counts(ledger.engine)
    with pytest.raises(UnknownIncident):
        ledger.claim_action("no-such-incident", "cordon", "node-2")
    with pytest.raises(InvalidValue, match="':'"):
        ledger.claim_action(incident_id, "cordon:now", "node-2")
    with pytest.raises(InvalidValue, match="JSON"):
        ledger.claim_action(incident_id, "cordon", "node-2", {"when": object()})
    assert row_counts(ledger.engine) == counts


def test_actions_come_back_with_their_incident(ledger: Ledger, incident_id: str) -> None:
    ledger.claim_action(incident_id, "stop", "job-1")
    ledger.claim_action(incident_id, "cordon", "node-2")
    incident = ledger.get_incident(incident_id)
    assert [(a.kind, a.target) for a in incident.actions] == [
        ("stop", "job-1"),
        ("cordon", "node-2"),
    ]
