"""Request and response models of the webhook API, and the error responses it documents.

Invariant: a body that passes these models is one the ledger can store. Bounds follow the
ledger's columns (32-bit integers, 255-character strings), so a valid-looking request is
refused here with a 422 naming the field instead of failing in the database with a 500.
Unknown fields are ignored, so a newer sender never loses an alarm to a 422.

Size limits (DESIGN "Webhook API"), so one request cannot make the ledger or a stage do
unbounded work: an alarm names at most :data:`MAX_SUSPECT_NODES` suspect nodes and
:data:`MAX_SUSPECT_RANKS` suspect ranks, its ``detail`` holds at most :data:`MAX_DETAIL_KEYS`
keys and :data:`MAX_DETAIL_BYTES` bytes of JSON; a registration, a checkpoint's nodes and an
audit's ranks at most :data:`MAX_RANKS` entries.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    StrictBool,
    StringConstraints,
    model_validator,
)

from db import AuditKind
from detection.external.alarm import TOKEN_PATTERN
from detection.transport.alarm import Layer, Phase

__all__ = [
    "LEDGER_ERRORS",
    "MAX_DETAIL_BYTES",
    "MAX_DETAIL_KEYS",
    "MAX_RANKS",
    "MAX_SUSPECT_NODES",
    "MAX_SUSPECT_RANKS",
    "READ_ERRORS",
    "SIGNED_ERRORS",
    "AlarmAccepted",
    "AlarmBody",
    "AuditBody",
    "AuditRecorded",
    "CheckpointBody",
    "ErrorBody",
    "ExternalAlarmBody",
    "IncidentId",
    "JobId",
    "NodeName",
    "RankEntry",
    "RankNumber",
    "RanksBody",
    "RanksRegistered",
    "Rfc3339",
    "Step",
    "Token",
    "TriggerQueued",
]

# Columns of the ledger are 32-bit integers and 255-character strings; bounds here keep a
# valid-looking request from reaching the database only to fail there with a 500.
_MAX_INT = 2**31 - 1
MAX_SUSPECT_NODES = 256
MAX_SUSPECT_RANKS = 1024
MAX_DETAIL_KEYS = 64
MAX_DETAIL_BYTES = 16 * 1024
MAX_RANKS = 16_384
_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:@+=-]*$"

JobId = Annotated[
    str,
    StringConstraints(strict=True, min_length=1, max_length=255, pattern=_ID_PATTERN),
    Field(description="Job id: letters, digits and _.:@+=-, starting with a letter or digit."),
]
NodeName = Annotated[
    str,
    StringConstraints(strict=True, min_length=1, max_length=255, pattern=_ID_PATTERN),
    Field(description="Node name as the orchestrator knows it (e.g. a Kubernetes node name)."),
]
IncidentId = Annotated[
    str,
    StringConstraints(strict=True, min_length=1, max_length=64, pattern=_ID_PATTERN),
    Field(description="Incident id, as POST /v1/alarms returned it."),
]
Step = Annotated[int, Field(strict=True, ge=0, le=_MAX_INT, description="Training step, from 0.")]
RankNumber = Annotated[int, Field(strict=True, ge=0, le=_MAX_INT)]
Token = Annotated[
    str,
    StringConstraints(strict=True, min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$"),
]


def _rfc3339_text(value: object) -> object:
    """``sent_at`` must be RFC 3339 *text*: pydantic alone would also take a unix number."""
    if not isinstance(value, str):
        raise ValueError("must be an RFC 3339 date-time string, e.g. 2025-01-31T12:00:00Z")
    return value


def _in_utc(value: datetime) -> datetime:
    """Normalise to UTC here, where an overflow is a 422, not a 500 inside the ledger.

    ``9999-12-31T23:59:59-01:00`` is valid RFC 3339 but lies past year 9999 in UTC.
    """
    try:
        return value.astimezone(UTC)
    except OverflowError as err:
        raise ValueError("date-time is out of range once converted to UTC") from err


Rfc3339 = Annotated[
    AwareDatetime,
    BeforeValidator(_rfc3339_text),
    AfterValidator(_in_utc),
    Field(description="RFC 3339 date-time with a time zone, e.g. 2025-01-31T12:00:00Z."),
]


class _Body(BaseModel):
    """Request bodies ignore unknown fields: a newer sender must never lose an alarm to a 422."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class AlarmBody(_Body):
    """DESIGN ``POST /v1/alarms``."""

    alarm_id: uuid.UUID = Field(description="Sender-chosen uuid; re-sends are recorded once.")
    job_id: JobId
    step: Step = Field(description="The step whose computation was found wrong.")
    rank: RankNumber = Field(description="The rank that reports the alarm.")
    node: NodeName = Field(description="The reporting rank's node.")
    layer: Layer
    phase: Phase
    suspect_ranks: list[RankNumber] = Field(max_length=MAX_SUSPECT_RANKS)
    suspect_nodes: list[NodeName] = Field(max_length=MAX_SUSPECT_NODES)
    detail: dict[str, JsonValue] = Field(
        default_factory=dict,
        max_length=MAX_DETAIL_KEYS,
        description=f"Evidence; at most {MAX_DETAIL_KEYS} keys and {MAX_DETAIL_BYTES} bytes.",
    )
    sent_at: Rfc3339

    @model_validator(mode="after")
    def _detail_size(self) -> AlarmBody:
        _detail_bytes(self.detail, "detail")
        return self


