"""NVML's *GPU Recovery Action*: what the driver says a GPU needs before it can be trusted again.

A GPU already stuck needing a reset raises no new Xid: the Xid that put it there (and the
informational Xid 154, "GPU Recovery Action Changed") may be long gone from the kernel ring
buffer, while NVML keeps reporting the pending action. ``nvidia-smi -q -x`` shows it as
``<gpu_recovery_action>`` (driver R570 and later; ``nvmlDeviceGetGpuRecoveryAction`` /
``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``), next to the older ``<gpu_reset_status>`` pair
``reset_required`` / ``drain_and_reset_recommended`` (drivers 535 to 550; later drivers print
"Requested functionality has been deprecated" there).

Invariant: any action other than ``none`` is evidence against the GPU — a reset, a reboot or a
drain is what the driver itself asks for — and an action we cannot name is never read as
``none``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

__all__ = ["RecoveryAction", "parse_recovery_action"]


class RecoveryAction(StrEnum):
    """NVML's ``nvmlDeviceGpuRecoveryAction_t``, in NVML's order (0 to 4), plus ``unknown``."""

    NONE = "none"
    """0: nothing pending."""
    GPU_RESET = "gpu-reset"
    """1: the GPU must be reset before it is used again."""
    NODE_REBOOT = "node-reboot"
    """2: only a reboot of the node clears it."""
    DRAIN_P2P = "drain-p2p"
    """3: peer-to-peer traffic must be drained (NVLink / fabric), then the GPU reset."""
    DRAIN_AND_RESET = "drain-and-reset"
    """4: drain the GPU's work, then reset it."""
    UNKNOWN = "unknown"
    """A value this version does not know: treated as an action pending, never as none."""

    @property
    def pending(self) -> bool:
        """Whether the driver asks for something to be done to this GPU."""
        return self is not RecoveryAction.NONE


_BY_TEXT: Final = {
    # NVML's numbers, as NVML_FI_DEV_GET_GPU_RECOVERY_ACTION returns them.
    "0": RecoveryAction.NONE,
    "1": RecoveryAction.GPU_RESET,
    "2": RecoveryAction.NODE_REBOOT,
    "3": RecoveryAction.DRAIN_P2P,
    "4": RecoveryAction.DRAIN_AND_RESET,
    # nvidia-smi's words (``-q`` and ``-q -x``), and NVML's enumerator names without prefix.
    "none": RecoveryAction.NONE,
    "reset": RecoveryAction.GPU_RESET,
    "gpu reset": RecoveryAction.GPU_RESET,
    "gpu_reset": RecoveryAction.GPU_RESET,
    "reboot": RecoveryAction.NODE_REBOOT,
    "node reboot": RecoveryAction.NODE_REBOOT,
    "node_reboot": RecoveryAction.NODE_REBOOT,
    "drain p2p": RecoveryAction.DRAIN_P2P,
    "drain_p2p": RecoveryAction.DRAIN_P2P,
    "drain and reset": RecoveryAction.DRAIN_AND_RESET,
    "drain_and_reset": RecoveryAction.DRAIN_AND_RESET,
}

# What nvidia-smi prints where a driver has no such field: no reading, not "none".
_ABSENT: Final = frozenset(
    {
        "",
        "n/a",
        "[n/a]",
        "not supported",
        "[not supported]",
        "requested functionality has been deprecated",
    }
)


def parse_recovery_action(value: str | int | None) -> RecoveryAction | None:
    """The action a reading names; ``None`` where the tool has no such field (old driver).

    Numbers are NVML's; words are nvidia-smi's (``Reset``, ``Drain and Reset``, …), in any
    case. Anything else is :attr:`RecoveryAction.UNKNOWN`, an action pending.
    """
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        text = str(value)
    else:
        text = " ".join(str(value).split()).lower()
    if text in _ABSENT:
        return None
    if text.startswith("nvml_gpu_recovery_action_"):
        text = text.removeprefix("nvml_gpu_recovery_action_")
    return _BY_TEXT.get(text, RecoveryAction.UNKNOWN)
