"""The checkpoint gate's vocabulary: what the guard tells it, what it records, how it refuses.

The guard's modules need :class:`StepOutcome` (their decision of a step) and the guard's state
needs :func:`state_path` (where it lies beside a checkpoint) without the gate itself; this module
holds those, the record and its status, the refusals and the checkpoints' file names, so the
gate's provenance (:mod:`detection.gate.provenance`) and its writes
(:mod:`detection.gate.checkpoint`) share one definition of each. Invariant: it does no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from detection.audit.ring import AuditMode
from detection.transport.alarm import Alarm
from detection.weights.fingerprint import Fingerprint

__all__ = [
    "CheckpointNotVerifiedError",
    "CheckpointRecord",
    "CheckpointStatus",
    "GateClosedError",
    "GateError",
    "ProvenanceSink",
    "StepOutcome",
    "checkpoint_path",
    "sharded_checkpoint_path",
    "state_path",
]


class CheckpointStatus(StrEnum):
    PENDING = "pending"
    VERIFIED = "verified"
    QUARANTINED = "quarantined"


class GateError(RuntimeError):
    """The gate was used against its contract (see the subclasses for the refusals)."""


class GateClosedError(GateError):
    """An alarm is open: nothing is published as verified until recovery."""

    def __init__(self, alarm: Alarm) -> None:
        super().__init__(
            f"checkpoint gate closed by the {alarm.layer}/{alarm.phase} alarm at step "
            f"{alarm.step}: nothing is published as verified until recovery"
        )
        self.alarm = alarm


class CheckpointNotVerifiedError(GateError):
    """The requested checkpoint has no evidence (pending) or is quarantined."""


class ProvenanceSink(Protocol):
    """Where provenance goes (the alarm sender on rank 0)."""

    def record_checkpoint(self, body: dict[str, Any]) -> Any: ...

    def record_audit(self, body: dict[str, Any]) -> Any: ...


@dataclass(frozen=True)
class StepOutcome:
    """What the guard decided at the end of one step, identically on every rank.

    ``fingerprint`` is this rank's weight fingerprint after the step (what it would write).
    ``audit`` is the ring-audit mode if an audit ran this step.
    """

    step: int
    ranks: tuple[int, ...]
    fingerprint: Fingerprint
    vote_passed: bool
    audit: AuditMode | None = None
    audit_passed: bool = False
    alarm: Alarm | None = None


@dataclass(frozen=True)
class CheckpointRecord:
    step: int
    uri: str
    sha256: str
    fingerprint: str
    status: CheckpointStatus
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def to_report(self) -> dict[str, Any]:
        """The DESIGN report entry."""
        return {
            "step": self.step,
            "uri": self.uri,
            "sha256": self.sha256,
            "fingerprint": self.fingerprint,
            "status": str(self.status),
        }


def checkpoint_path(directory: Path, step: int) -> Path:
    """``<dir>/ckpt-<step:06d>.pt`` — the state after step ``step``."""
    return directory / f"ckpt-{step:06d}.pt"


def sharded_checkpoint_path(directory: Path, step: int) -> Path:
    """``<dir>/ckpt-<step:06d>/`` — the sharded checkpoint (a directory sealed by its
    ``manifest.json``, :mod:`detection.weights.sharded_checkpoint`) of the state after ``step``."""
    return directory / f"ckpt-{step:06d}"


def state_path(checkpoint: Path | str) -> Path:
    """Where the guard's state of a checkpoint file lies (:mod:`detection.guard.state`): beside
    it, ``ckpt-000120.pt`` → ``ckpt-000120.sdcguard.pt``; a sharded checkpoint's directory
    ``ckpt-000120/`` → ``ckpt-000120.sdcguard.pt`` too."""
    path = Path(checkpoint)
    return path.with_name(path.stem + _GUARD_STATE_SUFFIX)


_GUARD_STATE_SUFFIX = ".sdcguard.pt"
