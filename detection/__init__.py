"""sdcguard detection: runs inside every training rank (torch, httpx and the stdlib only).

The few lines a training script adds are :class:`SDCGuard` and :class:`GuardConfig`
(see ``docs/detection.md``). Every public name is imported on first use (PEP 562), so
``import detection.alarm`` or ``detection.signing`` — all the control plane needs — never
imports torch: a control-plane image has no torch at all.

Invariant: this module imports nothing at load time but the stdlib.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from detection.identity import RankIdentity
    from detection.sender import AlarmSender
    from detection.vote import LoadVerificationError, VoteVerdict, majority_vote, verify_after_load

_LAZY: dict[str, str] = {
    "Alarm": "detection.alarm",
    "Layer": "detection.alarm",
    "Phase": "detection.alarm",
    "AuditMode": "detection.audit",
    "ring_order": "detection.audit",
    "ring_partners": "detection.audit",
    "step_seed": "detection.audit",
    "FaultInjectionError": "detection.faults",
    "FaultInjector": "detection.faults",
    "FaultKind": "detection.faults",
    "FaultSpec": "detection.faults",
    "FaultSpecError": "detection.faults",
    "Fingerprint": "detection.fingerprint",
    "fingerprint_from_tensor": "detection.fingerprint",
    "fingerprint_on_device": "detection.fingerprint",
    "weight_fingerprint": "detection.fingerprint",
    "CheckpointGate": "detection.gate",
    "CheckpointNotVerifiedError": "detection.gate",
    "CheckpointRecord": "detection.gate",
    "CheckpointStatus": "detection.gate",
    "GateClosedError": "detection.gate",
    "GateError": "detection.gate",
    "StepOutcome": "detection.gate",
    "StatsConfig": "detection.gradstats",
    "StatsConfigError": "detection.gradstats",
    "GuardConfig": "detection.guard",
    "GuardConfigError": "detection.guard",
    "GuardError": "detection.guard",
    "GuardHaltedError": "detection.guard",
    "GuardUsageError": "detection.guard",
    "SDCGuard": "detection.guard",
    "RankIdentity": "detection.identity",
    "AlarmSender": "detection.sender",
    "LoadVerificationError": "detection.vote",
    "VoteVerdict": "detection.vote",
    "majority_vote": "detection.vote",
    "verify_after_load": "detection.vote",
}

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'detection' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
