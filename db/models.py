"""ORM models of the ledger (SQLAlchemy 2.0 typed declarative).

These rows stay inside :mod:`db.ledger`; callers only ever see frozen views. The schema is
created by the Alembic migrations in ``db/migrations``, never by ``create_all``; a test checks
that these models and the migrations agree.

Invariants held by the database itself, not only by code:

* a job has at most one non-terminal incident (partial unique index ``uq_incidents_active_job``);
* an alarm is stored once, keyed by the id its sender gave it;
* an action is stored once per idempotency key;
* ``action_events`` and ``incident_events`` are append-only (triggers refuse UPDATE and DELETE).
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Generic, TypeVar

from sqlalchemy import (
    JSON,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from db.enums import (
    TERMINAL_STATES,
    ActionStatus,
    AuditKind,
    CheckpointEvidence,
    CheckpointStatus,
    IncidentState,
    Verdict,
)

__all__ = [
    "ACTIVE_INCIDENT_WHERE",
    "ActionEventRow",
    "ActionRow",
    "AlarmRow",
    "AuditRow",
    "Base",
    "CheckpointRow",
    "IncidentEventRow",
    "IncidentRow",
    "JobRow",
    "RankRow",
    "RequestNonceRow",
]

_E = TypeVar("_E", bound=StrEnum)

_NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# The partial-index predicate: the same SQL text on SQLite and PostgreSQL.
ACTIVE_INCIDENT_WHERE = "state NOT IN ({})".format(
    ", ".join(f"'{state.value}'" for state in sorted(TERMINAL_STATES))
)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend.

    SQLite has no time zone type, so values are stored as naive UTC there and given their
    zone back on load; a naive value handed in is taken to be UTC already.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        aware = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        return aware.replace(tzinfo=None) if dialect.name == "sqlite" else aware

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class EnumText(TypeDecorator[_E], Generic[_E]):
    """A ``StrEnum`` stored as its plain string value (portable; no native enum types)."""

    impl = String(32)
    cache_ok = True

    def __init__(self, enum_cls: type[_E]) -> None:
        super().__init__(32)
        self.enum_cls = enum_cls

    def process_bind_param(self, value: _E | str | None, dialect: Dialect) -> str | None:
        return None if value is None else self.enum_cls(value).value

    def process_result_value(self, value: str | None, dialect: Dialect) -> _E | None:
        return None if value is None else self.enum_cls(value)


def _in(column: str, enum_cls: type[StrEnum]) -> str:
    return "{} IN ({})".format(column, ", ".join(f"'{member.value}'" for member in enum_cls))


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=_NAMING)


class JobRow(Base):
    """A training job, known from its first rank registration or alarm."""

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # Generation of the rank map last applied: an older registration never overwrites it.
    ranks_generation: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class RankRow(Base):
    """Where one rank of a job runs; re-registration moves it (e.g. after a node replacement)."""

    __tablename__ = "ranks"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    local_rank: Mapped[int] = mapped_column(Integer)
    node: Mapped[str] = mapped_column(String(255))
    instance_id: Mapped[str | None] = mapped_column(String(255))
    gpu_uuid: Mapped[str | None] = mapped_column(String(255))
    first_seen: Mapped[datetime] = mapped_column(UTCDateTime())
    last_seen: Mapped[datetime] = mapped_column(UTCDateTime())


class IncidentRow(Base):
    """One SDC incident of a job, from first alarm to its terminal state."""

    __tablename__ = "incidents"
    __table_args__ = (
        Index(
            "uq_incidents_active_job",
            "job_id",
            unique=True,
            sqlite_where=text(ACTIVE_INCIDENT_WHERE),
            postgresql_where=text(ACTIVE_INCIDENT_WHERE),
        ),
        CheckConstraint(_in("state", IncidentState), name="state"),
        CheckConstraint("suspect_start >= 0 AND suspect_start <= suspect_end", name="range"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    state: Mapped[IncidentState] = mapped_column(EnumText(IncidentState))
    suspect_start: Mapped[int] = mapped_column(Integer)
    suspect_end: Mapped[int] = mapped_column(Integer)
    suspect_nodes: Mapped[list[str]] = mapped_column(JSON)
    verdict: Mapped[Verdict | None] = mapped_column(EnumText(Verdict))
    evidence: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    approver: Mapped[str | None] = mapped_column(String(255))
    approval_reason: Mapped[str | None] = mapped_column(Text)
    decision: Mapped[str | None] = mapped_column(String(64))
    decided_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    reason: Mapped[str | None] = mapped_column(Text)
    ranks_missing: Mapped[bool] = mapped_column(Boolean)
    storm: Mapped[bool] = mapped_column(Boolean)
    storm_reason: Mapped[str | None] = mapped_column(Text)
    # Nodes alarms named that are not in the job's rank map: evidence, never acted on.
    outside_rank_map: Mapped[list[str]] = mapped_column(
        JSON, default=list, server_default=text("'[]'")
    )
    opened_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())
    closed_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class IncidentEventRow(Base):
    """Append-only history of an incident: one row per state change or recorded decision."""

    __tablename__ = "incident_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    incident_id: Mapped[str] = mapped_column(ForeignKey("incidents.id"), index=True)
    from_state: Mapped[IncidentState | None] = mapped_column(EnumText(IncidentState))
    to_state: Mapped[IncidentState] = mapped_column(EnumText(IncidentState))
    reason: Mapped[str | None] = mapped_column(Text)
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    at: Mapped[datetime] = mapped_column(UTCDateTime())


class AlarmRow(Base):
    """One alarm as its sender reported it; the sender's id makes re-sends harmless."""

    __tablename__ = "alarms"
    __table_args__ = (Index(None, "job_id", "step"),)

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    incident_id: Mapped[str] = mapped_column(ForeignKey("incidents.id"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    node: Mapped[str] = mapped_column(String(255))
    layer: Mapped[str] = mapped_column(String(64))
    phase: Mapped[str] = mapped_column(String(64))
    suspect_ranks: Mapped[list[int]] = mapped_column(JSON)
    suspect_nodes: Mapped[list[str]] = mapped_column(JSON)
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)
    sent_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    received_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # The suspect nodes of this alarm that were not in the job's rank map when it arrived.
    outside_rank_map: Mapped[list[str]] = mapped_column(
        JSON, default=list, server_default=text("'[]'")
    )


class CheckpointRow(Base):
    """A checkpoint and its provenance; see :class:`db.enums.CheckpointStatus`."""

    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("job_id", "step", "uri", "sha256"),
        Index(None, "job_id", "status", "step"),
        CheckConstraint(_in("status", CheckpointStatus), name="status"),
        CheckConstraint(
            "evidence IS NULL OR " + _in("evidence", CheckpointEvidence), name="evidence"
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    step: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str] = mapped_column(String(1024))
    sha256: Mapped[str] = mapped_column(String(64))
    fingerprint: Mapped[str] = mapped_column(String(64))
    nodes: Mapped[list[str]] = mapped_column(JSON)
    status: Mapped[CheckpointStatus] = mapped_column(EnumText(CheckpointStatus))
    evidence: Mapped[CheckpointEvidence | None] = mapped_column(EnumText(CheckpointEvidence))
    audited_through: Mapped[int | None] = mapped_column(Integer)
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class AuditRow(Base):
    """The outcome of one audit (ring re-execution or fingerprint vote) at one step."""

    __tablename__ = "audits"
    __table_args__ = (
        Index(None, "job_id", "step"),
        CheckConstraint(_in("kind", AuditKind), name="kind"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    step: Mapped[int] = mapped_column(Integer)
    kind: Mapped[AuditKind] = mapped_column(EnumText(AuditKind))
    ranks: Mapped[list[int]] = mapped_column(JSON)
    passed: Mapped[bool] = mapped_column(Boolean)
    at: Mapped[datetime] = mapped_column(UTCDateTime())


class ActionRow(Base):
    """Current state of one idempotent recovery action (cordon, replace, resume, …)."""

    __tablename__ = "actions"
    __table_args__ = (CheckConstraint(_in("status", ActionStatus), name="status"),)

    key: Mapped[str] = mapped_column(String(512), primary_key=True)
    incident_id: Mapped[str] = mapped_column(ForeignKey("incidents.id"), index=True)
    kind: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(255))
    status: Mapped[ActionStatus] = mapped_column(EnumText(ActionStatus))
    attempts: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    owner: Mapped[str | None] = mapped_column(String(255))
    """The flow run holding the claim (revision 0002); None before it."""
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    """Until when the owner holds it; another run may take it over only after."""


class ActionEventRow(Base):
    """Append-only audit trail: one row per claim and per finish, never updated."""

    __tablename__ = "action_events"
    __table_args__ = (CheckConstraint(_in("status", ActionStatus), name="status"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    action_key: Mapped[str] = mapped_column(ForeignKey("actions.key"), index=True)
    incident_id: Mapped[str] = mapped_column(ForeignKey("incidents.id"), index=True)
    status: Mapped[ActionStatus] = mapped_column(EnumText(ActionStatus))
    attempt: Mapped[int] = mapped_column(Integer)
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    at: Mapped[datetime] = mapped_column(UTCDateTime())


class RequestNonceRow(Base):
    """A signed request's nonce, kept for twice the signing window: a second use is a replay.

    Shared by every webhook replica through the ledger; rows older than the window are
    deleted as new ones arrive, so the table stays as small as one window's traffic.
    """

    __tablename__ = "request_nonces"

    nonce: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_id: Mapped[str] = mapped_column(String(255))
    seen_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
