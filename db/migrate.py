"""Schema migrations of the ledger, driven from code (no ``alembic.ini`` at runtime).

Migrations are the only thing that creates or changes tables: :class:`db.ledger.Ledger` never
does, so a ledger pointed at an unmigrated database fails loudly
(:class:`db.errors.SchemaNotReady`) instead of silently creating a schema of its own.
Each command runs in one transaction on both SQLite and PostgreSQL: a failed migration leaves
the previous revision intact. On PostgreSQL that transaction first takes an advisory lock
(:data:`MIGRATION_LOCK_KEY`), so two replicas or jobs migrating at once run one after the other
and the second finds the schema already at head. Migrations are their own deployment step
(``sdcguard db upgrade``); ``sdcguard serve`` on PostgreSQL only checks
:func:`require_head` and refuses a schema that is not at head.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Engine
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import DBAPIError, OperationalError

from db.engine import create_engine_for
from db.errors import InvalidValue, LedgerError, LedgerUnavailable, SchemaNotReady
from db.models import Base

__all__ = [
    "MIGRATIONS_DIR",
    "MIGRATION_LOCK_KEY",
    "alembic_config",
    "current_revision",
    "downgrade",
    "head_revision",
    "require_head",
    "schema_diff",
    "upgrade",
]

_log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
# pg_advisory_xact_lock key of schema migrations ("sdcguard" in ASCII, as a 64-bit integer).
MIGRATION_LOCK_KEY = 0x7364636775617264


def alembic_config(url: str | None = None) -> Config:
    """An Alembic config pointing at the packaged migrations (for tools and autogenerate)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url is not None:
        # ConfigParser interpolates '%': URL-encoded passwords must be escaped.
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head", *, runtime_role: str | None = None) -> None:
    """Migrate the database at ``url`` up to ``revision`` (default: the newest).

    ``runtime_role`` (PostgreSQL) names the role the services connect as; revision 0003 grants
    it exactly the runtime privileges of :mod:`db.roles`.
    """
    _run(
        url,
        "upgrade",
        lambda config: command.upgrade(config, revision),
        runtime_role=runtime_role,
    )


def require_head(url: str) -> str:
    """Return the head revision if the database at ``url`` is at it; else raise.

    :class:`db.errors.SchemaNotReady` names both revisions and the command that fixes it: a
    service must not run on a schema its code does not match, nor migrate it behind the
    operator's back while another replica serves.
    """
    head = head_revision()
    current = current_revision(url)
    if current != head:
        raise SchemaNotReady(
            f"the ledger schema at {_safe(url)} is at revision {current or 'none'}, not at "
            f"head {head}: run `sdcguard db upgrade` first"
        )
    return head


def downgrade(url: str, revision: str = "base") -> None:
    """Migrate the database at ``url`` down to ``revision`` (default: no tables at all)."""
    _run(url, "downgrade", lambda config: command.downgrade(config, revision))


def head_revision() -> str:
    """The newest revision shipped with this package."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise LedgerError(f"no migrations found in {MIGRATIONS_DIR}")
    return head


def current_revision(url: str) -> str | None:
    """The revision the database at ``url`` is at; ``None`` for an unmigrated database."""
    return _with_connection(
        url,
        "current_revision",
        lambda conn: MigrationContext.configure(conn).get_current_revision(),
    )


def schema_diff(url: str) -> list[Any]:
    """Differences between the models and the live schema, as Alembic autogenerate sees them.

    Empty when the migrations and :mod:`db.models` agree; a test keeps it that way.
    """

    def compare(conn: Connection) -> list[Any]:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        return list(compare_metadata(context, Base.metadata))

    return _with_connection(url, "schema_diff", compare)


def _run(
    url: str, verb: str, action: Callable[[Config], None], *, runtime_role: str | None = None
) -> None:
    config = alembic_config(url)
    if runtime_role:
        config.attributes["runtime_role"] = runtime_role

    def work(conn: Connection) -> None:
        if conn.dialect.name == "postgresql":
            # Held to the end of this transaction: concurrent migrators queue here. DDL on a
            # large table may take longer than the runtime statement timeout.
            conn.exec_driver_sql("SET LOCAL statement_timeout = 0")
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})")
        config.attributes["connection"] = conn
        action(config)

    _with_connection(url, verb, work)
    _log.info("ledger migrated", extra={"verb": verb, "database": _safe(url)})


def _with_connection(url: str, verb: str, work: Callable[[Connection], Any]) -> Any:
    engine: Engine = create_engine_for(url)
    try:
        with engine.begin() as conn:
            return work(conn)
    except CommandError as err:
        raise InvalidValue(f"{verb}: {err}") from err
    except OperationalError as err:
        raise LedgerUnavailable(f"{verb} {_safe(url)}: {str(err.orig).strip()}") from err
    except DBAPIError as err:
        raise LedgerError(f"{verb} {_safe(url)}: {str(err.orig).strip()}") from err
    finally:
        engine.dispose()


def _safe(url: str) -> str:
    """The URL with any password hidden, for messages and logs."""
    return make_url(url).render_as_string(hide_password=True)
