"""Vocabulary shared by the telemetry parsers.

Each tool names the same GPU differently (dcgm-exporter ``00000000:31:00.0``, the kernel
``0000:19:00``, nvidia-smi ``00000000:00:1E.0``) and the same clock-event reason differently
(a bitmask, an XML tag, an English label). Folding them into one spelling here is what lets
the snapshot join readings of one GPU from several tools.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ClockEventReason",
    "decode_clock_event_mask",
    "jsonable",
    "normalize_pci_bus_id",
]


class ClockEventReason(enum.StrEnum):
    """Why the GPU runs below its maximum clocks (NVML ``nvmlClocksEventReason*``).

    DCGM calls the same mask ``CLOCK_THROTTLE_REASONS`` (older) or ``CLOCKS_EVENT_REASONS``
    (newer); the values are the suffixes nvidia-smi uses in its XML tags.
    """

    GPU_IDLE = "gpu_idle"
    APPLICATIONS_CLOCKS_SETTING = "applications_clocks_setting"
    SW_POWER_CAP = "sw_power_cap"
    HW_SLOWDOWN = "hw_slowdown"
    SYNC_BOOST = "sync_boost"
    SW_THERMAL_SLOWDOWN = "sw_thermal_slowdown"
    HW_THERMAL_SLOWDOWN = "hw_thermal_slowdown"
    HW_POWER_BRAKE_SLOWDOWN = "hw_power_brake_slowdown"
    DISPLAY_CLOCKS_SETTING = "display_clocks_setting"


# NVML's bit assignment (nvml.h, nvmlClocksEventReason*), in bit order.
_CLOCK_EVENT_BITS: tuple[tuple[int, ClockEventReason], ...] = (
    (0x001, ClockEventReason.GPU_IDLE),
    (0x002, ClockEventReason.APPLICATIONS_CLOCKS_SETTING),
    (0x004, ClockEventReason.SW_POWER_CAP),
    (0x008, ClockEventReason.HW_SLOWDOWN),
    (0x010, ClockEventReason.SYNC_BOOST),
    (0x020, ClockEventReason.SW_THERMAL_SLOWDOWN),
    (0x040, ClockEventReason.HW_THERMAL_SLOWDOWN),
    (0x080, ClockEventReason.HW_POWER_BRAKE_SLOWDOWN),
    (0x100, ClockEventReason.DISPLAY_CLOCKS_SETTING),
)
_KNOWN_CLOCK_BITS = sum(bit for bit, _ in _CLOCK_EVENT_BITS)


def decode_clock_event_mask(mask: int) -> tuple[str, ...]:
    """Names of the set bits, in bit order; a bit NVML had not defined is kept as ``bit_0xNNN``.

    Unknown bits are kept rather than dropped so a newer driver's reason still shows up in
    the evidence, even before we know its name.
    """
    if mask < 0:
        raise ValueError(f"clock event mask must be non-negative, got {mask}")
    names: list[str] = [reason.value for bit, reason in _CLOCK_EVENT_BITS if mask & bit]
    unknown = mask & ~_KNOWN_CLOCK_BITS
    bit = 1
    while unknown >= bit:
        if unknown & bit:
            names.append(f"bit_{bit:#05x}")
        bit <<= 1
    return tuple(names)


_PCI_RE = re.compile(
    r"^(?:PCI:)?(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):"
    r"(?P<device>[0-9a-fA-F]{1,2})(?:\.(?P<function>[0-7]))?$"
)


def normalize_pci_bus_id(value: str) -> str:
    """One spelling of a PCI address, ``dddd:bb:dd.f`` in lower case.

    The kernel prints a 4-digit domain and no function (``0000:19:00``); NVML and DCGM print
    an 8-digit domain and a function (``00000000:19:00.0``). The domain's upper digits are
    always zero on the hosts we serve, and GPUs are function 0.
    """
    match = _PCI_RE.match(value.strip())
    if match is None:
        raise ValueError(f"not a PCI bus id: {value!r}")
    domain = int(match["domain"] or "0", 16)
    bus = int(match["bus"], 16)
    device = int(match["device"], 16)
    function = int(match["function"] or "0")
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function}"


def jsonable(value: Any) -> Any:
    """A JSON-safe copy: dataclasses to dicts, enums to values, datetimes to ISO 8601.

    NaN and infinities become ``None`` because JSON has no spelling for them and the ledger
    must be able to store every snapshot.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            field.name: jsonable(getattr(value, field.name)) for field in dataclasses.fields(value)
        }
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple | frozenset | set):
        return [jsonable(item) for item in value]
    return value
