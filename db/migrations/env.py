"""Alembic environment of the ledger.

Configured from code (:mod:`db.migrate`), so no ``alembic.ini`` is needed at runtime. When the
caller hands over a connection (``config.attributes["connection"]``) the migration runs inside
the caller's transaction; otherwise an engine is built from ``sqlalchemy.url``. Either way the
engine comes from :func:`db.engine.create_engine_for`, so SQLite gets the same pragmas and
``BEGIN IMMEDIATE`` as the ledger, and DDL is transactional on both databases.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from db.engine import create_engine_for
from db.models import Base

config = context.config
target_metadata = Base.metadata


def _configure_and_run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_online() -> None:
    given = config.attributes.get("connection")
    if isinstance(given, Connection):
        _configure_and_run(given)
        return
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no connection and no sqlalchemy.url: run migrations via db.migrate")
    engine = create_engine_for(url)
    try:
        with engine.begin() as connection:
            _configure_and_run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    _run_offline()
else:
    _run_online()
