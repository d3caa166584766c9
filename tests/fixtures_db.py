"""Ledger fixtures shared by every test area (registered in ``tests/conftest.py``).

``database_url`` and ``ledger`` run each test on both databases the ledger supports: a SQLite
file (a fresh copy of a template migrated once per session) and PostgreSQL (one database per
test session, migrated once, emptied before each test, dropped at the end). Tests that do not
care about the backend use ``sqlite_database_url`` / ``sqlite_ledger``; migration tests use
``empty_database_url`` (no tables at all).

PostgreSQL is found at ``$SDCGUARD_TEST_POSTGRES_URL`` (an admin URL, default the local server).
If it cannot be reached its tests are skipped with the reason — unless
``SDCGUARD_REQUIRE_POSTGRES=1`` (CI), where that is a failure.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from db import Ledger, upgrade
from db.models import Base

__all__ = [
    "POSTGRES_URL_ENV",
    "REQUIRE_POSTGRES_ENV",
    "PostgresServer",
    "database_backend",
    "database_url",
    "empty_database_url",
    "ledger",
    "postgres_server",
    "sqlite_database_url",
    "sqlite_ledger",
]

POSTGRES_URL_ENV = "SDCGUARD_TEST_POSTGRES_URL"
REQUIRE_POSTGRES_ENV = "SDCGUARD_REQUIRE_POSTGRES"
_DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
_LEDGER_TABLES = ", ".join(table.name for table in Base.metadata.sorted_tables)


@dataclass(frozen=True)
class PostgresServer:
    """The PostgreSQL server the tests may create and drop databases on."""

    admin_url: URL

    def url_for(self, database: str) -> str:
        return self.admin_url.set(database=database).render_as_string(hide_password=False)

    def create_database(self, prefix: str = "sdcguard_test") -> str:
        """A new empty database with a unique name; returns its URL.

        Its commits do not wait for the WAL to reach the disk (``synchronous_commit = off``):
        a test database's durability across a server crash is not under test, and the suite
        commits thousands of times, each a flush on a disk the whole host shares. Every
        transaction stays atomic and isolated; only the last ones before a crash could be lost.
        """
        name = f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"
        self._admin(f'CREATE DATABASE "{name}"')
        self._admin(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
        return self.url_for(name)

    def drop_database(self, url: str) -> None:
        name = make_url(url).database
        self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def _admin(self, statement: str) -> None:
        engine = sa.create_engine(self.admin_url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.exec_driver_sql(statement)
        finally:
            engine.dispose()


@pytest.fixture(scope="session")
def postgres_server() -> PostgresServer:
    """The reachable PostgreSQL server; skips (or fails, in CI) when there is none."""
    admin_url = make_url(os.environ.get(POSTGRES_URL_ENV) or _DEFAULT_POSTGRES_URL)
    engine = sa.create_engine(admin_url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except (sa.exc.OperationalError, ModuleNotFoundError) as err:
        shown = admin_url.render_as_string(hide_password=True)
        message = f"PostgreSQL not reachable at {shown} (set {POSTGRES_URL_ENV}): {err}"
        if os.environ.get(REQUIRE_POSTGRES_ENV) == "1":
            pytest.fail(f"{REQUIRE_POSTGRES_ENV}=1 but {message}")
        pytest.skip(message)
    finally:
        engine.dispose()
    return PostgresServer(admin_url)


@pytest.fixture(scope="session")
def _sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ledger-template") / "ledger.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def _postgres_session_url(postgres_server: PostgresServer) -> Iterator[str]:
    url = postgres_server.create_database()
    try:
        upgrade(url)
        yield url
    finally:
        postgres_server.drop_database(url)


@pytest.fixture(
    scope="session", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def database_backend(request: pytest.FixtureRequest) -> str:
    """``sqlite`` or ``postgres``: every test that uses the ledger runs on both."""
    backend: str = request.param
    if backend == "postgres":
        request.getfixturevalue("postgres_server")
    return backend


@pytest.fixture
def database_url(database_backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """URL of a migrated ledger database with empty tables, private to this test."""
    if database_backend == "sqlite":
        path = tmp_path / "ledger.db"
        shutil.copyfile(request.getfixturevalue("_sqlite_template"), path)
        return f"sqlite:///{path}"
    url: str = request.getfixturevalue("_postgres_session_url")
    _empty_postgres_tables(url)
    return url


@pytest.fixture
def ledger(database_url: str) -> Iterator[Ledger]:
    """A :class:`db.Ledger` on ``database_url``; its connections close after the test."""
    with Ledger.from_url(database_url) as instance:
        yield instance


@pytest.fixture
def empty_database_url(
    database_backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[str]:
    """URL of a database with no tables at all (for migration tests)."""
    if database_backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty' / 'ledger.db'}"
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    url = server.create_database(prefix="sdcguard_empty")
    try:
        yield url
    finally:
        server.drop_database(url)


@pytest.fixture
def sqlite_database_url(_sqlite_template: Path, tmp_path: Path) -> str:
    """A migrated, empty SQLite ledger file, for tests that need no PostgreSQL run."""
    path = tmp_path / "ledger.db"
    shutil.copyfile(_sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.fixture
def sqlite_ledger(sqlite_database_url: str) -> Iterator[Ledger]:
    with Ledger.from_url(sqlite_database_url) as instance:
        yield instance


def _empty_postgres_tables(url: str) -> None:
    # TRUNCATE fires no row triggers, so the append-only tables can be emptied too; the ledger's
    # BEFORE TRUNCATE triggers are skipped by this admin session only (replica role).
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("SET LOCAL lock_timeout = '10s'")
            conn.exec_driver_sql("SET LOCAL session_replication_role = replica")
            conn.exec_driver_sql(f"TRUNCATE {_LEDGER_TABLES} RESTART IDENTITY")
    finally:
        engine.dispose()
