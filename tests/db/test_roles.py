"""The runtime role on the real PostgreSQL: INSERT and SELECT on the event tables, nothing more.

Each test makes its own database and its own roles (unique names: roles are cluster-global)
and drops all of them after.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from db import Ledger, SchemaNotReady, current_revision, head_revision, upgrade
from db.migrate import require_head
from db.roles import EVENT_TABLES, STATE_TABLES
from tests.db.support import make_alarm, register
from tests.fixtures_db import PostgresServer


@dataclass(frozen=True)
class Roles:
    owner_url: str
    runtime_url: str
    group: str


@pytest.fixture
def roles(postgres_server: PostgresServer) -> Iterator[Roles]:
    suffix = secrets.token_hex(4)
    group, login = f"sdcguard_rt_{suffix}", f"sdcguard_app_{suffix}"
    url = postgres_server.create_database("sdcguard_roles")
    admin = sa.create_engine(postgres_server.admin_url, isolation_level="AUTOCOMMIT")
    try:
        upgrade(url, runtime_role=group)
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE ROLE {login} LOGIN IN ROLE {group}")
        runtime = make_url(url).set(username=login).render_as_string(hide_password=False)
        yield Roles(url, runtime, group)
    finally:
        postgres_server.drop_database(url)
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP ROLE IF EXISTS {login}")
            conn.exec_driver_sql(f"DROP ROLE IF EXISTS {group}")
        admin.dispose()


def _refused(url: str, statement: str) -> str:
    engine = sa.create_engine(url)
    try:
        with pytest.raises(DBAPIError) as caught, engine.begin() as conn:
            conn.exec_driver_sql(statement)
        return str(caught.value.orig)
    finally:
        engine.dispose()


def test_the_runtime_role_runs_the_ledger(roles: Roles) -> None:
    with Ledger.from_url(roles.runtime_url) as ledger:
        register(ledger)
        outcome = ledger.record_alarm(make_alarm())
        assert ledger.get_incident(outcome.incident_id).alarms
        assert ledger.claim_nonces([("n" * 20, "k")], keep=timedelta(days=1)) == [True]


@pytest.mark.parametrize("table", EVENT_TABLES)
def test_the_runtime_role_cannot_change_or_empty_an_event_table(roles: Roles, table: str) -> None:
    with Ledger.from_url(roles.runtime_url) as ledger:
        register(ledger)
        ledger.record_alarm(make_alarm())
    column = {"alarms": "step", "audits": "step"}.get(table, "id")
    assert "permission denied" in _refused(roles.runtime_url, f"UPDATE {table} SET {column} = 1")
    assert "permission denied" in _refused(roles.runtime_url, f"DELETE FROM {table}")
    assert "permission denied" in _refused(roles.runtime_url, f"TRUNCATE {table}")


@pytest.mark.parametrize("table", STATE_TABLES)
def test_the_runtime_role_cannot_delete_state(roles: Roles, table: str) -> None:
    assert "permission denied" in _refused(roles.runtime_url, f"DELETE FROM {table}")


def test_the_runtime_role_cannot_drop_or_disable_a_trigger(roles: Roles) -> None:
    for statement in (
        "DROP TRIGGER action_events_append_only ON action_events",
        "ALTER TABLE incident_events DISABLE TRIGGER incident_events_append_only",
        "DROP TRIGGER alarms_no_truncate ON alarms",
        "DROP FUNCTION sdcguard_append_only() CASCADE",
    ):
        assert "must be owner" in _refused(roles.runtime_url, statement)


def test_truncate_is_refused_even_to_the_owner(roles: Roles) -> None:
    for table in ("alarms", "incident_events", "jobs"):
        assert "may not be truncated" in _refused(roles.owner_url, f"TRUNCATE {table} CASCADE")


def test_serve_check_refuses_a_schema_not_at_head(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database("sdcguard_head")
    try:
        with pytest.raises(SchemaNotReady, match="sdcguard db upgrade"):
            require_head(url)
        upgrade(url, "0001")
        with pytest.raises(SchemaNotReady, match="revision 0001"):
            require_head(url)
        upgrade(url)
        assert require_head(url) == head_revision()
    finally:
        postgres_server.drop_database(url)


def test_concurrent_upgrades_queue_on_the_advisory_lock(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database("sdcguard_lock")
    errors: list[BaseException] = []

    def run() -> None:
        try:
            upgrade(url)
        except BaseException as err:
            errors.append(err)

    try:
        threads = [threading.Thread(target=run) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert errors == []
        assert current_revision(url) == head_revision()
    finally:
        postgres_server.drop_database(url)
