"""Alarms: dedup by id, one open incident per job, and the suspect range they imply."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from db import AlarmConflict, AlarmIn, IncidentState, InvalidValue, Ledger
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


# ---------------------------------------------------------------------- batches


def test_a_batch_has_the_outcomes_of_recording_one_by_one(ledger: Ledger) -> None:
    register(ledger)
    stored = ledger.record_alarm(make_alarm("other-job", step=3, alarm_id="stored"))
    batch = [
        make_alarm(step=40, alarm_id="b-1", suspect_nodes=["node-1"]),
        make_alarm(step=38, alarm_id="b-2", suspect_nodes=[]),
        make_alarm(step=40, alarm_id="b-1", suspect_nodes=["node-1"]),  # a re-send in the batch
        make_alarm(step=40, alarm_id="b-1", suspect_nodes=["node-1"]),  # and another
        make_alarm("other-job", step=3, alarm_id="stored"),  # already in the ledger
        make_alarm("other-job", step=9, alarm_id="b-3", suspect_nodes=["node-3"]),
        make_alarm("new-job", step=5, alarm_id="b-4"),
    ]
    outcomes = ledger.record_alarms(batch)

    [opened_here] = ledger.list_incidents("job-1")
    [new_job] = ledger.list_incidents("new-job")
    assert [(o.incident_id, o.duplicate, o.opened) for o in outcomes] == [
        (opened_here.id, False, True),
        (opened_here.id, False, False),
        (opened_here.id, True, False),
        (opened_here.id, True, False),
        (stored.incident_id, True, False),
        (stored.incident_id, False, False),
        (new_job.id, False, True),
    ]
    assert (opened_here.suspect_start, opened_here.suspect_end) == (0, 40)
    assert opened_here.suspect_nodes == ["node-0", "node-1"]  # node-0: b-2's own node
    assert sorted(a.alarm_id for a in opened_here.alarms) == ["b-1", "b-2"]
    other = ledger.get_incident(stored.incident_id)
    assert (other.suspect_start, other.suspect_end) == (0, 9)
    assert other.suspect_nodes == ["node-2", "node-3"]
    assert new_job.ranks_missing is True
    counts = row_counts(ledger.engine)
    assert (counts["alarms"], counts["jobs"]) == (5, 3)


def test_an_alarm_id_seen_before_with_other_content_is_a_conflict(ledger: Ledger) -> None:
    register(ledger)
    ledger.record_alarm(make_alarm(step=7, alarm_id="a-1"))
    counts = row_counts(ledger.engine)
    with pytest.raises(AlarmConflict, match="different step"):
        ledger.record_alarm(make_alarm(step=2_000_000_000, alarm_id="a-1"))
    with pytest.raises(AlarmConflict, match="different detail"):
        ledger.record_alarms([make_alarm(step=7, alarm_id="a-1", detail={"delta": 9.0})])
    with pytest.raises(AlarmConflict, match="different suspect_nodes"):  # inside one batch
        ledger.record_alarms(
            [make_alarm(alarm_id="b-1"), make_alarm(alarm_id="b-1", suspect_nodes=["node-3"])]
        )
    assert row_counts(ledger.engine) == counts
    assert ledger.record_alarm(make_alarm(step=7, alarm_id="a-1")).duplicate  # the same: fine


def test_the_same_event_from_another_reporter_is_a_duplicate_not_a_conflict(
    ledger: Ledger,
) -> None:
    """A job's re-run (or a second rank) reports the event it detected again, under the same
    id, from another rank and node: the ledger keeps the first report and counts a duplicate."""
    register(ledger)
    first = ledger.record_alarm(make_alarm(step=7, alarm_id="a-1", rank=0, node="node-0"))
    counts = row_counts(ledger.engine)
    again = ledger.record_alarm(make_alarm(step=7, alarm_id="a-1", rank=2, node="node-2"))
    assert again.duplicate
    assert again.incident_id == first.incident_id
    assert row_counts(ledger.engine) == counts


def test_suspect_nodes_outside_the_rank_map_are_evidence_never_suspects(ledger: Ledger) -> None:
    register(ledger)  # node-0 .. node-3
    ledger.record_alarm(make_alarm(suspect_nodes=["node-2", "ip-10-0-0-9", "node-77"]))
    ledger.record_alarm(make_alarm(node="rogue", suspect_nodes=["rogue"]))
    [incident] = ledger.list_incidents("job-1")
    assert incident.suspect_nodes == ["node-2"]
    assert incident.outside_rank_map == ["ip-10-0-0-9", "node-77", "rogue"]
    assert incident.needs_review
    assert [a.outside_rank_map for a in incident.alarms] == [["ip-10-0-0-9", "node-77"], ["rogue"]]


def test_an_incident_within_the_rank_map_needs_no_review(ledger: Ledger) -> None:
    register(ledger)
    ledger.record_alarm(make_alarm(suspect_nodes=["node-1"]))
    [incident] = ledger.list_incidents("job-1")
    assert (incident.suspect_nodes, incident.outside_rank_map) == (["node-1"], [])
    assert not incident.needs_review


def test_a_batch_of_resends_only_changes_nothing(ledger: Ledger) -> None:
    first = ledger.record_alarms([make_alarm(alarm_id="a-1"), make_alarm(alarm_id="a-2")])
    counts = row_counts(ledger.engine)
    again = ledger.record_alarms([make_alarm(alarm_id="a-2"), make_alarm(alarm_id="a-1")])
    assert [(o.incident_id, o.duplicate, o.opened) for o in again] == [
        (first[1].incident_id, True, False),
        (first[0].incident_id, True, False),
    ]
    assert row_counts(ledger.engine) == counts
    assert ledger.record_alarms([]) == []
    assert row_counts(ledger.engine) == counts


def test_one_invalid_alarm_refuses_the_whole_batch_and_writes_nothing(ledger: Ledger) -> None:
    counts = row_counts(ledger.engine)
    good = make_alarm(alarm_id="good")
    bad = make_alarm(alarm_id="bad", step=-1)
    with pytest.raises(InvalidValue, match=r"alarm 1 of the batch: step must be an integer >= 0"):
        ledger.record_alarms([good, bad])
    with pytest.raises(InvalidValue, match="step must be an integer >= 0"):
        Ledger.validate_alarm(bad)
    Ledger.validate_alarm(good)
    assert row_counts(ledger.engine) == counts


def test_the_start_moves_only_when_the_earliest_alarm_moves_down(ledger: Ledger) -> None:
    register(ledger)
    ledger.record_audit("job-1", 30, "loss", [0, 1], passed=True)
    incident_id = ledger.record_alarm(make_alarm(step=37)).incident_id
    # Evidence that arrives later does not narrow the range of alarms already recorded...
    ledger.record_audit("job-1", 34, "loss", [0, 1], passed=True)
    ledger.record_alarms([make_alarm(step=40), make_alarm(step=37)])
    incident = ledger.get_incident(incident_id)
    assert (incident.suspect_start, incident.suspect_end) == (31, 40)
    # ...and an earlier alarm pulls the start back to the audit before it.
    ledger.ensure_job("job-1")
    ledger.record_audit("job-1", 10, "loss", [0, 1], passed=True)
    ledger.record_alarms([make_alarm(step=44), make_alarm(step=25)])
    incident = ledger.get_incident(incident_id)
    assert (incident.suspect_start, incident.suspect_end) == (11, 44)


def test_an_alarm_pulls_a_hand_opened_range_back_to_its_audit(ledger: Ledger) -> None:
    register(ledger)
    ledger.record_audit("job-1", 20, "loss", [0, 1], passed=True)
    opened = ledger.open_incident("job-1", start=30, end=40, suspect_nodes=["node-2"])
    ledger.record_alarms([make_alarm(step=45, suspect_nodes=["node-3"])])
    incident = ledger.get_incident(opened.id)
    assert (incident.suspect_start, incident.suspect_end) == (21, 45)
    assert incident.suspect_nodes == ["node-2", "node-3"]


def test_audits_before_a_resolution_do_not_bound_the_next_incident(ledger: Ledger) -> None:
    """The resumed run repeats steps: the abandoned timeline's audits are no evidence for it."""
    register(ledger)
    ledger.record_audit("job-1", 20, "loss", [0, 1], passed=True)
    first = ledger.record_alarms([make_alarm(step=37)])[0].incident_id
    assert ledger.get_incident(first).suspect_start == 21
    ledger.transition(first, IncidentState.RESOLVED)
    outcomes = ledger.record_alarms([make_alarm(step=30), make_alarm(step=33)])
    second = ledger.get_incident(outcomes[0].incident_id)
    assert (second.suspect_start, second.suspect_end) == (0, 33)


