"""The incident state machine: legal moves, refused moves, and what a move records."""

from __future__ import annotations

import itertools

import pytest

from db import (
    IllegalTransition,
    IncidentState,
    InvalidValue,
    Ledger,
    UnknownIncident,
    Verdict,
    can_transition,
)
from db.enums import TERMINAL_STATES
from tests.db.support import make_alarm, register, row_counts

S = IncidentState
CHAIN = [
    S.OPEN,
    S.STOPPING,
    S.CORDONED,
    S.DIAGNOSING,
    S.AWAITING_APPROVAL,
    S.REPLACING,
    S.RESUMING,
    S.RESOLVED,
]


def _expected_legal() -> set[tuple[IncidentState, IncidentState]]:
    legal = {(s, s) for s in S}
    legal |= {(a, b) for a, b in itertools.combinations(CHAIN, 2)}  # forward, skips allowed
    legal |= {(s, S.FAILED) for s in S if s not in TERMINAL_STATES}
    legal |= {(S.AWAITING_APPROVAL, S.REJECTED), (S.AWAITING_APPROVAL, S.EXPIRED)}
    return legal


def test_can_transition_matches_the_design_for_every_pair() -> None:
    legal = _expected_legal()
    for current, to in itertools.product(S, S):
        assert can_transition(current, to) == ((current, to) in legal), (current, to)


def test_terminal_states_are_exactly_the_four_ends() -> None:
    assert {s for s in S if s.terminal} == {S.RESOLVED, S.REJECTED, S.EXPIRED, S.FAILED}


def _open(ledger: Ledger) -> str:
    register(ledger)
    return ledger.record_alarm(make_alarm()).incident_id


def test_happy_path_walks_to_resolved_and_records_history(ledger: Ledger) -> None:
    incident_id = _open(ledger)
    for state in CHAIN[1:]:
        view = ledger.transition(incident_id, state, reason=f"to {state}")
        assert view.state == state
    assert view.closed_at is not None
    expected = [(None, S.OPEN), *itertools.pairwise(CHAIN)]
    assert [(e.from_state, e.to_state) for e in view.history] == expected
    assert ledger.open_incident_for("job-1") is None


def test_skipping_forward_is_legal(ledger: Ledger) -> None:
    incident_id = _open(ledger)
    assert ledger.transition(incident_id, S.DIAGNOSING).state == S.DIAGNOSING


@pytest.mark.parametrize(
    ("path", "illegal"),
    [
        ([S.CORDONED], S.STOPPING),  # backwards
        ([S.DIAGNOSING], S.REJECTED),  # only awaiting_approval may be rejected
        ([S.STOPPING], S.EXPIRED),
        ([S.RESOLVED], S.FAILED),  # nothing leaves a terminal state
        ([S.AWAITING_APPROVAL, S.REJECTED], S.REPLACING),
        ([S.FAILED], S.OPEN),
    ],
)
def test_illegal_moves_raise_and_change_nothing(
    ledger: Ledger, path: list[IncidentState], illegal: IncidentState
) -> None:
    incident_id = _open(ledger)
    for state in path:
        ledger.transition(incident_id, state)
    before = ledger.get_incident(incident_id)
    counts = row_counts(ledger.engine)
    with pytest.raises(IllegalTransition, match=f"{path[-1].value} → {illegal.value}"):
        ledger.transition(incident_id, illegal, verdict=Verdict.HARDWARE)
    assert ledger.get_incident(incident_id) == before
    assert row_counts(ledger.engine) == counts


def test_same_state_is_an_idempotent_no_op(ledger: Ledger) -> None:
    incident_id = _open(ledger)
    first = ledger.transition(incident_id, S.STOPPING, reason="stop")
    counts = row_counts(ledger.engine)
    again = ledger.transition(incident_id, S.STOPPING, reason="stop")
    assert again == first
    assert row_counts(ledger.engine) == counts


def test_same_state_with_new_fields_records_them_while_live(ledger: Ledger) -> None:
    incident_id = _open(ledger)
    ledger.transition(incident_id, S.DIAGNOSING)
    view = ledger.transition(
        incident_id, S.DIAGNOSING, verdict=Verdict.HARDWARE, evidence={"replay": "diverged"}
    )
    assert view.state == S.DIAGNOSING
    assert view.verdict == Verdict.HARDWARE
    assert view.evidence == {"replay": "diverged"}
    assert view.history[-1].detail == {"verdict": "hardware", "evidence": {"replay": "diverged"}}


def test_a_closed_record_is_final(ledger: Ledger) -> None:
    incident_id = _open(ledger)
    ledger.transition(incident_id, S.AWAITING_APPROVAL)
    rejected = ledger.transition(
        incident_id, S.REJECTED, approver="alice", decision="reject", approval_reason="looks sw"
    )
    # A retry with the same values is harmless ...
    assert ledger.transition(incident_id, S.REJECTED, approver="alice") == rejected
    # ... rewriting who decided is not.
    with pytest.raises(IllegalTransition, match="final"):
        ledger.transition(incident_id, S.REJECTED, approver="mallory")
    assert ledger.get_incident(incident_id).approver == "alice"


def test_approval_fields_and_storm_are_recorded(ledger: Ledger) -> None:
    incident_id = _open(ledger)
    ledger.transition(
        incident_id, S.AWAITING_APPROVAL, storm=True, reason="5 of 8 nodes implicated"
    )
    view = ledger.transition(
        incident_id,
        S.REPLACING,
        approver="alice",
        approval_reason="dcgm diag failed",
        decision="approve",
    )
    assert (view.approver, view.approval_reason, view.decision) == (
        "alice",
        "dcgm diag failed",
        "approve",
    )
    assert view.decided_at is not None
    assert view.storm is True
    assert view.storm_reason == "5 of 8 nodes implicated"


def test_unknown_incident_and_bad_state_are_typed_errors(ledger: Ledger) -> None:
    with pytest.raises(UnknownIncident):
        ledger.transition("no-such-incident", S.STOPPING)
    incident_id = _open(ledger)
    with pytest.raises(InvalidValue, match="state must be one of"):
        ledger.transition(incident_id, "sideways")  # type: ignore[arg-type]
    with pytest.raises(InvalidValue, match="verdict"):
        ledger.transition(incident_id, S.STOPPING, verdict="cosmic-rays")  # type: ignore[arg-type]
    assert ledger.get_incident(incident_id).state == S.OPEN


def test_failed_is_reachable_from_every_live_state(ledger: Ledger) -> None:
    for i, state in enumerate(CHAIN[:-1]):
        job = f"job-f{i}"
        incident_id = ledger.record_alarm(make_alarm(job)).incident_id
        if state != S.OPEN:
            ledger.transition(incident_id, state)
        assert ledger.transition(incident_id, S.FAILED, reason="cordon failed").state == S.FAILED
