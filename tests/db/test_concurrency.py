"""Races between webhook replicas and flow workers, on real threads and real databases."""

from __future__ import annotations

import sqlalchemy as sa

from db import ActionStatus, AlarmOutcome, IncidentState, Ledger
from db.models import ActionEventRow, AlarmRow, Base, IncidentRow
from tests.db.support import make_alarm, register, run_concurrently


def _count(ledger: Ledger, table: type[Base]) -> int:
    with ledger.engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()


def test_64_threads_recording_the_same_alarm_store_it_once(ledger: Ledger) -> None:
    register(ledger)
    alarm = make_alarm(alarm_id="the-one-alarm")
    outcomes = run_concurrently(64, lambda _: ledger.record_alarm(alarm))
    assert sum(not o.duplicate for o in outcomes) == 1
    assert sum(o.opened for o in outcomes) == 1
    assert len({o.incident_id for o in outcomes}) == 1
    assert _count(ledger, AlarmRow) == 1
    assert _count(ledger, IncidentRow) == 1


def test_32_threads_claiming_one_action_have_one_winner(ledger: Ledger) -> None:
    incident_id = ledger.record_alarm(make_alarm()).incident_id
    claims = run_concurrently(32, lambda _: ledger.claim_action(incident_id, "replace", "node-2"))
    assert sum(c.won for c in claims) == 1
    assert {c.action.key for c in claims} == {f"{incident_id}:replace:node-2"}
    assert all(c.action.status == ActionStatus.CLAIMED for c in claims)
    assert ledger.actions(incident_id)[0].attempts == 1
    assert _count(ledger, ActionEventRow) == 1


def test_32_threads_reclaiming_a_failed_action_have_one_winner(ledger: Ledger) -> None:
    incident_id = ledger.record_alarm(make_alarm()).incident_id
    key = ledger.claim_action(incident_id, "resume", "job-1").action.key
    ledger.finish_action(key, ActionStatus.FAILED)
    claims = run_concurrently(32, lambda _: ledger.claim_action(incident_id, "resume", "job-1"))
    assert sum(c.won for c in claims) == 1
    assert ledger.actions(incident_id)[0].attempts == 2


def test_two_alarms_of_one_job_at_once_end_in_one_incident(ledger: Ledger) -> None:
    """Repeated over several fresh jobs so that the two really do race on each."""
    jobs = [f"race-{i}" for i in range(6)]
    for job in jobs:
        register(ledger, job)
        ledger.record_audit(job, 20, "loss", [0, 1], passed=True)

    def alarm(i: int) -> str:
        job = jobs[i // 2]
        step = 37 if i % 2 == 0 else 52
        return ledger.record_alarm(
            make_alarm(job, step, suspect_nodes=[f"node-{i % 2}"])
        ).incident_id

    incident_ids = run_concurrently(2 * len(jobs), alarm)
    for n, job in enumerate(jobs):
        assert incident_ids[2 * n] == incident_ids[2 * n + 1]
        [incident] = ledger.list_incidents(job)
        assert incident.state == IncidentState.OPEN
        assert (incident.suspect_start, incident.suspect_end) == (21, 52)
        assert incident.suspect_nodes == ["node-0", "node-1"]
        assert sorted(a.step for a in incident.alarms) == [37, 52]


def test_first_alarms_of_an_unknown_job_at_once_create_it_once(ledger: Ledger) -> None:
    outcomes = run_concurrently(8, lambda i: ledger.record_alarm(make_alarm("fresh", 30 + i)))
    assert len({o.incident_id for o in outcomes}) == 1
    assert sum(o.opened for o in outcomes) == 1
    [incident] = ledger.list_incidents("fresh")
    assert (incident.suspect_start, incident.suspect_end) == (0, 37)
    assert incident.ranks_missing is True


def test_concurrent_batches_of_one_job_open_one_incident_and_store_each_alarm_once(
    ledger: Ledger,
) -> None:
    """Eight webhook replicas each write a batch of the same storm; neighbours overlap by half,
    as re-sent alarms do, so some ids race in two batches at once."""
    register(ledger, "storm", world_size=8)
    ledger.record_audit("storm", 20, "loss", [0, 1], passed=True)
    alarms = [
        make_alarm("storm", 30 + rank % 9, rank=rank, suspect_nodes=[f"node-{rank % 8}"])
        for rank in range(8 * 16)
    ]
    batches = [alarms[16 * i : 16 * i + 32] for i in range(8)]  # the last one is half as long
    outcomes = run_concurrently(len(batches), lambda i: ledger.record_alarms(batches[i]))

    flat = [o for batch in outcomes for o in batch]
    assert sum(o.opened for o in flat) == 1
    assert sum(not o.duplicate for o in flat) == len(alarms)
    assert len({o.incident_id for o in flat}) == 1
    assert _count(ledger, AlarmRow) == len(alarms)
    [incident] = ledger.list_incidents("storm")
    assert (incident.suspect_start, incident.suspect_end) == (21, 38)
    assert incident.suspect_nodes == [f"node-{n}" for n in range(8)]


def test_concurrent_batches_spanning_jobs_end_in_one_incident_per_job(ledger: Ledger) -> None:
    """Each batch names the same jobs in a different order, jobs the ledger has not seen yet
    among them: every batch commits, and each job gets one incident holding all its alarms."""
    jobs = [f"multi-{j}" for j in range(6)]
    for job in jobs[:3]:
        register(ledger, job)  # the other three are created by their first alarms

    def batch(i: int) -> list[AlarmOutcome]:
        order = jobs[i % len(jobs) :] + jobs[: i % len(jobs)]
        if i % 2:
            order.reverse()
        return ledger.record_alarms([make_alarm(job, 40 + i) for job in order])

    outcomes = run_concurrently(12, batch)
    flat = [o for per_batch in outcomes for o in per_batch]
    assert not any(o.duplicate for o in flat)
    assert sum(o.opened for o in flat) == len(jobs)
    for job in jobs:
        [incident] = ledger.list_incidents(job)
        assert (incident.suspect_start, incident.suspect_end) == (0, 51)
        assert len(incident.alarms) == 12
    assert _count(ledger, IncidentRow) == len(jobs)
