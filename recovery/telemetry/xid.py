"""NVIDIA Xid events out of kernel logs, and what each Xid means for a node.

The driver logs every Xid as ``NVRM: Xid (PCI:<domain:bus:dev>): <N>, <details>``; since
the R525-era drivers the details start with ``pid=..., name=...``. What comes before
``NVRM:`` depends on how the log was read, so the prefix is parsed separately and a line whose
prefix we do not know still yields its event (without a timestamp):

* ``dmesg --time-format iso``: ``2024-11-15T12:02:03,470068+00:00 NVRM: ...``
* ``dmesg --decode --time-format iso``: ``kern  :warn  : 2025-01-21T02:21:33,498559+00:00 ...``
* ``dmesg --ctime`` / ``-T``: ``[Sun Feb 23 16:24:18 2025] NVRM: ...`` (host local time, no zone)
* plain ``dmesg``: ``[ 1234.567890] NVRM: ...`` (seconds since boot)
* ``journalctl -k -o short-iso``: ``2025-02-23T16:24:18+0000 host kernel: NVRM: ...``
* ``/dev/kmsg`` records: ``4,1234,5678901,-;NVRM: ...`` (microseconds since boot)

Meaning and severity come from NVIDIA's Xid catalogue (``data/xid_catalog.csv``, shipped with
the package) plus :data:`XID_POLICY`, our explicit reading of the common Xids for a node that
is under suspicion of silent data corruption.
"""

from __future__ import annotations

import csv
import datetime as dt
import enum
import functools
import io
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType
from typing import Final

from recovery.telemetry._common import normalize_pci_bus_id

__all__ = [
    "XID_POLICY",
    "KernelLog",
    "XidAction",
    "XidEvent",
    "XidInfo",
    "XidPolicy",
    "XidSeverity",
    "parse_kernel_log",
    "xid_catalog",
    "xid_info",
]


class XidSeverity(enum.StrEnum):
    """How bad an Xid is for the node: ``critical`` fails it, ``warning`` degrades it."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class XidAction(enum.StrEnum):
    """What we recommend doing about an Xid, in increasing order of cost."""

    NONE = "none"
    RESTART_APP = "restart-app"
    INVESTIGATE = "investigate"
    RESET_GPU = "reset-gpu"
    REBOOT_NODE = "reboot-node"
    DRAIN_AND_REPLACE = "drain-and-replace"


@dataclass(frozen=True)
class XidPolicy:
    """Our verdict on one Xid and the reason for it, next to the catalogue's own buckets."""

    severity: XidSeverity
    action: XidAction
    why: str


_S = XidSeverity
_A = XidAction

#: The common Xids, read for a node suspected of SDC. Severity follows the catalogue's
#: immediate-action bucket (IGNORE → info, RESTART_APP → warning, RESET_GPU / RESTART_BM →
#: critical) except where noted in ``why``; the action is the catalogue's, made concrete.
XID_POLICY: Final[Mapping[int, XidPolicy]] = MappingProxyType(
    {
        13: XidPolicy(
            _S.WARNING,
            _A.RESTART_APP,
            "graphics engine exception: usually the application; hardware only if it "
            "repeats across applications (catalogue: RESTART_APP, WORKFLOW_XID_13)",
        ),
        31: XidPolicy(
            _S.WARNING,
            _A.RESTART_APP,
            "GPU memory page fault: usually the application or driver (catalogue: RESTART_APP)",
        ),
        43: XidPolicy(
            _S.INFO,
            _A.NONE,
            "the GPU stopped a faulting channel; it follows an application error "
            "(catalogue: IGNORE)",
        ),
        45: XidPolicy(
            _S.INFO,
            _A.NONE,
            "preemptive cleanup after another error: act on that one "
            "(catalogue: WORKFLOW_XID_45, follow the other Xid)",
        ),
        48: XidPolicy(
            _S.CRITICAL,
            _A.RESET_GPU,
            "uncorrectable double-bit ECC error: the GPU handed out corrupt memory; "
            "reset to remap the row, replace if the remap fails (catalogue: "
            "WORKFLOW_XID_48)",
        ),
        61: XidPolicy(
            _S.CRITICAL,
            _A.RESET_GPU,
            "internal micro-controller (PMU) breakpoint: the GPU needs a reset "
            "(catalogue: CONTACT_SUPPORT)",
        ),
        62: XidPolicy(
            _S.CRITICAL, _A.RESET_GPU, "internal micro-controller halt (catalogue: RESET_GPU)"
        ),
        63: XidPolicy(
            _S.WARNING,
            _A.RESET_GPU,
            "a memory row was marked for remapping; the spare row is used only after "
            "the next GPU reset (catalogue: IGNORE; the driver says 'reset gpu to "
            "activate')",
        ),
        64: XidPolicy(
            _S.CRITICAL,
            _A.DRAIN_AND_REPLACE,
            "row remapping failed: the memory cannot be repaired in the field "
            "(catalogue: RESET_GPU, then CONTACT_SUPPORT)",
        ),
        74: XidPolicy(
            _S.CRITICAL,
            _A.RESET_GPU,
            "NVLink error: reset, replace if it recurs (catalogue: "
            "WORKFLOW_NVLINK_ERR, CONTACT_SUPPORT)",
        ),
        79: XidPolicy(
            _S.CRITICAL,
            _A.DRAIN_AND_REPLACE,
            "GPU has fallen off the bus: the catalogue restarts the machine and "
            "calls support; a training node does not wait for that "
            "(catalogue: RESTART_BM, CONTACT_SUPPORT)",
        ),
        92: XidPolicy(
            _S.WARNING,
            _A.INVESTIGATE,
            "high single-bit ECC error rate: still corrected, but memory is wearing "
            "(catalogue: IGNORE, then CONTACT_SUPPORT)",
        ),
        94: XidPolicy(
            _S.CRITICAL,
            _A.RESET_GPU,
            "contained uncorrectable memory error: only the affected application was "
            "stopped, but the memory is bad until a reset remaps the row; critical "
            "for a node under SDC suspicion (catalogue: RESTART_APP)",
        ),
        95: XidPolicy(
            _S.CRITICAL,
            _A.RESET_GPU,
            "uncontained uncorrectable memory error: any application on the GPU may "
            "have consumed corrupt data (catalogue: RESET_GPU)",
        ),
        119: XidPolicy(
            _S.CRITICAL,
            _A.RESET_GPU,
            "GSP RPC timeout: the GPU's system processor stopped answering "
            "(catalogue: RESET_GPU, INVESTIGATE_SW)",
        ),
        120: XidPolicy(
            _S.CRITICAL, _A.RESET_GPU, "GSP error (catalogue: RESET_GPU, INVESTIGATE_SW)"
        ),
    }
)

