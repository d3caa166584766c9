"""What goes into the ledger and what comes out of it: frozen dataclasses, never ORM rows.

A view is a snapshot taken inside the transaction that produced it; holding one never keeps a
session, a connection or a lock alive. ``to_dict()`` gives JSON-safe data (ISO 8601 datetimes,
enum values as strings) for the webhook and the CLI.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime
from enum import Enum
from typing import Any

from db.enums import (
    ActionStatus,
    CheckpointEvidence,
    CheckpointStatus,
    IncidentState,
    Verdict,
)

__all__ = [
    "STAGE_KIND",
    "ActionClaim",
    "ActionEventView",
    "ActionView",
    "AlarmIn",
    "AlarmOutcome",
    "AlarmView",
    "CheckpointView",
    "IncidentEventView",
    "IncidentView",
    "RankIn",
    "RankView",
    "action_key",
]

STAGE_KIND = "stage"
"""The action kind of an incident flow's stage: its target is the stage's name."""


def action_key(incident_id: str, kind: str, target: str) -> str:
    """The idempotency key of an incident's action: one row per (incident, kind, target)."""
    return f"{incident_id}:{kind}:{target}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


class _View:
    def to_dict(self) -> dict[str, Any]:
        """JSON-safe copy: datetimes as ISO 8601, enums as their string value."""
        result = _jsonable(self)
        assert isinstance(result, dict)
        return result


@dataclasses.dataclass(frozen=True)
class RankIn:
    """One rank of a job as it registers itself."""

    rank: int
    local_rank: int
    node: str
    instance_id: str | None = None
    gpu_uuid: str | None = None


@dataclasses.dataclass(frozen=True)
class AlarmIn:
    """One alarm as the webhook received it (DESIGN: ``POST /v1/alarms``).

    ``layer`` and ``phase`` are kept as the sender's strings: the ledger records what was
    reported and does not depend on the detection package's enums.
    """

    alarm_id: str
    job_id: str
    step: int
    rank: int
    node: str
    layer: str
    phase: str
    suspect_ranks: Sequence[int]
    suspect_nodes: Sequence[str]
    detail: dict[str, Any]
    sent_at: datetime | None


@dataclasses.dataclass(frozen=True)
class AlarmOutcome(_View):
    """Where an alarm landed. ``opened`` is true only for the call that opened the incident,
    so exactly one webhook request starts the incident flow."""

    incident_id: str
    duplicate: bool
    opened: bool


@dataclasses.dataclass(frozen=True)
class RankView(_View):
    job_id: str
    rank: int
    local_rank: int
    node: str
    instance_id: str | None
    gpu_uuid: str | None
    first_seen: datetime
    last_seen: datetime


@dataclasses.dataclass(frozen=True)
class AlarmView(_View):
    alarm_id: str
    job_id: str
    incident_id: str
    step: int
    rank: int
    node: str
    layer: str
    phase: str
    suspect_ranks: list[int]
    suspect_nodes: list[str]
    detail: dict[str, Any]
    sent_at: datetime | None
    received_at: datetime
    outside_rank_map: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class CheckpointView(_View):
    """A checkpoint and its provenance.

    ``evidence`` names what verified it (``ring-audit`` or the weaker ``fingerprint-vote``),
    ``audited_through`` the step of that audit, ``reason`` why it was quarantined or corrupt.
    """

    job_id: str
    step: int
    uri: str
    sha256: str
    fingerprint: str
    nodes: list[str]
    status: CheckpointStatus
    evidence: CheckpointEvidence | None
    audited_through: int | None
    reason: str | None


@dataclasses.dataclass(frozen=True)
class ActionView(_View):
    key: str
    incident_id: str
    kind: str
    target: str
    status: ActionStatus
    attempts: int
    started_at: datetime
    finished_at: datetime | None
    detail: dict[str, Any] | None
    owner: str | None = None
    lease_expires_at: datetime | None = None


@dataclasses.dataclass(frozen=True)
class ActionEventView(_View):
    """One row of the append-only action trail: a claim (``status`` claimed) or a finish."""

    id: int
    action_key: str
    incident_id: str
    status: ActionStatus
    attempt: int
    detail: dict[str, Any] | None
    at: datetime


@dataclasses.dataclass(frozen=True)
class ActionClaim(_View):
    """``won`` is true for exactly one caller per attempt; only the winner acts."""

    won: bool
    action: ActionView


@dataclasses.dataclass(frozen=True)
class IncidentEventView(_View):
    """One row of an incident's append-only history."""

    from_state: IncidentState | None
    to_state: IncidentState
    reason: str | None
    detail: dict[str, Any] | None
    at: datetime


@dataclasses.dataclass(frozen=True)
class IncidentView(_View):
    """An incident with its alarms (oldest step first) and actions (in claim order).

    ``suspect_start``/``suspect_end`` bound the steps whose results are not trusted;
    ``ranks_missing`` says the job had registered no ranks when the incident opened, so
    nodes could only be taken from the alarms themselves. ``outside_rank_map`` lists nodes
    that alarms named but the job's rank map does not hold: recorded as evidence, never in
    ``suspect_nodes``, never cordoned automatically (``needs_review`` is true while any exist).
    """

    id: str
    job_id: str
    state: IncidentState
    suspect_start: int
    suspect_end: int
    suspect_nodes: list[str]
    verdict: Verdict | None
    evidence: dict[str, Any] | None
    approver: str | None
    approval_reason: str | None
    decision: str | None
    ranks_missing: bool
    storm: bool
    opened_at: datetime
    updated_at: datetime
    alarms: list[AlarmView]
    actions: list[ActionView]
    decided_at: datetime | None = None
    storm_reason: str | None = None
    reason: str | None = None
    closed_at: datetime | None = None
    history: list[IncidentEventView] = dataclasses.field(default_factory=list)
    outside_rank_map: list[str] = dataclasses.field(default_factory=list)

    @property
    def needs_review(self) -> bool:
        """Alarms named nodes outside the job: a human decides, no automatic containment."""
        return bool(self.outside_rank_map)
