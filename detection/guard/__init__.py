"""The guard: :class:`SDCGuard`, its configuration, and its per-step wiring.

The guard keeps the training-loop protocol and wires every layer into a step: the comm hook
(:mod:`~detection.guard.comm_hook`), the audit (:mod:`~detection.guard.audit_wiring`), the
calibration (:mod:`~detection.guard.calibration_wiring`), the row and the decision every rank
reaches from it (:mod:`~detection.guard.decision`, :mod:`~detection.guard.carry`), the
diagnostic trace mode of a diagnostic run (:mod:`~detection.guard.trace_mode`), and the learnt
state that travels with a checkpoint (:mod:`~detection.guard.state`).

Names are imported on first use: the control plane reads :mod:`~detection.guard.trace_mode`'s
variable names and markers without torch.
"""

from typing import TYPE_CHECKING

from detection._lazy import lazy_exports

if TYPE_CHECKING:
    from detection.guard.config import (
        GuardConfig,
        GuardConfigError,
        GuardError,
        GuardHaltedError,
        GuardUsageError,
    )
    from detection.guard.counters import GuardCounters
    from detection.guard.sdcguard import SDCGuard

__all__ = [
    "GuardConfig",
    "GuardConfigError",
    "GuardCounters",
    "GuardError",
    "GuardHaltedError",
    "GuardUsageError",
    "SDCGuard",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "GuardConfig": "config",
        "GuardConfigError": "config",
        "GuardError": "config",
        "GuardHaltedError": "config",
        "GuardUsageError": "config",
        "GuardCounters": "counters",
        "SDCGuard": "sdcguard",
    },
)
