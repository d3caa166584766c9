"""sdcguard detection: runs inside every training rank (torch, httpx and the stdlib only).

The few lines a training script adds are :class:`SDCGuard` and :class:`GuardConfig`
(see ``docs/guide.md``). Every public name is imported on first use (PEP 562), so
``import detection.transport.alarm`` or ``detection.transport.signing`` — all the control plane
needs — never imports torch: a control-plane image has no torch at all. The rooms beneath are
mapped in ``docs/ARCHITECTURE.md``.

Invariant: this module imports nothing at load time but the stdlib.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from detection._lazy import lazy_exports

if TYPE_CHECKING:
    from detection.audit.ring import AuditMode, ring_order, ring_partners, step_seed
    from detection.faults.injector import FaultInjector
    from detection.faults.spec import FaultInjectionError, FaultKind, FaultSpec, FaultSpecError
    from detection.gate import (
        CheckpointGate,
        CheckpointNotVerifiedError,
        CheckpointRecord,
        CheckpointStatus,
        GateClosedError,
        GateError,
        StepOutcome,
    )
    from detection.guard import (
        GuardConfig,
        GuardConfigError,
        GuardError,
        GuardHaltedError,
        GuardUsageError,
        SDCGuard,
    )
    from detection.identity import RankIdentity
    from detection.stepcheck.gradstats import StatsConfig, StatsConfigError
    from detection.transport.alarm import Alarm, Layer, Phase
    from detection.transport.sender import AlarmSender
    from detection.weights.fingerprint import (
        Fingerprint,
        fingerprint_from_tensor,
        fingerprint_on_device,
        weight_fingerprint,
    )
    from detection.weights.load_check import LoadVerificationError, verify_after_load
    from detection.weights.vote import VoteVerdict, majority_vote


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


__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Alarm": "transport.alarm",
        "Layer": "transport.alarm",
        "Phase": "transport.alarm",
        "AuditMode": "audit.ring",
        "ring_order": "audit.ring",
        "ring_partners": "audit.ring",
        "step_seed": "audit.ring",
        "FaultInjectionError": "faults.spec",
        "FaultInjector": "faults.injector",
        "FaultKind": "faults.spec",
        "FaultSpec": "faults.spec",
        "FaultSpecError": "faults.spec",
        "Fingerprint": "weights.fingerprint",
        "fingerprint_from_tensor": "weights.fingerprint",
        "fingerprint_on_device": "weights.fingerprint",
        "weight_fingerprint": "weights.fingerprint",
        "CheckpointGate": "gate",
        "CheckpointNotVerifiedError": "gate",
        "CheckpointRecord": "gate",
        "CheckpointStatus": "gate",
        "GateClosedError": "gate",
        "GateError": "gate",
        "StepOutcome": "gate",
        "StatsConfig": "stepcheck.gradstats",
        "StatsConfigError": "stepcheck.gradstats",
        "GuardConfig": "guard",
        "GuardConfigError": "guard",
        "GuardError": "guard",
        "GuardHaltedError": "guard",
        "GuardUsageError": "guard",
        "SDCGuard": "guard",
        "RankIdentity": "identity",
        "AlarmSender": "transport.sender",
        "LoadVerificationError": "weights.load_check",
        "VoteVerdict": "weights.vote",
        "majority_vote": "weights.vote",
        "verify_after_load": "weights.load_check",
    },
)