# For Xids outside XID_POLICY: the catalogue's immediate-action bucket decides.
_BUCKET_POLICY: Final[Mapping[str, tuple[XidSeverity, XidAction]]] = MappingProxyType(
    {
        "IGNORE": (_S.INFO, _A.NONE),
        "XID_154": (_S.INFO, _A.NONE),
        "RESTART_APP": (_S.WARNING, _A.RESTART_APP),
        "RESET_GPU": (_S.CRITICAL, _A.RESET_GPU),
        "RESTART_BM": (_S.CRITICAL, _A.REBOOT_NODE),
        "RESTART_VM": (_S.CRITICAL, _A.REBOOT_NODE),
    }
)


@dataclass(frozen=True)
class XidInfo:
    """What an Xid number means: NVIDIA's catalogue entry and our severity and action.

    ``causes`` are the cause flags of NVIDIA's older (r555) Xid listing that are set, e.g.
    ``("hw_error", "fb_corruption")``; empty for Xids that listing does not have.
    """

    xid: int
    mnemonic: str | None
    description: str
    severity: XidSeverity
    action: XidAction
    why: str
    catalogue_immediate_action: str | None
    catalogue_investigatory_action: str | None
    causes: tuple[str, ...]


@dataclass(frozen=True)
class XidEvent:
    """One ``NVRM: Xid`` line. Time is what the log prefix gave: a wall-clock ``timestamp``
    (naive when the log printed local time without a zone) or ``uptime_s`` since boot, or
    neither. ``pci_bus_id`` is normalised (``0000:19:00.0``)."""

    xid: int
    pci_bus_id: str
    message: str
    timestamp: dt.datetime | None = None
    uptime_s: float | None = None
    pid: int | None = None
    process: str | None = None
    line: int = 0


@dataclass(frozen=True)
class KernelLog:
    """Everything Xid-related in one kernel log.

    ``gpu_uuids`` maps a PCI bus id to the GPU UUID when the driver printed
    ``NVRM: GPU at PCI:...: GPU-...`` (it does before dumping GSP state). ``unparsed`` keeps
    lines that mention ``NVRM: Xid`` but do not have its shape, so a new driver format shows up
    as evidence instead of vanishing.
    """

    events: tuple[XidEvent, ...]
    gpu_uuids: Mapping[str, str]
    unparsed: tuple[str, ...] = ()


_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{1,2}:[0-9A-Fa-f]{1,2}"
    r"(?:\.[0-7])?)\):\s*(?P<xid>\d+)(?:,\s*(?P<rest>.*?))?\s*$"
)
_PID_NAME_RE = re.compile(r"^pid=(?P<pid>'<unknown>'|\d+),\s*name=(?P<name>[^,]*),\s*(?P<msg>.*)$")
_GPU_AT_RE = re.compile(
    r"NVRM: GPU at PCI:(?P<pci>[0-9A-Fa-f:.]+):\s*(?P<uuid>GPU-[0-9A-Fa-f-]{36})"
)
_ISO_RE = re.compile(
    r"(?P<ts>\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?)"
)
_CTIME_RE = re.compile(r"^\[(?P<ts>\w{3} \w{3} [ \d]\d \d{2}:\d{2}:\d{2} \d{4})\]")
_UPTIME_RE = re.compile(r"^\[\s*(?P<s>\d+\.\d+)\]")
_KMSG_RE = re.compile(r"^\d+,\d+,(?P<us>\d+),[^;]*;")


