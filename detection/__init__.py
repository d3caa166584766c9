"""sdcguard detection: runs inside every training rank (torch, httpx and the stdlib only).

The few lines a training script adds are :class:`SDCGuard` and :class:`GuardConfig`
(see ``docs/detection.md``). ``AlarmSender`` and ``RankIdentity`` are imported on first use,
so ``import detection`` stays light and needs no HTTP client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from detection.alarm import Alarm, Layer, Phase
from detection.audit import AuditMode, ring_order, ring_partners, step_seed
from detection.faults import (
    FaultInjectionError,
    FaultInjector,
    FaultKind,
    FaultSpec,
    FaultSpecError,
)
from detection.fingerprint import (
    Fingerprint,
    fingerprint_from_tensor,
    fingerprint_on_device,
    weight_fingerprint,
)
from detection.gate import (
    CheckpointGate,
    CheckpointNotVerifiedError,
    CheckpointRecord,
    CheckpointStatus,
    GateClosedError,
    GateError,
    StepOutcome,
)
from detection.gradstats import StatsConfig, StatsConfigError
from detection.guard import (
    GuardConfig,
    GuardConfigError,
    GuardError,
    GuardHaltedError,
    GuardUsageError,
    SDCGuard,
)
from detection.vote import LoadVerificationError, VoteVerdict, majority_vote, verify_after_load

if TYPE_CHECKING:
    from detection.identity import RankIdentity
    from detection.sender import AlarmSender

__all__ = [
    "Alarm",
    "AlarmSender",
    "AuditMode",
    "CheckpointGate",
    "CheckpointNotVerifiedError",
    "CheckpointRecord",
    "CheckpointStatus",
    "FaultInjectionError",
    "FaultInjector",
    "FaultKind",
    "FaultSpec",
    "FaultSpecError",
    "Fingerprint",
    "GateClosedError",
    "GateError",
    "GuardConfig",
    "GuardConfigError",
    "GuardError",
    "GuardHaltedError",
    "GuardUsageError",
    "Layer",
    "LoadVerificationError",
    "Phase",
    "RankIdentity",
    "SDCGuard",
    "StatsConfig",
    "StatsConfigError",
    "StepOutcome",
    "VoteVerdict",
    "fingerprint_from_tensor",
    "fingerprint_on_device",
    "majority_vote",
    "ring_order",
    "ring_partners",
    "step_seed",
    "verify_after_load",
    "weight_fingerprint",
]

_LAZY = {"AlarmSender": "detection.sender", "RankIdentity": "detection.identity"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'detection' has no attribute {name!r}")
