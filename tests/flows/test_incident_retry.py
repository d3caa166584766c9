"""An operator moves a ``failed`` or ``expired`` incident forward: ledger, API and CLI.

The flow part (a failed replacement retried to ``resolved``) is in ``test_incident.py``; here
the reopen itself, on SQLite and PostgreSQL: where it goes back to, what it clears, what it
refuses, and that the API and the CLI start exactly one run per retry.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from db import (
    ActionStatus,
    IllegalTransition,
    IncidentConflict,
    IncidentState,
    Ledger,
    RankIn,
)
from db.ledger.incidents import retry_count
from flows.cli import app
from tests.flows.conftest import Webhook, ranks_payload

JOB = "job-1"


def _failed_in_replacing(ledger: Ledger) -> str:
    incident = ledger.open_incident(JOB, start=10, end=20, suspect_nodes=["node-1"])
    ledger.transition(incident.id, IncidentState.REPLACING, reason="replace approved")
    ledger.transition(incident.id, IncidentState.FAILED, reason="ThrottledError: slow down")
    return incident.id


def _expired(ledger: Ledger) -> str:
    incident = ledger.open_incident(JOB, start=10, end=20, suspect_nodes=["node-1"])
    ledger.transition(incident.id, IncidentState.AWAITING_APPROVAL, reason="waiting")
    stage = ledger.claim_action(incident.id, "stage", "approval")
    ledger.finish_action(stage.action.key, ActionStatus.SUCCEEDED, {"decision": "expire"})
    ledger.transition(
        incident.id,
        IncidentState.AWAITING_APPROVAL,
        decision="expire",
        approval_reason="no decision within 60 s",
        evidence={"approval": {"decision": "expire"}, "approval_request": {"nodes": ["node-1"]}},
    )
    ledger.transition(incident.id, IncidentState.EXPIRED, reason="no decision")
    return incident.id


def test_a_failed_incident_reopens_where_it_failed_and_counts_its_retries(webhook: Webhook) -> None:
    assert webhook.post(f"/v1/jobs/{JOB}/ranks", ranks_payload(8)).status_code == 200
    ledger = webhook.ledger
    incident_id = _failed_in_replacing(ledger)

    reopened = ledger.retry_incident(incident_id, by="oncall", reason="throttling is over")

    assert reopened.state is IncidentState.REPLACING
    assert reopened.closed_at is None
    assert retry_count(reopened) == 1
    last = reopened.history[-1]
    assert (last.from_state, last.to_state) == (IncidentState.FAILED, IncidentState.REPLACING)
    assert last.detail == {"retry": 1, "by": "oncall"}
    with pytest.raises(IllegalTransition):  # live now: not retried twice
        ledger.retry_incident(incident_id, by="oncall", reason="again")


def test_an_expired_incident_reopens_for_a_new_decision(webhook: Webhook) -> None:
    assert webhook.post(f"/v1/jobs/{JOB}/ranks", ranks_payload(8)).status_code == 200
    ledger = webhook.ledger
    incident_id = _expired(ledger)

    reopened = ledger.retry_incident(incident_id, by="oncall", reason="approver is back")

    assert reopened.state is IncidentState.AWAITING_APPROVAL
    assert reopened.decision is None
    assert reopened.approver is None
    assert "approval" not in (reopened.evidence or {})
    assert "approval_request" not in (reopened.evidence or {})  # a new deadline next run
    stage = next(a for a in ledger.actions(incident_id) if a.target == "approval")
    assert stage.status is ActionStatus.FAILED  # claimable again: the next run asks again
    assert (stage.detail or {}).get("reopened") is True


def test_a_retry_is_refused_while_the_job_has_another_live_incident(webhook: Webhook) -> None:
    assert webhook.post(f"/v1/jobs/{JOB}/ranks", ranks_payload(8)).status_code == 200
    ledger = webhook.ledger
    old = _failed_in_replacing(ledger)
    ledger.open_incident(JOB, start=30, end=40, suspect_nodes=["node-0"])
    with pytest.raises(IncidentConflict):
        ledger.retry_incident(old, by="oncall", reason="retry")
    assert ledger.get_incident(old).state is IncidentState.FAILED


def test_the_api_retries_once_and_starts_one_run(webhook: Webhook) -> None:
    assert webhook.post(f"/v1/jobs/{JOB}/ranks", ranks_payload(8)).status_code == 200
    incident_id = _failed_in_replacing(webhook.ledger)
    body = {"by": "oncall@example.com", "reason": "HyperPod throttling is over"}

    first = webhook.post(f"/v1/incidents/{incident_id}/retry", body)
    assert first.status_code == 202, first.text
    assert first.json() == {"incident_id": incident_id, "state": "replacing", "retry": 1}
    assert webhook.trigger.calls == [(incident_id, JOB)]

    webhook.ledger.transition(incident_id, IncidentState.RESUMING)
    webhook.ledger.transition(incident_id, IncidentState.RESOLVED, reason="resumed")
    refused = webhook.post(f"/v1/incidents/{incident_id}/retry", body)
    assert refused.status_code == 409
    assert "only a failed or expired incident" in refused.json()["detail"]
    assert webhook.trigger.calls == [(incident_id, JOB)]
    unsigned = webhook.post_raw(f"/v1/incidents/{incident_id}/retry", json.dumps(body).encode(), {})
    assert unsigned.status_code == 401


def test_the_cli_retries_and_prints_json(webhook: Webhook, database_url: str) -> None:
    assert webhook.post(f"/v1/jobs/{JOB}/ranks", ranks_payload(8)).status_code == 200
    incident_id = _failed_in_replacing(webhook.ledger)
    runner = CliRunner()

    shown = runner.invoke(app, ["incident", incident_id, "--json", "--database-url", database_url])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["state"] == "failed"

    args = ["incident", "retry", incident_id, "--by", "oncall", "--database-url", database_url]
    done = runner.invoke(app, [*args, "--run", "none", "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.output) == {"incident_id": incident_id, "reopened_as": "replacing"}
    again = runner.invoke(app, [*args, "--run", "none"])
    assert again.exit_code == 0  # reopened already: the same retry's run is started again
    assert webhook.ledger.get_incident(incident_id).state is IncidentState.REPLACING


def test_a_withdrawn_decision_goes_back_to_a_human_and_says_so(ledger: Ledger) -> None:
    ledger.register_ranks(JOB, [RankIn(0, 0, "node-1")])
    incident = ledger.open_incident(JOB, start=10, end=20, suspect_nodes=["node-1"])
    ledger.transition(incident.id, IncidentState.AWAITING_APPROVAL, reason="waiting")
    with pytest.raises(IllegalTransition):  # nothing decided yet: nothing to withdraw
        ledger.withdraw_decision(incident.id, by="storm guard", reason="storm")
    stage = ledger.claim_action(incident.id, "stage", "approval")
    ledger.finish_action(stage.action.key, ActionStatus.SUCCEEDED, {"decision": "approve"})
    ledger.transition(
        incident.id,
        IncidentState.AWAITING_APPROVAL,
        decision="approve",
        approver="policy:auto-approve",
        approval_reason="hardware verdict",
        evidence={
            "approval": {"decision": "approve", "nodes": ["node-1"]},
            "approval_request": {"nodes": ["node-1"], "deadline": "2026-01-01T00:00:00+00:00"},
        },
    )

    back = ledger.withdraw_decision(incident.id, by="storm guard", reason="3 of 4 nodes")

    assert back.state is IncidentState.AWAITING_APPROVAL
    assert (back.decision, back.approver, back.approval_reason) == (None, None, None)
    assert not {"approval", "approval_request"} & set(back.evidence or {})
    last = back.history[-1]
    assert (last.from_state, last.to_state) == (
        IncidentState.AWAITING_APPROVAL,
        IncidentState.AWAITING_APPROVAL,
    )
    assert last.reason == "decision withdrawn by storm guard: 3 of 4 nodes"
    assert last.detail == {
        "withdrawn": {
            "decision": "approve",
            "approver": "policy:auto-approve",
            "nodes": ["node-1"],
        },
        "by": "storm guard",
    }
    assert IncidentState.EXPIRED not in {e.to_state for e in back.history}  # never expired
    assert retry_count(back) == 0
    approval = next(a for a in ledger.actions(incident.id) if a.target == "approval")
    assert approval.status is ActionStatus.FAILED  # claimable again: a human is asked
    assert "decision withdrawn" in str((approval.detail or {})["outcome"])
    # a withdrawn decision is gone: withdrawing again is refused
    with pytest.raises(IllegalTransition):
        ledger.withdraw_decision(incident.id, by="storm guard", reason="again")