def _detail_bytes(detail: dict[str, JsonValue], name: str) -> None:
    size = len(json.dumps(detail, separators=(",", ":")).encode())
    if size > MAX_DETAIL_BYTES:
        raise ValueError(f"{name} is {size} bytes of JSON, over {MAX_DETAIL_BYTES}")


DetectorToken = Annotated[
    str, StringConstraints(strict=True, min_length=1, max_length=64, pattern=TOKEN_PATTERN)
]


class ExternalAlarmBody(_Body):
    """``POST /v1/external-alarms``: an alarm from another SDC detector (docs/DESIGN.md)."""

    alarm_id: uuid.UUID = Field(description="Sender-chosen uuid; re-sends are recorded once.")
    job_id: JobId
    source: DetectorToken = Field(
        description="The detector: megatron, torchtitan, health, or another detector's name."
    )
    kind: DetectorToken = Field(
        description="What it saw, in its own words (exit-16, sdc-replay-mismatch, xid-79, …)."
    )
    node: NodeName | None = Field(
        default=None, description="The node accused; without it, the rank's node in the job's map."
    )
    rank: RankNumber | None = Field(default=None, description="The rank accused, if known.")
    step: Step | None = Field(
        default=None, description="The step found wrong; absent if unknown (recorded as 0)."
    )
    evidence: dict[str, JsonValue] = Field(
        default_factory=dict,
        max_length=MAX_DETAIL_KEYS,
        description=f"What the detector reported; at most {MAX_DETAIL_KEYS} keys and "
        f"{MAX_DETAIL_BYTES} bytes.",
    )
    sent_at: Rfc3339

    @model_validator(mode="after")
    def _names_someone(self) -> ExternalAlarmBody:
        if self.node is None and self.rank is None:
            raise ValueError("an external alarm names a node or a rank (or both)")
        _detail_bytes(self.evidence, "evidence")
        return self


class AlarmAccepted(BaseModel):
    incident_id: str
    duplicate: bool = Field(description="True when this alarm_id was already recorded.")


class RankEntry(_Body):
    rank: RankNumber
    local_rank: RankNumber
    node: NodeName
    instance_id: Token | None = None
    gpu_uuid: Token | None = None


class RanksBody(_Body):
    """DESIGN ``POST /v1/jobs/{job_id}/ranks``; each rank appears once."""

    ranks: list[RankEntry] = Field(min_length=1, max_length=MAX_RANKS)
    generation: Annotated[int, Field(strict=True, ge=0, le=2**62)] = Field(
        default=0,
        description=(
            "Increases with each placement of the job (e.g. its start time in ms); a "
            "registration older than the job's current generation is refused with 409."
        ),
    )

    @model_validator(mode="after")
    def _unique_ranks(self) -> RanksBody:
        seen: set[int] = set()
        for entry in self.ranks:
            if entry.rank in seen:
                raise ValueError(f"rank {entry.rank} is listed twice")
            seen.add(entry.rank)
        return self


class RanksRegistered(BaseModel):
    job_id: str
    registered: int


class CheckpointBody(_Body):
    """DESIGN ``POST /v1/jobs/{job_id}/checkpoints``."""

    step: Step
    uri: Annotated[
        str,
        StringConstraints(strict=True, min_length=1, max_length=1024, pattern=r"^[^\x00-\x1f]+$"),
    ]
    sha256: Annotated[str, StringConstraints(strict=True, pattern=r"^[0-9a-f]{64}$")]
    fingerprint: Annotated[str, StringConstraints(strict=True, pattern=r"^[0-9a-f]{32}$")]
    nodes: list[NodeName] = Field(max_length=MAX_RANKS)
    status: Literal["pending", "quarantined"] = Field(
        default="pending",
        description="`quarantined`: the job's checkpoint gate closed on an alarm and holds "
        "this checkpoint quarantined (sent again for a checkpoint first posted pending).",
    )


class AuditBody(_Body):
    """DESIGN ``POST /v1/jobs/{job_id}/audits``."""

    step: Step
    kind: AuditKind
    ranks: list[RankNumber] = Field(max_length=MAX_RANKS)
    passed: StrictBool


class AuditRecorded(BaseModel):
    job_id: str
    step: int
    verified_steps: list[int] = Field(description="Checkpoint steps this audit verified.")


class TriggerQueued(BaseModel):
    incident_id: str
    queued: bool = Field(description="False when the incident's flow is being started right now.")


class ErrorBody(BaseModel):
    detail: str


SIGNED_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "Body is not JSON (or not UTF-8)."},
    401: {
        "model": ErrorBody,
        "description": "Unsigned, forged, stale or replayed request; nothing written.",
    },
    403: {"model": ErrorBody, "description": "The key may not write for this job."},
    413: {"model": ErrorBody, "description": "Body over the size limit."},
    415: {"model": ErrorBody, "description": "Body is not application/json."},
    503: {"model": ErrorBody, "description": "Ledger unavailable or not migrated; retry later."},
}
READ_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Not authenticated."},
    403: {"model": ErrorBody, "description": "Not a reader, or not of this job."},
    429: {"model": ErrorBody, "description": "Over the read budget; retry after Retry-After."},
    422: {"description": "Invalid query (limit, cursor, job id, state)."},
    503: {"model": ErrorBody, "description": "Ledger unavailable; retry later."},
}
LEDGER_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody, "description": "Unknown job or incident."},
    409: {"model": ErrorBody, "description": "Conflicts with the ledger's state."},
    503: {"model": ErrorBody, "description": "Ledger unavailable or not migrated; retry later."},
}
