"""PostgreSQL privileges of the ledger: who may do what to which table.

Two roles (DESIGN "Webhook signing", docs/security.md): the *owner* that runs migrations
(``sdcguard db upgrade``) and the *runtime* role the webhook and the flow workers connect as.
Invariants held by the database, not by our code:

* the event tables (alarms, audits, action and incident history) take INSERT and SELECT from
  the runtime role and nothing more — no UPDATE, no DELETE, no TRUNCATE;
* the state tables (jobs, ranks, incidents, checkpoints, actions) take INSERT, SELECT and
  UPDATE — a state moves, it is never deleted;
* the nonce store (``request_nonces``) also takes DELETE: expired nonces are pruned;
* the runtime role owns nothing, so it cannot drop or disable the append-only triggers, and a
  ``BEFORE TRUNCATE`` trigger refuses TRUNCATE even to the owner.
"""

from __future__ import annotations

import re

from sqlalchemy.engine import Connection

__all__ = [
    "EVENT_TABLES",
    "NONCE_TABLE",
    "STATE_TABLES",
    "grant_runtime_role",
    "runtime_grants",
]

EVENT_TABLES = ("alarms", "audits", "action_events", "incident_events")
STATE_TABLES = ("jobs", "ranks", "incidents", "checkpoints", "actions")
NONCE_TABLE = "request_nonces"
_ROLE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def _checked(role: str) -> str:
    if not _ROLE.match(role):
        raise ValueError(f"runtime role {role!r} must be a lower-case SQL identifier")
    return role


def runtime_grants(role: str) -> list[str]:
    """The statements that give ``role`` exactly the runtime privileges (idempotent)."""
    name = _checked(role)
    every = (*EVENT_TABLES, *STATE_TABLES, NONCE_TABLE)
    return [
        f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{name}') "
        f"THEN CREATE ROLE {name} NOLOGIN; END IF; END $$",
        f"REVOKE ALL ON {', '.join(every)} FROM {name}",
        f"GRANT SELECT, INSERT ON {', '.join(EVENT_TABLES)} TO {name}",
        f"GRANT SELECT, INSERT, UPDATE ON {', '.join(STATE_TABLES)} TO {name}",
        f"GRANT SELECT, INSERT, DELETE ON {NONCE_TABLE} TO {name}",
        f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {name}",
        f"GRANT SELECT ON alembic_version TO {name}",  # serve checks the schema is at head
    ]


def grant_runtime_role(conn: Connection, role: str) -> None:
    """Apply :func:`runtime_grants` on ``conn`` (PostgreSQL only; the owner must run it)."""
    if conn.dialect.name != "postgresql":
        raise ValueError("runtime roles exist on PostgreSQL only")
    for statement in runtime_grants(role):
        conn.exec_driver_sql(statement)
