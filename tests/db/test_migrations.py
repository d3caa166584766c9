"""Migrations own the schema: up from nothing, down to nothing, and in step with the models."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from db import (
    Ledger,
    SchemaNotReady,
    current_revision,
    downgrade,
    head_revision,
    schema_diff,
    upgrade,
)
from db.models import Base


def _tables(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


LEDGER_TABLES = {table.name for table in Base.metadata.sorted_tables}


def test_upgrade_from_empty_to_head_and_back_to_base(empty_database_url: str) -> None:
    url = empty_database_url
    upgrade(url)
    assert current_revision(url) == head_revision() == "0002"
    assert _tables(url) == LEDGER_TABLES | {"alembic_version"}
    upgrade(url)  # at head already: a no-op
    downgrade(url)
    assert current_revision(url) is None
    assert _tables(url) == {"alembic_version"}
    upgrade(url)  # and up again: downgrade left nothing behind that gets in the way
    assert current_revision(url) == "0002"


def test_models_and_migrations_agree(empty_database_url: str) -> None:
    upgrade(empty_database_url)
    assert schema_diff(empty_database_url) == []


def test_the_agreement_check_sees_a_difference(empty_database_url: str) -> None:
    upgrade(empty_database_url)
    engine = sa.create_engine(empty_database_url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP INDEX ix_audits_job_id_step")
    finally:
        engine.dispose()
    diff = schema_diff(empty_database_url)
    assert [entry[0] for entry in diff] == ["add_index"]
    assert diff[0][1].name == "ix_audits_job_id_step"


def test_the_ledger_never_creates_tables(empty_database_url: str) -> None:
    with (
        Ledger.from_url(empty_database_url) as ledger,
        pytest.raises(SchemaNotReady, match=r"db\.migrate\.upgrade"),
    ):
        ledger.ensure_job("job-1")
    assert _tables(empty_database_url) <= {"alembic_version"}
    assert not (_tables(empty_database_url) & LEDGER_TABLES)


def test_one_open_incident_per_job_is_enforced_by_the_database(ledger: Ledger) -> None:
    """Even a writer that bypasses the ledger cannot open a second live incident."""
    ledger.ensure_job("job-1")
    insert = (
        "INSERT INTO incidents (id, job_id, state, suspect_start, suspect_end, suspect_nodes,"
        " ranks_missing, storm, opened_at, updated_at)"
        " VALUES ('{id}', 'job-1', '{state}', 0, 1, '[]', false, false,"
        " '2025-01-01 00:00:00', '2025-01-01 00:00:00')"
    )
    with ledger.engine.begin() as conn:
        conn.exec_driver_sql(insert.format(id="i-resolved-1", state="resolved"))
        conn.exec_driver_sql(insert.format(id="i-resolved-2", state="resolved"))
        conn.exec_driver_sql(insert.format(id="i-open", state="diagnosing"))
    with pytest.raises(sa.exc.IntegrityError), ledger.engine.begin() as conn:
        conn.exec_driver_sql(insert.format(id="i-open-2", state="open"))
