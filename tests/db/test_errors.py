"""Bad input gets a typed error with a clear message, and leaves no row behind."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from db import (
    AlarmIn,
    IncidentConflict,
    InvalidRange,
    InvalidValue,
    Ledger,
    LedgerError,
    RankIn,
    UnknownIncident,
    UnknownJob,
)
from tests.db.support import FP, SHA_A, make_alarm, register, row_counts


def _case(name: str, call: Callable[[Ledger], Any], error: type[LedgerError], message: str) -> Any:
    return pytest.param(call, error, message, id=name)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        _case(
            "checkpoint-unknown-job",
            lambda lg: lg.record_checkpoint("ghost", 10, "s3://ckpts/c.pt", SHA_A, FP, []),
            UnknownJob,
            "unknown job 'ghost'",
        ),
        _case(
            "audit-unknown-job",
            lambda lg: lg.record_audit("ghost", 10, "loss", [0], True),
            UnknownJob,
            "unknown job 'ghost'",
        ),
        _case(
            "quarantine-unknown-job",
            lambda lg: lg.quarantine_range("ghost", 0, 5),
            UnknownJob,
            "unknown job 'ghost'",
        ),
        _case(
            "corrupt-unknown-job",
            lambda lg: lg.mark_checkpoint_corrupt("ghost", 5, "x"),
            UnknownJob,
            "unknown job 'ghost'",
        ),
        _case(
            "incident-unknown-job",
            lambda lg: lg.open_incident("ghost", start=0, end=5, suspect_nodes=[]),
            UnknownJob,
            "unknown job 'ghost'",
        ),
        _case(
            "quarantine-start-after-end",
            lambda lg: lg.quarantine_range("job-1", 20, 10),
            InvalidRange,
            r"\[20, 10\]",
        ),
        _case(
            "quarantine-negative-start",
            lambda lg: lg.quarantine_range("job-1", -1, None),
            InvalidValue,
            "start must be an integer >= 0",
        ),
        _case(
            "incident-start-after-end",
            lambda lg: lg.open_incident("job-1", start=9, end=3, suspect_nodes=[]),
            InvalidRange,
            r"\[9, 3\]",
        ),
        _case(
            "audit-unknown-kind",
            lambda lg: lg.record_audit("job-1", 10, "vibes", [0], True),
            InvalidValue,
            "kind must be one of loss, gradient, fingerprint",
        ),
        _case(
            "audit-negative-step",
            lambda lg: lg.record_audit("job-1", -3, "loss", [0], True),
            InvalidValue,
            "step must be an integer >= 0",
        ),
        _case(
            "checkpoint-empty-uri",
            lambda lg: lg.record_checkpoint("job-1", 1, "", SHA_A, FP, []),
            InvalidValue,
            "uri must be a non-empty string",
        ),
        _case(
            "ranks-duplicate",
            lambda lg: lg.register_ranks("new-job", [RankIn(0, 0, "n0"), RankIn(0, 1, "n1")]),
            InvalidValue,
            "rank 0 is listed twice",
        ),
        _case(
            "ranks-empty-job",
            lambda lg: lg.register_ranks("", [RankIn(0, 0, "n0")]),
            InvalidValue,
            "job_id must be a non-empty string",
        ),
        _case(
            "alarm-negative-step",
            lambda lg: lg.record_alarm(make_alarm("new-job", step=-1)),
            InvalidValue,
            "step must be an integer >= 0",
        ),
        _case(
            "alarm-detail-not-json",
            lambda lg: lg.record_alarm(make_alarm("new-job", detail={"t": {1, 2}})),
            InvalidValue,
            "detail is not JSON-serialisable",
        ),
        _case(
            "unknown-incident",
            lambda lg: lg.get_incident("nope"),
            UnknownIncident,
            "unknown incident 'nope'",
        ),
        _case(
            "actions-unknown-incident",
            lambda lg: lg.actions("nope"),
            UnknownIncident,
            "unknown incident 'nope'",
        ),
    ],
)
def test_bad_input_raises_a_typed_error_and_writes_nothing(
    ledger: Ledger, call: Callable[[Ledger], Any], error: type[LedgerError], message: str
) -> None:
    register(ledger)
    counts = row_counts(ledger.engine)
    with pytest.raises(error, match=message):
        call(ledger)
    assert issubclass(error, LedgerError)
    assert row_counts(ledger.engine) == counts


def test_a_second_open_incident_is_a_conflict(ledger: Ledger) -> None:
    register(ledger)
    first = ledger.open_incident("job-1", start=30, end=40, suspect_nodes=["node-2"])
    assert (first.suspect_start, first.suspect_end, first.suspect_nodes) == (30, 40, ["node-2"])
    counts = row_counts(ledger.engine)
    with pytest.raises(IncidentConflict, match=first.id):
        ledger.open_incident("job-1", start=0, end=1, suspect_nodes=[])
    assert row_counts(ledger.engine) == counts
    # Alarms attach to the open incident instead of conflicting with it.
    outcome = ledger.record_alarm(make_alarm(step=45))
    assert (outcome.incident_id, outcome.opened) == (first.id, False)
    assert ledger.get_incident(first.id).suspect_end == 45


def test_a_failure_late_in_a_transaction_rolls_all_of_it_back(
    ledger: Ledger, database_backend: str
) -> None:
    """The database refuses the incident row after the job row was already inserted: the job
    must not survive. The refusal comes from a trigger, i.e. from the database itself."""
    with _refusing_incident_inserts(ledger, database_backend):
        counts = row_counts(ledger.engine)
        with pytest.raises(LedgerError, match="no incidents today"):
            ledger.record_alarm(make_alarm("brand-new-job"))
        assert row_counts(ledger.engine) == counts
    assert ledger.rank_map("brand-new-job") == {}
    assert ledger.record_alarm(make_alarm("brand-new-job")).opened is True


@contextmanager
def _refusing_incident_inserts(ledger: Ledger, backend: str) -> Iterator[None]:
    with ledger.engine.begin() as conn:
        if backend == "sqlite":
            conn.exec_driver_sql(
                "CREATE TRIGGER refuse_incidents BEFORE INSERT ON incidents "
                "BEGIN SELECT RAISE(ABORT, 'no incidents today'); END"
            )
        else:
            conn.exec_driver_sql(
                "CREATE FUNCTION refuse_incidents() RETURNS trigger LANGUAGE plpgsql AS $$ "
                "BEGIN RAISE EXCEPTION 'no incidents today'; END; $$"
            )
            conn.exec_driver_sql(
                "CREATE TRIGGER refuse_incidents BEFORE INSERT ON incidents "
                "FOR EACH ROW EXECUTE FUNCTION refuse_incidents()"
            )
    try:
        yield
    finally:
        with ledger.engine.begin() as conn:
            if backend == "sqlite":
                conn.exec_driver_sql("DROP TRIGGER refuse_incidents")
            else:
                conn.exec_driver_sql("DROP TRIGGER refuse_incidents ON incidents")
                conn.exec_driver_sql("DROP FUNCTION refuse_incidents()")


def test_alarm_input_is_checked_before_anything_is_written(ledger: Ledger) -> None:
    counts = row_counts(ledger.engine)
    bad = AlarmIn("", "job-x", 1, 0, "node-0", "audit", "loss", [], [], {}, None)
    with pytest.raises(InvalidValue, match="alarm_id"):
        ledger.record_alarm(bad)
    assert row_counts(ledger.engine) == counts
