"""Engines for the ledger: SQLite for one machine, PostgreSQL for a fleet.

SQLite is configured so that several processes (webhook, flow workers, CLI) can share one file
safely: write-ahead logging (readers never block the writer), ``synchronous=FULL`` (an
acknowledged alarm is on disk), a busy timeout instead of instant
"database is locked" errors, foreign keys on, and ``BEGIN IMMEDIATE`` for write transactions so
that two writers serialise at BEGIN instead of deadlocking on a read-to-write lock upgrade.
Read-only work runs on :func:`read_only` engines, which begin a plain deferred transaction.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import ArgumentError

from db.errors import InvalidValue

__all__ = [
    "DATABASE_URL_ENV",
    "DEFAULT_DATABASE_URL",
    "create_engine_for",
    "default_database_url",
    "read_only",
]

DATABASE_URL_ENV = "SDCGUARD_DATABASE_URL"
DEFAULT_DATABASE_URL = "sqlite:///.sdcguard/ledger.db"

# Seconds a SQLite writer waits for the lock before giving up; long enough for a burst of
# alarms from every rank of a job, short enough that a stuck writer surfaces as an error.
SQLITE_BUSY_TIMEOUT_S = 30.0
# PostgreSQL: no statement may run, nor wait for a lock, without bound. A stuck lock then
# surfaces as a temporary error (the sender retries) instead of freezing ingestion.
POSTGRES_STATEMENT_TIMEOUT_MS = 30_000
POSTGRES_LOCK_TIMEOUT_MS = 10_000
_READ_ONLY_OPTION = "sdcguard_read_only"


def default_database_url() -> str:
    """The ledger URL when none is given: ``$SDCGUARD_DATABASE_URL``, else SQLite in ``.sdcguard/``.

    Only a fallback: the settings layer passes explicit URLs.
    """
    return os.environ.get(DATABASE_URL_ENV) or DEFAULT_DATABASE_URL


def create_engine_for(url: str | URL, **kwargs: Any) -> Engine:
    """An engine configured for the ledger's transaction model on SQLite or PostgreSQL.

    For a SQLite file the parent directory is created. In-memory SQLite is refused: each
    connection would see its own empty database, so migrations and concurrent callers would
    silently disagree. Extra ``kwargs`` go to :func:`sqlalchemy.create_engine`.
    """
    try:
        parsed = make_url(url)
    except ArgumentError as err:
        raise InvalidValue(f"not a database URL: {url!r}") from err
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed, **kwargs)
    if parsed.get_backend_name() == "postgresql":
        options: dict[str, Any] = {"pool_pre_ping": True, "pool_size": 10, "max_overflow": 20}
        connect_args: dict[str, Any] = {
            "options": f"-c statement_timeout={POSTGRES_STATEMENT_TIMEOUT_MS} "
            f"-c lock_timeout={POSTGRES_LOCK_TIMEOUT_MS}",
            # No server-side prepared statements: psycopg prepares a query after five runs, and
            # the ledger's IN-lists then ran on a plan made while the table was small (alarm-id
            # look-ups 7 ms instead of 1 ms in a storm); it also keeps PgBouncer's transaction
            # pooling safe.
            "prepare_threshold": None,
        }
        connect_args.update(kwargs.pop("connect_args", {}))
        options["connect_args"] = connect_args
        options.update(kwargs)
        return create_engine(parsed, **options)
    return create_engine(parsed, **kwargs)


def read_only(engine: Engine) -> Engine:
    """The same engine, but its transactions begin deferred on SQLite (readers do not queue).

    On other databases it is the engine itself: their readers never take the write lock.
    """
    if engine.dialect.name != "sqlite":
        return engine
    return engine.execution_options(**{_READ_ONLY_OPTION: True})


def _sqlite_engine(url: URL, **kwargs: Any) -> Engine:
    database = url.database or ""
    if database in ("", ":memory:") or "mode=memory" in str(url):
        raise InvalidValue(
            "in-memory SQLite cannot hold the ledger: each connection sees its own database; "
            "use a file, e.g. sqlite:///.sdcguard/ledger.db"
        )
    if not database.startswith("file:"):
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    connect_args: dict[str, Any] = {"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False}
    connect_args.update(kwargs.pop("connect_args", {}))
    engine = create_engine(url, connect_args=connect_args, **kwargs)
    event.listen(engine, "connect", _sqlite_on_connect)
    event.listen(engine, "begin", _sqlite_on_begin)
    return engine


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # Take BEGIN away from the driver (its legacy mode never begins for SELECT or DDL, which
    # breaks isolation); _sqlite_on_begin emits it instead.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        # FULL: an alarm acknowledged with 202 survives a power loss, not only a crash.
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
    finally:
        cursor.close()


def _sqlite_on_begin(connection: Connection) -> None:
    if connection.get_execution_options().get(_READ_ONLY_OPTION):
        connection.exec_driver_sql("BEGIN")
    else:
        connection.exec_driver_sql("BEGIN IMMEDIATE")
