"""Engine set-up: where the ledger lives by default and how SQLite is configured."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from db import DATABASE_URL_ENV, InvalidValue, Ledger, create_engine_for, default_database_url


def test_default_url_is_sqlite_under_dot_sdcguard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DATABASE_URL_ENV, raising=False)
    assert default_database_url() == "sqlite:///.sdcguard/ledger.db"


def test_environment_selects_the_database(monkeypatch: pytest.MonkeyPatch) -> None:
    url = "postgresql+psycopg://postgres@127.0.0.1:5432/sdcguard"
    monkeypatch.setenv(DATABASE_URL_ENV, url)
    assert default_database_url() == url


def test_sqlite_engine_uses_wal_foreign_keys_and_creates_its_directory(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "ledger.db"
    engine = create_engine_for(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30_000
        assert path.parent.is_dir()
    finally:
        engine.dispose()


def test_sqlite_writes_begin_immediate_and_reads_do_not(sqlite_ledger: Ledger) -> None:
    statements: list[str] = []

    def record(conn: object, cursor: object, statement: str, *args: object) -> None:
        if statement.startswith("BEGIN"):
            statements.append(statement)

    sa.event.listen(sqlite_ledger.engine, "before_cursor_execute", record)
    sqlite_ledger.ensure_job("job-1")
    sqlite_ledger.rank_map("job-1")
    assert statements == ["BEGIN IMMEDIATE", "BEGIN"]


def test_in_memory_sqlite_is_refused() -> None:
    with pytest.raises(InvalidValue, match="in-memory"):
        Ledger.from_url("sqlite://")
    with pytest.raises(InvalidValue, match="not a database URL"):
        create_engine_for("no scheme at all")


def test_ledger_from_url_creates_no_tables(tmp_path: Path) -> None:
    path = tmp_path / "fresh.db"
    with Ledger.from_url(f"sqlite:///{path}") as ledger:
        assert sa.inspect(ledger.engine).get_table_names() == []