def _count_statements(ledger: Ledger, call: Callable[[], object]) -> int:
    statements: list[str] = []

    def count(*args: object) -> None:
        statements.append(str(args[2]))

    sa.event.listen(ledger.engine, "before_cursor_execute", count)
    try:
        call()
    finally:
        sa.event.remove(ledger.engine, "before_cursor_execute", count)
    return len(statements)


def test_a_batch_costs_the_same_statements_whatever_its_size_and_its_incident_size(
    ledger: Ledger,
) -> None:
    """Set-based recording: no statement per alarm in the batch, none per alarm stored."""
    register(ledger)
    ledger.record_audit("job-1", 20, "loss", [0, 1], passed=True)  # a start above 0 to check
    ledger.record_alarm(make_alarm(step=37))
    small = _count_statements(ledger, lambda: ledger.record_alarms([make_alarm(step=38)]))
    large = _count_statements(
        ledger, lambda: ledger.record_alarms([make_alarm(step=38) for _ in range(300)])
    )
    after = _count_statements(ledger, lambda: ledger.record_alarms([make_alarm(step=38)]))
    assert small == large == after
    assert len(ledger.get_incident(ledger.list_incidents("job-1")[0].id).alarms) == 303


# ------------------------------------------------------------ batches against the rule, by property
#
# A model of the rule, independent of the ledger: one open incident per job; its range runs from
# (latest passed audit strictly before its earliest alarm) + 1 — counting ring audits only once
# the job has any, and only audits recorded since the job's last resolved incident — to its
# latest alarm; the start is recomputed only when the earliest alarm moves down and never rises.

