"""Security: replay store, rank-map flags, registration generations, privileges, no TRUNCATE.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

* ``request_nonces``: nonces of signed requests, so a replay inside the window is refused by
  every replica alike;
* ``jobs.ranks_generation``: an older rank registration never overwrites a newer one;
* ``alarms.outside_rank_map`` / ``incidents.outside_rank_map``: suspect nodes an alarm named
  that the job's rank map does not hold — evidence, never acted on automatically;
* PostgreSQL: a ``BEFORE TRUNCATE`` trigger on every ledger table (TRUNCATE fires no row
  triggers, so it would bypass the append-only ones), and, when a runtime role is named
  (``sdcguard db upgrade --runtime-role``, or ``SDCGUARD_DATABASE_RUNTIME_ROLE``), its GRANTs
  (:mod:`db.roles`): INSERT/SELECT on the event tables and nothing more.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from db.roles import EVENT_TABLES, NONCE_TABLE, STATE_TABLES, grant_runtime_role

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TZ = sa.DateTime(timezone=True)
_ALL_TABLES = (*EVENT_TABLES, *STATE_TABLES, NONCE_TABLE)
RUNTIME_ROLE_ENV = "SDCGUARD_DATABASE_RUNTIME_ROLE"


def upgrade() -> None:
    op.create_table(
        "request_nonces",
        sa.Column("nonce", sa.String(64), nullable=False),
        sa.Column("key_id", sa.String(255), nullable=False),
        sa.Column("seen_at", _TZ, nullable=False),
        sa.PrimaryKeyConstraint("nonce", name="pk_request_nonces"),
    )
    op.create_index("ix_request_nonces_seen_at", "request_nonces", ["seen_at"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(
            sa.Column("ranks_generation", sa.Integer(), nullable=False, server_default="0")
        )
    for table in ("alarms", "incidents"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(
                sa.Column(
                    "outside_rank_map", sa.JSON(), nullable=False, server_default=sa.text("'[]'")
                )
            )
    context = op.get_context()
    if context.dialect.name != "postgresql":
        return
    op.execute(
        "CREATE FUNCTION sdcguard_no_truncate() RETURNS trigger LANGUAGE plpgsql AS $$ "
        "BEGIN RAISE EXCEPTION '% may not be truncated', TG_TABLE_NAME; END; $$"
    )
    for table in _ALL_TABLES:
        op.execute(
            f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
            "FOR EACH STATEMENT EXECUTE FUNCTION sdcguard_no_truncate()"
        )
    role = context.config.attributes.get("runtime_role") if context.config else None
    role = role or os.environ.get(RUNTIME_ROLE_ENV)
    if role:
        grant_runtime_role(op.get_bind(), str(role))


def downgrade() -> None:
    if op.get_context().dialect.name == "postgresql":
        for table in _ALL_TABLES:
            op.execute(f"DROP TRIGGER {table}_no_truncate ON {table}")
        op.execute("DROP FUNCTION sdcguard_no_truncate()")
    for table in ("incidents", "alarms"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("outside_rank_map")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("ranks_generation")
    op.drop_index("ix_request_nonces_seen_at", table_name="request_nonces")
    op.drop_table("request_nonces")