def _time_of(prefix: str) -> tuple[dt.datetime | None, float | None]:
    """Wall-clock time or seconds since boot from whatever precedes ``NVRM:``."""
    if match := _CTIME_RE.match(prefix):
        return dt.datetime.strptime(match["ts"], "%a %b %d %H:%M:%S %Y"), None
    if match := _UPTIME_RE.match(prefix):
        return None, float(match["s"])
    if match := _KMSG_RE.match(prefix):
        return None, int(match["us"]) / 1e6
    if match := _ISO_RE.search(prefix):
        try:
            return dt.datetime.fromisoformat(match["ts"].replace(",", ".")), None
        except ValueError:
            return None, None
    return None, None


def parse_kernel_log(text: str) -> KernelLog:
    """Find every Xid event (and PCI → UUID announcement) in a kernel log, in log order."""
    events: list[XidEvent] = []
    uuids: dict[str, str] = {}
    unparsed: list[str] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if "NVRM:" not in raw:
            continue
        if match := _GPU_AT_RE.search(raw):
            uuids[normalize_pci_bus_id(match["pci"].rstrip(":"))] = match["uuid"]
            continue
        if "NVRM: Xid" not in raw:
            continue
        match = _XID_RE.search(raw)
        if match is None:
            unparsed.append(raw)
            continue
        timestamp, uptime = _time_of(raw[: match.start()])
        rest = match["rest"] or ""
        pid: int | None = None
        process: str | None = None
        if details := _PID_NAME_RE.match(rest):
            pid = int(details["pid"]) if details["pid"].isdigit() else None
            name = details["name"].strip()
            process = None if name in ("<unknown>", "") else name
            rest = details["msg"]
        events.append(
            XidEvent(
                xid=int(match["xid"]),
                pci_bus_id=normalize_pci_bus_id(match["pci"]),
                message=rest.strip(),
                timestamp=timestamp,
                uptime_s=uptime,
                pid=pid,
                process=process,
                line=number,
            )
        )
    return KernelLog(
        events=tuple(events), gpu_uuids=MappingProxyType(uuids), unparsed=tuple(unparsed)
    )


def _read_data(name: str) -> list[dict[str, str]]:
    text = resources.files("recovery.telemetry").joinpath("data", name).read_text("utf-8")
    return list(csv.DictReader(io.StringIO(text)))


_CAUSE_FLAGS: Final = (
    "hw_error",
    "driver_error",
    "user_app_error",
    "system_memory_corruption",
    "bus_error",
    "thermal_issue",
    "fb_corruption",
)


@functools.cache
def xid_catalog() -> Mapping[int, XidInfo]:
    """NVIDIA's Xid catalogue joined with :data:`XID_POLICY`, read once from package data."""
    causes: dict[int, tuple[str, ...]] = {}
    for row in _read_data("xid_cause_categories_r555.csv"):
        causes[int(row["xid"])] = tuple(flag for flag in _CAUSE_FLAGS if row[flag] == "true")
    catalogue: dict[int, XidInfo] = {}
    for row in _read_data("xid_catalog.csv"):
        xid = int(row["xid"])
        immediate = row["immediate_action"].strip() or None
        investigatory = row["investigatory_action"].strip() or None
        policy = XID_POLICY.get(xid)
        if policy is None:
            severity, action = _BUCKET_POLICY.get(immediate or "", (_S.WARNING, _A.INVESTIGATE))
            why = f"from the catalogue's immediate action: {immediate or 'none given'}"
            policy = XidPolicy(severity, action, why)
        catalogue[xid] = XidInfo(
            xid=xid,
            mnemonic=row["mnemonic"].strip() or None,
            description=row["description"].strip(),
            severity=policy.severity,
            action=policy.action,
            why=policy.why,
            catalogue_immediate_action=immediate,
            catalogue_investigatory_action=investigatory,
            causes=causes.get(xid, ()),
        )
    return MappingProxyType(catalogue)


def xid_info(xid: int) -> XidInfo:
    """Meaning of ``xid``; one NVIDIA has not catalogued is a warning worth investigating."""
    known = xid_catalog().get(xid)
    if known is not None:
        return known
    return XidInfo(
        xid=xid,
        mnemonic=None,
        description="not in NVIDIA's Xid catalogue",
        severity=XidSeverity.WARNING,
        action=XidAction.INVESTIGATE,
        why="an Xid we cannot classify is never treated as harmless",
        catalogue_immediate_action=None,
        catalogue_investigatory_action=None,
        causes=(),
    )
