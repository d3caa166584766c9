"""Alarms: dedup by id, one open incident per job, and the suspect range they imply."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from db import IncidentState, Ledger
from tests.db.support import make_alarm, register, row_counts


def test_first_alarm_opens_an_incident(ledger: Ledger) -> None:
    register(ledger)
    outcome = ledger.record_alarm(make_alarm(step=37, alarm_id="a-1"))
    assert (outcome.duplicate, outcome.opened) == (False, True)
    incident = ledger.get_incident(outcome.incident_id)
    assert incident.state == IncidentState.OPEN
    assert (incident.suspect_start, incident.suspect_end) == (0, 37)
    assert incident.suspect_nodes == ["node-2"]
    assert incident.ranks_missing is False
    assert [a.alarm_id for a in incident.alarms] == ["a-1"]
    assert incident.alarms[0].detail == {"delta": 1.5}
    assert incident.alarms[0].sent_at == datetime(2025, 1, 1, 12, 0, tzinfo=UTC)


def test_a_resent_alarm_is_a_duplicate(ledger: Ledger) -> None:
    alarm = make_alarm(alarm_id="a-1")
    first = ledger.record_alarm(alarm)
    counts = row_counts(ledger.engine)
    again = ledger.record_alarm(alarm)
    assert again.incident_id == first.incident_id
    assert (again.duplicate, again.opened) == (True, False)
    assert row_counts(ledger.engine) == counts


def test_later_alarms_attach_and_widen(ledger: Ledger) -> None:
    register(ledger)
    ledger.record_audit("job-1", 20, "loss", [0, 1, 2, 3], passed=True)
    ledger.record_audit("job-1", 30, "loss", [0, 1, 2, 3], passed=True)
    first = ledger.record_alarm(make_alarm(step=37, suspect_nodes=["node-2"]))
    later = ledger.record_alarm(make_alarm(step=45, suspect_nodes=["node-3"]))
    assert later.incident_id == first.incident_id
    assert (later.duplicate, later.opened) == (False, False)
    # An earlier alarm arriving late pulls the start back behind the audit at 30.
    earlier = ledger.record_alarm(make_alarm(step=25, suspect_nodes=[]))
    assert earlier.incident_id == first.incident_id
    incident = ledger.get_incident(first.incident_id)
    assert (incident.suspect_start, incident.suspect_end) == (21, 45)
    assert incident.suspect_nodes == ["node-0", "node-2", "node-3"]  # node-0: fallback, no suspects
    assert [a.step for a in incident.alarms] == [25, 37, 45]
    assert len(ledger.list_incidents("job-1")) == 1


def test_suspect_start_follows_the_latest_passed_audit_before_the_alarm(ledger: Ledger) -> None:
    register(ledger)
    ledger.record_audit("job-1", 20, "loss", [0, 1], passed=True)
    ledger.record_audit("job-1", 30, "loss", [0, 1], passed=False)  # a failure is no evidence
    ledger.record_audit("job-1", 40, "loss", [0, 1], passed=True)  # not before the alarm
    outcome = ledger.record_alarm(make_alarm(step=37))
    incident = ledger.get_incident(outcome.incident_id)
    assert (incident.suspect_start, incident.suspect_end) == (21, 37)


def test_an_audit_at_the_alarm_step_does_not_clear_it(ledger: Ledger) -> None:
    ledger.ensure_job("job-1")
    ledger.record_audit("job-1", 37, "loss", [0, 1], passed=True)
    incident = ledger.get_incident(ledger.record_alarm(make_alarm(step=37)).incident_id)
    assert incident.suspect_start == 0


def test_fingerprint_votes_bound_the_range_only_without_ring_audits(ledger: Ledger) -> None:
    ledger.ensure_job("votes-only")
    ledger.record_audit("votes-only", 30, "fingerprint", [0, 1, 2], passed=True)
    votes_only = ledger.record_alarm(make_alarm("votes-only", step=37))
    assert ledger.get_incident(votes_only.incident_id).suspect_start == 31

    ledger.ensure_job("ring")
    ledger.record_audit("ring", 20, "gradient", [0, 1], passed=True)
    ledger.record_audit("ring", 30, "fingerprint", [0, 1], passed=True)
    ring = ledger.record_alarm(make_alarm("ring", step=37))
    assert ledger.get_incident(ring.incident_id).suspect_start == 21


def test_alarm_for_an_unknown_job_creates_it_and_flags_missing_ranks(ledger: Ledger) -> None:
    outcome = ledger.record_alarm(make_alarm("never-registered"))
    incident = ledger.get_incident(outcome.incident_id)
    assert incident.ranks_missing is True
    assert ledger.rank_map("never-registered") == {}
    # Ranks registered later do not rewrite what was known when it opened.
    register(ledger, "never-registered")
    assert ledger.get_incident(outcome.incident_id).ranks_missing is True


def test_after_a_terminal_incident_the_next_alarm_opens_a_new_one(ledger: Ledger) -> None:
    first = ledger.record_alarm(make_alarm(step=37))
    ledger.transition(first.incident_id, IncidentState.FAILED)
    second = ledger.record_alarm(make_alarm(step=50))
    assert second.opened is True
    assert second.incident_id != first.incident_id
    open_now = ledger.open_incident_for("job-1")
    assert open_now is not None
    assert open_now.id == second.incident_id
    assert [i.id for i in ledger.list_incidents("job-1")] == [second.incident_id, first.incident_id]
    assert [i.id for i in ledger.list_incidents(state=IncidentState.FAILED)] == [first.incident_id]


def test_sent_at_is_kept_in_utc(ledger: Ledger) -> None:
    plus_two = timezone(timedelta(hours=2))
    alarm = make_alarm()
    alarm = type(alarm)(
        **{**alarm.__dict__, "sent_at": datetime(2025, 1, 1, 14, 0, tzinfo=plus_two)}
    )
    incident = ledger.get_incident(ledger.record_alarm(alarm).incident_id)
    sent = incident.alarms[0].sent_at
    assert sent == datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
    assert sent is not None
    assert sent.utcoffset() == timedelta(0)


def test_register_ranks_upserts_and_moves_last_seen(ledger: Ledger) -> None:
    from db import RankIn

    ledger.register_ranks("job-1", [RankIn(0, 0, "node-0", "i-0", "GPU-0"), RankIn(1, 1, "node-0")])
    before = ledger.rank_map("job-1")
    ledger.register_ranks("job-1", [RankIn(1, 0, "node-9", "i-9", "GPU-9")])
    after = ledger.rank_map("job-1")
    assert sorted(after) == [0, 1]
    assert after[0] == before[0]
    assert (after[1].node, after[1].instance_id, after[1].gpu_uuid) == ("node-9", "i-9", "GPU-9")
    assert after[1].first_seen == before[1].first_seen
    assert after[1].last_seen >= before[1].last_seen