_JOBS = 2
_Op = tuple[Any, ...]


@dataclass
class _ModelIncident:
    start: int
    end: int
    nodes: set[str]
    earliest: int | None
    ranks_missing: bool
    alarms: list[tuple[int, int]] = field(default_factory=list)  # (alarm number, step)
    state: IncidentState = IncidentState.OPEN


@dataclass
class _Model:
    audits: dict[int, list[tuple[int, str, bool, int]]] = field(
        default_factory=lambda: {j: [] for j in range(_JOBS)}
    )
    resolutions: dict[int, int] = field(default_factory=lambda: dict.fromkeys(range(_JOBS), 0))
    incidents: dict[int, list[_ModelIncident]] = field(
        default_factory=lambda: {j: [] for j in range(_JOBS)}
    )
    placed: dict[int, tuple[int, int]] = field(default_factory=dict)  # alarm → (job, incident)

    def active(self, job: int) -> _ModelIncident | None:
        live = [i for i in self.incidents[job] if not i.state.terminal]
        return live[0] if live else None

    def start_for(self, job: int, step: int) -> int:
        ring = any(kind in ("loss", "gradient") for _, kind, _, _ in self.audits[job])
        kinds = {"loss", "gradient"} if ring else {"fingerprint"}
        steps = [
            s
            for s, kind, passed, epoch in self.audits[job]
            if passed and kind in kinds and s < step and epoch == self.resolutions[job]
        ]
        return max(steps) + 1 if steps else 0

    def alarm(self, number: int, job: int, step: int, nodes: set[str]) -> tuple[Any, bool, bool]:
        if number in self.placed:
            return self.placed[number], True, False
        incident = self.active(job)
        opened = incident is None
        if incident is None:
            incident = _ModelIncident(self.start_for(job, step), step, nodes, step, job != 0)
            self.incidents[job].append(incident)
        else:
            if incident.earliest is None or step < incident.earliest:
                incident.start = min(incident.start, self.start_for(job, step))
                incident.earliest = step
            incident.end = max(incident.end, step)
            incident.nodes |= nodes
        incident.alarms.append((number, step))
        self.placed[number] = (job, self.incidents[job].index(incident))
        return self.placed[number], False, opened


