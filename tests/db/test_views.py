"""Views are frozen snapshots with JSON-safe ``to_dict()`` (the webhook returns them)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from db import ActionStatus, IncidentState, Ledger, Verdict
from tests.db.support import checkpoint, make_alarm, register


def test_views_are_frozen_and_json_safe(ledger: Ledger) -> None:
    register(ledger)
    outcome = ledger.record_alarm(make_alarm(step=37))
    claim = ledger.claim_action(outcome.incident_id, "cordon", "node-2", {"try": 1})
    ledger.finish_action(claim.action.key, ActionStatus.SUCCEEDED)
    ledger.transition(
        outcome.incident_id, IncidentState.DIAGNOSING, verdict=Verdict.HARDWARE, evidence={"a": 1}
    )
    checkpoint(ledger, 30)
    incident = ledger.get_incident(outcome.incident_id)
    views: list[Any] = [
        outcome,
        claim,
        incident,
        ledger.rank_map("job-1")[0],
        ledger.list_checkpoints("job-1")[0],
        ledger.action_events(outcome.incident_id)[0],
    ]
    for view in views:
        round_trip = json.loads(json.dumps(view.to_dict()))
        assert round_trip == view.to_dict()
        with pytest.raises(dataclasses.FrozenInstanceError):
            view.__setattr__(dataclasses.fields(view)[0].name, "changed")

    data = incident.to_dict()
    assert data["state"] == "diagnosing"
    assert data["verdict"] == "hardware"
    assert data["opened_at"].endswith("+00:00")
    assert data["alarms"][0]["step"] == 37
    assert data["actions"][0]["status"] == "succeeded"
    assert data["history"][-1]["to_state"] == "diagnosing"
    assert outcome.to_dict() == {
        "incident_id": outcome.incident_id,
        "duplicate": False,
        "opened": True,
    }
