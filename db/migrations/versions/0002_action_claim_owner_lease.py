"""Action claims get an owner and a lease.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01

``actions.owner`` names the flow run that holds a claim and ``actions.lease_expires_at`` until
when: another run may take a claim over only after that instant (``db.ledger.actions``). Both are
nullable: rows claimed before this revision have no owner, and any run may continue them.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("actions") as batch:
        batch.add_column(sa.Column("owner", sa.String(255), nullable=True))
        batch.add_column(sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("actions") as batch:
        batch.drop_column("lease_expires_at")
        batch.drop_column("owner")
