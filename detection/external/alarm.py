"""An alarm from another SDC detector: who raised it, on which job, node or rank, and why.

Other detectors see what sdcguard's own layers see, from the outside: Megatron-Core's rerun
state machine ends a job with exit code 16 (rerun elsewhere to disambiguate) or 17 (validation
failed), torchtitan's SDC replay raises ``SDCReplayMismatch``, and the GPU's driver reports an
Xid or a pending GPU Recovery Action. Each becomes one :class:`ExternalAlarm`, posted to
``POST /v1/external-alarms`` (signed like every write) and recorded in the ledger under its own
layer, :data:`EXTERNAL_LAYER`.

Invariants: an external alarm names a node or a rank (the webhook resolves a rank alone through
the job's rank map), never neither — nobody is accused by an alarm that accuses no one. Its id
is derived from what identifies the event, so the same event reported twice (a rank re-run, a
scheduler restarting a job that exits 17 again at the same step, a re-sent spool) is recorded
once. It is weaker evidence than sdcguard's own vote or audit: the incident flow never approves
on it alone (``flows/incident/policy.py``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

from detection.transport.alarm import rfc3339_now

__all__ = ["EXTERNAL_LAYER", "TOKEN_PATTERN", "ExternalAlarm", "InvalidExternalAlarm", "Source"]

EXTERNAL_LAYER: Final = "external"
"""The ledger's ``layer`` of every external alarm; its ``phase`` is the alarm's source."""

TOKEN_PATTERN: Final = r"^[a-z0-9][a-z0-9._-]{0,63}$"
"""What a source or a kind may be: lower-case words, so a ledger query can match them."""
_TOKEN: Final = re.compile(TOKEN_PATTERN)

# uuid5 namespace of external alarm ids (not the one of sdcguard's own alarms: the two never
# name one event).
_NAMESPACE: Final = uuid.UUID("0f6c2a9e-8d3b-4a57-b1e4-52c7d9a3e610")


class Source(StrEnum):
    """The detectors sdcguard ships adapters for; another detector names itself (a token)."""

    MEGATRON = "megatron"
    TORCHTITAN = "torchtitan"
    HEALTH = "health"


class InvalidExternalAlarm(ValueError):
    """The alarm cannot be sent as it is: it names no one, or a field is malformed."""


@dataclass(frozen=True)
class ExternalAlarm:
    """One event another detector saw.

    ``step`` is the step the detector found wrong, ``None`` where it does not know one (a
    hardware event); ``occurrence`` tells apart two events that are otherwise identical (e.g.
    the kernel log's timestamp of an Xid), and is empty where a repeat is the same event.
    """

    job_id: str
    source: str
    kind: str
    node: str | None = None
    rank: int | None = None
    step: int | None = None
    evidence: Mapping[str, Any] = field(default_factory=dict)
    occurrence: str = ""

    def __post_init__(self) -> None:
        if not self.job_id:
            raise InvalidExternalAlarm("job_id must not be empty")
        for name in ("source", "kind"):
            if not _TOKEN.match(getattr(self, name)):
                raise InvalidExternalAlarm(f"{name} must match {TOKEN_PATTERN}")
        if not self.node and self.rank is None:
            raise InvalidExternalAlarm("an external alarm names a node or a rank")
        for name in ("rank", "step"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 0):
                raise InvalidExternalAlarm(f"{name} must be an integer >= 0, not {value!r}")
        try:
            json.dumps(dict(self.evidence), allow_nan=False)
        except (TypeError, ValueError) as err:
            raise InvalidExternalAlarm(f"evidence is not JSON: {err}") from err

    @property
    def alarm_id(self) -> str:
        """A uuid5 of everything the alarm says (job, source, kind, node, rank, step, evidence,
        occurrence), never of when it was sent: the same event gives the same id whoever sends
        it and however often, and the ledger records it once; one id never carries two
        contents (the ledger refuses that as a conflict)."""
        key = json.dumps(
            [
                self.job_id,
                self.source,
                self.kind,
                self.node,
                self.rank,
                self.step,
                dict(self.evidence),
                self.occurrence,
            ],
            separators=(",", ":"),
            sort_keys=True,
        )
        return str(uuid.uuid5(_NAMESPACE, key))

    def to_webhook(self) -> dict[str, Any]:
        """The ``POST /v1/external-alarms`` body (docs/DESIGN.md, "External alarms")."""
        body: dict[str, Any] = {
            "alarm_id": self.alarm_id,
            "job_id": self.job_id,
            "source": self.source,
            "kind": self.kind,
            "evidence": dict(self.evidence),
            "sent_at": rfc3339_now(),
        }
        for name in ("node", "rank", "step"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        return body