# Few steps, mostly passed audits, batches and audits more often than closes and opens: so that
# audits land at, just before and just after alarm steps, and incidents both grow and turn over.
_steps = st.integers(0, 8)
_audits = st.tuples(
    st.just("audit"),
    st.integers(0, _JOBS - 1),
    _steps,
    st.sampled_from(["loss", "gradient", "fingerprint"]),
    st.sampled_from([True, True, True, False]),
)
_batches = st.tuples(
    st.just("batch"),
    st.lists(
        st.tuples(
            st.integers(0, _JOBS - 1),
            _steps,
            st.integers(0, 3),  # the reporting rank's node
            st.frozensets(st.integers(0, 3), max_size=2),  # suspect nodes
            st.integers(0, 60),  # >= alarms so far: a new alarm; else re-send that one
        ),
        min_size=1,
        max_size=8,
    ),
)
_closes = st.tuples(
    st.just("close"),
    st.integers(0, _JOBS - 1),
    st.sampled_from([IncidentState.RESOLVED, IncidentState.FAILED]),
)
_opens = st.tuples(st.just("open"), st.integers(0, _JOBS - 1), _steps, st.integers(0, 4))
_ops = st.lists(
    st.sampled_from([_batches, _batches, _batches, _audits, _audits, _closes, _opens]).flatmap(
        lambda op: op
    ),
    min_size=1,
    max_size=14,
)


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=_ops)
def test_batches_record_what_one_by_one_records_and_follow_the_range_rule(
    ledger: Ledger, ops: list[_Op]
) -> None:
    """The same history played three ways: record_alarms per batch, record_alarm per alarm, and
    the model. Each example works on jobs of its own, so every example starts from nothing."""
    run = uuid.uuid4().hex[:8]
    ways = ("batch", "single")
    jobs = {way: [f"{run}-{way}-{j}" for j in range(_JOBS)] for way in ways}
    for way in ways:
        register(ledger, jobs[way][0])  # job 0 has ranks, job 1 reports without
        ledger.ensure_job(jobs[way][1])
    model = _Model()
    alarms: list[tuple[int, int, int, frozenset[int]]] = []  # (job, step, node, suspects)
    outcomes: dict[str, list[tuple[str, bool, bool]]] = {way: [] for way in ways}
    expected: list[tuple[Any, bool, bool]] = []

    def alarm_in(way: str, number: int) -> AlarmIn:
        job, step, node, suspects = alarms[number]
        return make_alarm(
            jobs[way][job],
            step,
            alarm_id=f"{run}-{way}-{number}",
            node=f"node-{node}",
            suspect_nodes=[f"node-{n}" for n in sorted(suspects)],
        )

    for op in ops:
        if op[0] == "audit":
            _, job, step, kind, passed = op
            for way in ways:
                ledger.record_audit(jobs[way][job], step, kind, [0, 1], passed)
            model.audits[job].append((step, kind, passed, model.resolutions[job]))
        elif op[0] == "batch":
            numbers = []
            for job, step, node, suspects, resend in op[1]:
                if resend < len(alarms):
                    numbers.append(resend)
                else:
                    alarms.append((job, step, node, suspects))
                    numbers.append(len(alarms) - 1)
            batch = ledger.record_alarms([alarm_in("batch", n) for n in numbers])
            single = [ledger.record_alarm(alarm_in("single", n)) for n in numbers]
            for way, got in (("batch", batch), ("single", single)):
                outcomes[way] += [(o.incident_id, o.duplicate, o.opened) for o in got]
            for n in numbers:
                job, step, node, suspects = alarms[n]
                nodes = {f"node-{s}" for s in suspects} or {f"node-{node}"}
                expected.append(model.alarm(n, job, step, nodes))
        elif op[0] == "close":
            _, job, state = op
            if model.active(job) is None:
                continue
            for way in ways:
                live = ledger.open_incident_for(jobs[way][job])
                assert live is not None
                ledger.transition(live.id, state)
            active = model.active(job)
            assert active is not None
            active.state = state
            model.resolutions[job] += state == IncidentState.RESOLVED
        else:
            _, job, start, length = op
            if model.active(job) is not None:
                continue
            for way in ways:
                ledger.open_incident(
                    jobs[way][job], start=start, end=start + length, suspect_nodes=["node-9"]
                )
            model.incidents[job].append(
                _ModelIncident(start, start + length, {"node-9"}, None, job != 0)
            )

    for way in ways:
        # Ledger incident id → (job, n-th incident of that job), the model's name for it.
        names: dict[str, tuple[int, int]] = {}
        for job in range(_JOBS):
            newest_first = ledger.list_incidents(jobs[way][job])
            for n, incident in enumerate(reversed(newest_first)):
                names[incident.id] = (job, n)
            recorded = [
                (
                    i.state,
                    i.suspect_start,
                    i.suspect_end,
                    sorted(i.suspect_nodes),
                    i.ranks_missing,
                    sorted((int(a.alarm_id.rsplit("-", 1)[1]), a.step) for a in i.alarms),
                )
                for i in reversed(newest_first)
            ]
            want = [
                (m.state, m.start, m.end, sorted(m.nodes), m.ranks_missing, sorted(m.alarms))
                for m in model.incidents[job]
            ]
            assert recorded == want, way
        assert [(names[i], d, o) for i, d, o in outcomes[way]] == expected, way
