"""Initial ledger schema: jobs, ranks, incidents, alarms, checkpoints, audits, actions.

Revision ID: 0001
Revises:
Create Date: 2025-01-01

Besides the tables this creates what the models cannot express portably: triggers that make
``action_events`` and ``incident_events`` append-only (UPDATE and DELETE are refused).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TZ = sa.DateTime(timezone=True)
_ACTIVE = "state NOT IN ('expired', 'failed', 'rejected', 'resolved')"
_STATES = (
    "'open', 'stopping', 'cordoned', 'diagnosing', 'awaiting_approval', 'replacing', "
    "'resuming', 'resolved', 'rejected', 'expired', 'failed'"
)
_ACTION_STATUSES = "'claimed', 'succeeded', 'failed'"
_APPEND_ONLY = ("action_events", "incident_events")


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(255), nullable=False),
        sa.Column("created_at", _TZ, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
    )
    op.create_table(
        "ranks",
        sa.Column("job_id", sa.String(255), nullable=False),
        sa.Column("rank", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("local_rank", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("instance_id", sa.String(255), nullable=True),
        sa.Column("gpu_uuid", sa.String(255), nullable=True),
        sa.Column("first_seen", _TZ, nullable=False),
        sa.Column("last_seen", _TZ, nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_ranks_job_id_jobs"),
        sa.PrimaryKeyConstraint("job_id", "rank", name="pk_ranks"),
    )
    op.create_table(
        "incidents",
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("job_id", sa.String(255), nullable=False),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("suspect_start", sa.Integer(), nullable=False),
        sa.Column("suspect_end", sa.Integer(), nullable=False),
        sa.Column("suspect_nodes", sa.JSON(), nullable=False),
        sa.Column("verdict", sa.String(32), nullable=True),
        sa.Column("evidence", sa.JSON(), nullable=True),
        sa.Column("approver", sa.String(255), nullable=True),
        sa.Column("approval_reason", sa.Text(), nullable=True),
        sa.Column("decision", sa.String(64), nullable=True),
        sa.Column("decided_at", _TZ, nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("ranks_missing", sa.Boolean(), nullable=False),
        sa.Column("storm", sa.Boolean(), nullable=False),
        sa.Column("storm_reason", sa.Text(), nullable=True),
        sa.Column("opened_at", _TZ, nullable=False),
        sa.Column("updated_at", _TZ, nullable=False),
        sa.Column("closed_at", _TZ, nullable=True),
        sa.CheckConstraint(f"state IN ({_STATES})", name="ck_incidents_state"),
        sa.CheckConstraint(
            "suspect_start >= 0 AND suspect_start <= suspect_end", name="ck_incidents_range"
        ),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_incidents_job_id_jobs"),
        sa.PrimaryKeyConstraint("id", name="pk_incidents"),
    )
    op.create_index("ix_incidents_job_id", "incidents", ["job_id"])
    op.create_index(
        "uq_incidents_active_job",
        "incidents",
        ["job_id"],
        unique=True,
        sqlite_where=sa.text(_ACTIVE),
        postgresql_where=sa.text(_ACTIVE),
    )
    op.create_table(
        "incident_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("incident_id", sa.String(36), nullable=False),
        sa.Column("from_state", sa.String(32), nullable=True),
        sa.Column("to_state", sa.String(32), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("detail", sa.JSON(), nullable=True),
        sa.Column("at", _TZ, nullable=False),
        sa.ForeignKeyConstraint(
            ["incident_id"], ["incidents.id"], name="fk_incident_events_incident_id_incidents"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_incident_events"),
    )
    op.create_index("ix_incident_events_incident_id", "incident_events", ["incident_id"])
    op.create_table(
        "alarms",
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("job_id", sa.String(255), nullable=False),
        sa.Column("incident_id", sa.String(36), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("layer", sa.String(64), nullable=False),
        sa.Column("phase", sa.String(64), nullable=False),
        sa.Column("suspect_ranks", sa.JSON(), nullable=False),
        sa.Column("suspect_nodes", sa.JSON(), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.Column("sent_at", _TZ, nullable=True),
        sa.Column("received_at", _TZ, nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_alarms_job_id_jobs"),
        sa.ForeignKeyConstraint(
            ["incident_id"], ["incidents.id"], name="fk_alarms_incident_id_incidents"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_alarms"),
    )
    op.create_index("ix_alarms_job_id_step", "alarms", ["job_id", "step"])
    op.create_index("ix_alarms_incident_id", "alarms", ["incident_id"])
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(255), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("uri", sa.String(1024), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("nodes", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("evidence", sa.String(32), nullable=True),
        sa.Column("audited_through", sa.Integer(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("created_at", _TZ, nullable=False),
        sa.Column("updated_at", _TZ, nullable=False),
        sa.CheckConstraint(
            "status IN ('pending', 'verified', 'quarantined', 'corrupt')",
            name="ck_checkpoints_status",
        ),
        sa.CheckConstraint(
            "evidence IS NULL OR evidence IN ('ring-audit', 'fingerprint-vote')",
            name="ck_checkpoints_evidence",
        ),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_checkpoints_job_id_jobs"),
        sa.PrimaryKeyConstraint("id", name="pk_checkpoints"),
        sa.UniqueConstraint(
            "job_id", "step", "uri", "sha256", name="uq_checkpoints_job_id_step_uri_sha256"
        ),
    )
    op.create_index(
        "ix_checkpoints_job_id_status_step", "checkpoints", ["job_id", "status", "step"]
    )
    op.create_table(
        "audits",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(255), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("ranks", sa.JSON(), nullable=False),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("at", _TZ, nullable=False),
        sa.CheckConstraint("kind IN ('loss', 'gradient', 'fingerprint')", name="ck_audits_kind"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_audits_job_id_jobs"),
        sa.PrimaryKeyConstraint("id", name="pk_audits"),
    )
    op.create_index("ix_audits_job_id_step", "audits", ["job_id", "step"])
    op.create_table(
        "actions",
        sa.Column("key", sa.String(512), nullable=False),
        sa.Column("incident_id", sa.String(36), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("target", sa.String(255), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", _TZ, nullable=False),
        sa.Column("started_at", _TZ, nullable=False),
        sa.Column("finished_at", _TZ, nullable=True),
        sa.Column("detail", sa.JSON(), nullable=True),
        sa.CheckConstraint(f"status IN ({_ACTION_STATUSES})", name="ck_actions_status"),
        sa.ForeignKeyConstraint(
            ["incident_id"], ["incidents.id"], name="fk_actions_incident_id_incidents"
        ),
        sa.PrimaryKeyConstraint("key", name="pk_actions"),
    )
    op.create_index("ix_actions_incident_id", "actions", ["incident_id"])
    op.create_table(
        "action_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("action_key", sa.String(512), nullable=False),
        sa.Column("incident_id", sa.String(36), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=True),
        sa.Column("at", _TZ, nullable=False),
        sa.CheckConstraint(f"status IN ({_ACTION_STATUSES})", name="ck_action_events_status"),
        sa.ForeignKeyConstraint(
            ["action_key"], ["actions.key"], name="fk_action_events_action_key_actions"
        ),
        sa.ForeignKeyConstraint(
            ["incident_id"], ["incidents.id"], name="fk_action_events_incident_id_incidents"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_action_events"),
    )
    op.create_index("ix_action_events_action_key", "action_events", ["action_key"])
    op.create_index("ix_action_events_incident_id", "action_events", ["incident_id"])
    _create_append_only_triggers()


def downgrade() -> None:
    _drop_append_only_triggers()
    op.drop_index("ix_action_events_incident_id", table_name="action_events")
    op.drop_index("ix_action_events_action_key", table_name="action_events")
    op.drop_table("action_events")
    op.drop_index("ix_actions_incident_id", table_name="actions")
    op.drop_table("actions")
    op.drop_index("ix_audits_job_id_step", table_name="audits")
    op.drop_table("audits")
    op.drop_index("ix_checkpoints_job_id_status_step", table_name="checkpoints")
    op.drop_table("checkpoints")
    op.drop_index("ix_alarms_incident_id", table_name="alarms")
    op.drop_index("ix_alarms_job_id_step", table_name="alarms")
    op.drop_table("alarms")
    op.drop_index("ix_incident_events_incident_id", table_name="incident_events")
    op.drop_table("incident_events")
    op.drop_index("uq_incidents_active_job", table_name="incidents")
    op.drop_index("ix_incidents_job_id", table_name="incidents")
    op.drop_table("incidents")
    op.drop_table("ranks")
    op.drop_table("jobs")


def _create_append_only_triggers() -> None:
    if op.get_context().dialect.name == "postgresql":
        op.execute(
            "CREATE FUNCTION sdcguard_append_only() RETURNS trigger LANGUAGE plpgsql AS $$ "
            "BEGIN RAISE EXCEPTION '% is append-only', TG_TABLE_NAME; END; $$"
        )
        for table in _APPEND_ONLY:
            op.execute(
                f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION sdcguard_append_only()"
            )
        return
    for table in _APPEND_ONLY:
        for verb in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER {table}_append_only_{verb.lower()} BEFORE {verb} ON {table} "
                f"BEGIN SELECT RAISE(ABORT, '{table} is append-only'); END"
            )


def _drop_append_only_triggers() -> None:
    if op.get_context().dialect.name == "postgresql":
        for table in _APPEND_ONLY:
            op.execute(f"DROP TRIGGER {table}_append_only ON {table}")
        op.execute("DROP FUNCTION sdcguard_append_only()")
        return
    for table in _APPEND_ONLY:
        for verb in ("update", "delete"):
            op.execute(f"DROP TRIGGER {table}_append_only_{verb}")
