"""One node's GPU telemetry, joined per GPU and judged: the evidence the incident flow records.

The tools name a GPU in different ways: nvidia-smi and dcgm-exporter by UUID, PCI address
and index, the kernel by PCI address only, ``dcgmi diag`` by DCGM GPU id only. Readings are
joined on UUID, then PCI address, then index, and never across a UUID or PCI address that
disagrees. DCGM GPU ids, dcgm-exporter's ``gpu`` label and nvidia-smi's order are all NVML's
enumeration order on the hosts we serve, so the index join is sound there.

Health is a verdict on the hardware the tools can see, nothing more. It says ``failed`` for a
critical Xid (48, 64, 79, 94, 95, 119, …, see :data:`~recovery.telemetry.xid.XID_POLICY`), a
volatile double-bit ECC error, a row-remap failure or a failed ``dcgmi diag`` test. It says
``degraded`` for single-bit errors since the driver loaded, a lifetime (aggregate) DBE count, a
pending row remap or page retirement, a warning Xid or diag result, and for any tool that did
not answer: missing evidence is never read as good news. And whatever it says,
:data:`SDC_CAVEAT` holds.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final

from recovery.telemetry._common import jsonable
from recovery.telemetry.dcgm_exporter import ExporterGpu, ExporterScrape
from recovery.telemetry.dcgmi_diag import DiagReport, DiagResult, DiagStatus
from recovery.telemetry.nvidia_smi import NvidiaSmiReport, SmiGpu
from recovery.telemetry.recovery_action import RecoveryAction
from recovery.telemetry.xid import KernelLog, XidEvent, XidSeverity, xid_info

__all__ = [
    "SDC_CAVEAT",
    "EccCounts",
    "GpuHealth",
    "Health",
    "RemapState",
    "SourceReport",
    "SourceStatus",
    "TelemetrySnapshot",
    "Tool",
    "build_snapshot",
]

SDC_CAVEAT: Final = (
    "Healthy telemetry does not clear this node of silent data corruption. SDC by definition "
    "leaves ECC counters, Xid logs, diagnostics and exit codes green: a GPU that computes a "
    "wrong number reports nothing. Only a deterministic replay of the suspect steps or a "
    "cross-replica comparison can implicate or clear the node."
)


class Health(enum.StrEnum):
    """Verdict on the node's GPUs from telemetry alone (see the module docstring)."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"
    FAILED = "failed"


_ORDER: Final = {Health.HEALTHY: 0, Health.DEGRADED: 1, Health.FAILED: 2}


def _worst(healths: list[Health]) -> Health:
    return max(healths, key=_ORDER.__getitem__, default=Health.HEALTHY)


class Tool(enum.StrEnum):
    """The four sources of a snapshot."""

    DCGM_EXPORTER = "dcgm-exporter"
    DCGMI_DIAG = "dcgmi-diag"
    KERNEL_LOG = "kernel-log"
    NVIDIA_SMI = "nvidia-smi"


class SourceStatus(enum.StrEnum):
    """``missing``: nothing to read (no file, no exporter pod); ``failed``: it broke."""

    OK = "ok"
    FAILED = "failed"
    MISSING = "missing"


@dataclass(frozen=True)
class SourceReport:
    """Whether one tool answered, where from, and if not, the error it gave."""

    tool: Tool
    status: SourceStatus
    origin: str
    error: str | None = None
    error_type: str | None = None

    @classmethod
    def ok(cls, tool: Tool, origin: str) -> SourceReport:
        return cls(tool, SourceStatus.OK, origin)

    @classmethod
    def failed(cls, tool: Tool, origin: str, error: BaseException) -> SourceReport:
        return cls(tool, SourceStatus.FAILED, origin, str(error), type(error).__name__)

    @classmethod
    def missing(cls, tool: Tool, origin: str, why: str) -> SourceReport:
        return cls(tool, SourceStatus.MISSING, origin, why, None)


@dataclass(frozen=True)
class EccCounts:
    """ECC error counts, DCGM's naming: SBE = corrected, DBE = uncorrectable. Volatile counts
    start at driver load, aggregate ones span the board's life. ``None``: nobody reported it."""

    sbe_volatile: int | None = None
    dbe_volatile: int | None = None
    sbe_aggregate: int | None = None
    dbe_aggregate: int | None = None


@dataclass(frozen=True)
class RemapState:
    """Row remapper state: rows remapped for correctable / uncorrectable errors, a remap
    waiting for a GPU reset, and whether a remap failed (no spare rows left)."""

    correctable: int | None = None
    uncorrectable: int | None = None
    pending: bool | None = None
    failure: bool | None = None


@dataclass(frozen=True)
class GpuHealth:
    """One GPU joined over every tool that saw it, with its own verdict and reasons.

    ``xids`` are the distinct Xid numbers from the kernel log and dcgm-exporter's last Xid.
    Where two tools report one counter the larger value is kept: a counter that one tool
    read as higher cannot have been lower.
    """

    index: int | None
    uuid: str | None
    pci_bus_id: str | None
    product: str | None
    xids: tuple[int, ...]
    ecc: EccCounts
    remap: RemapState
    temperature_c: float | None
    power_w: float | None
    clock_event_reasons: tuple[str, ...] | None
    diag: tuple[DiagResult, ...]
    health: Health
    reasons: tuple[str, ...]
    recovery_action: RecoveryAction | None = None
    """NVML's GPU Recovery Action as nvidia-smi read it; ``None``: the driver has no such field."""

    @property
    def label(self) -> str:
        return _label(self.index, self.uuid, self.pci_bus_id)


def _label(index: int | None, uuid: str | None, pci: str | None) -> str:
    names = ", ".join(part for part in (uuid, pci) if part)
    head = f"GPU {index}" if index is not None else "GPU"
    return f"{head} ({names})" if names else head


@dataclass(frozen=True)
class TelemetrySnapshot:
    """Everything telemetry says about one node at one moment, and what it does not say.

    ``gpus`` is the joined per-GPU view; ``kernel_xids``, ``exporter``, ``diag`` and
    ``nvidia_smi`` keep each tool's own parsed answer as evidence. ``sources`` lists every
    tool, including those that failed, with their error. ``sdc_caveat`` is fixed.
    """

    node: str
    collected_at: dt.datetime
    health: Health
    reasons: list[str]
    gpus: tuple[GpuHealth, ...]
    kernel_xids: tuple[XidEvent, ...]
    sources: tuple[SourceReport, ...]
    exporter: ExporterScrape | None = None
    diag: DiagReport | None = None
    nvidia_smi: NvidiaSmiReport | None = None
    kernel_log_unparsed: tuple[str, ...] = ()
    sdc_caveat: str = field(default=SDC_CAVEAT, init=False)

    def source(self, tool: Tool) -> SourceReport | None:
        return next((report for report in self.sources if report.tool is tool), None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe evidence for the ledger (datetimes ISO 8601, enums as their values)."""
        result: dict[str, Any] = jsonable(self)
        return result


# ----------------------------------------------------------------------------- joining


@dataclass
class _Entry:
    index: int | None = None
    uuid: str | None = None
    pci: str | None = None
    product: str | None = None
    smi: list[SmiGpu] = field(default_factory=list)
    exporter: list[ExporterGpu] = field(default_factory=list)
    events: list[XidEvent] = field(default_factory=list)
    diag: list[DiagResult] = field(default_factory=list)

    def fits(self, uuid: str | None, pci: str | None) -> bool:
        return (not uuid or not self.uuid or self.uuid == uuid) and (
            not pci or not self.pci or self.pci == pci
        )

    def absorb(self, index: int | None, uuid: str | None, pci: str | None) -> None:
        self.index = self.index if self.index is not None else index
        self.uuid = self.uuid or uuid
        self.pci = self.pci or pci


class _Join:
    def __init__(self) -> None:
        self.entries: list[_Entry] = []

    def entry(
        self, *, index: int | None = None, uuid: str | None = None, pci: str | None = None
    ) -> _Entry:
        for wanted, attribute in ((uuid, "uuid"), (pci, "pci"), (index, "index")):
            if wanted is None:
                continue
            for entry in self.entries:
                if getattr(entry, attribute) == wanted and entry.fits(uuid, pci):
                    entry.absorb(index, uuid, pci)
                    return entry
        created = _Entry(index=index, uuid=uuid, pci=pci)
        self.entries.append(created)
        return created


def _max(values: list[Any]) -> Any:
    present = [value for value in values if value is not None]
    return max(present) if present else None


def _first(values: list[Any]) -> Any:
    return next((value for value in values if value is not None), None)


def build_snapshot(
    node: str,
    *,
    collected_at: dt.datetime,
    sources: list[SourceReport] | tuple[SourceReport, ...],
    exporter: ExporterScrape | None = None,
    diag: DiagReport | None = None,
    kernel_log: KernelLog | None = None,
    nvidia_smi: NvidiaSmiReport | None = None,
) -> TelemetrySnapshot:
    """Join the parsed tool outputs of ``node`` per GPU and judge them.

    ``sources`` must say, for every tool, whether it answered; a parsed output passed for a
    tool that is not ``ok`` in ``sources`` is a caller bug and raises ``ValueError``.
    """
    answered = {report.tool for report in sources if report.status is SourceStatus.OK}
    for tool, parsed in (
        (Tool.DCGM_EXPORTER, exporter),
        (Tool.DCGMI_DIAG, diag),
        (Tool.KERNEL_LOG, kernel_log),
        (Tool.NVIDIA_SMI, nvidia_smi),
    ):
        if parsed is not None and tool not in answered:
            raise ValueError(f"{tool} output given but its source is not 'ok'")

    join = _Join()
    for smi_gpu in nvidia_smi.gpus if nvidia_smi else ():
        entry = join.entry(index=smi_gpu.index, uuid=smi_gpu.uuid, pci=smi_gpu.pci_bus_id)
        entry.product = entry.product or smi_gpu.product_name
        entry.smi.append(smi_gpu)
    for exporter_gpu in exporter.gpus if exporter else ():
        entry = join.entry(
            index=exporter_gpu.gpu, uuid=exporter_gpu.uuid, pci=exporter_gpu.pci_bus_id
        )
        entry.product = entry.product or exporter_gpu.model_name
        entry.exporter.append(exporter_gpu)
    if kernel_log is not None:
        for pci, uuid in kernel_log.gpu_uuids.items():
            join.entry(uuid=uuid, pci=pci)
        for event in kernel_log.events:
            join.entry(pci=event.pci_bus_id).events.append(event)
    node_reasons: list[tuple[Health, str]] = []
    for result in diag.results if diag else ():
        if result.gpu is None:
            node_reasons.extend(
                _diag_reasons(f"{result.entity_group} {result.entity_id}", [result])
            )
        else:
            join.entry(index=result.gpu).diag.append(result)

    gpus = tuple(_gpu_health(entry) for entry in join.entries)
    if nvidia_smi is not None and not nvidia_smi.complete:
        node_reasons.append(
            (
                Health.DEGRADED,
                f"nvidia-smi reports {nvidia_smi.attached_gpus} attached GPU(s) but describes "
                f"{len(nvidia_smi.gpus)}: its output is incomplete",
            )
        )
    if kernel_log is not None and kernel_log.unparsed:
        node_reasons.append(
            (
                Health.DEGRADED,
                f"kernel log: {len(kernel_log.unparsed)} 'NVRM: Xid' line(s) in a format we cannot "
                f"read, first: {kernel_log.unparsed[0]!r}",
            )
        )
    for report in sources:
        if report.status is not SourceStatus.OK:
            node_reasons.append(
                (
                    Health.DEGRADED,
                    f"{report.tool} {report.status} ({report.origin}): {report.error}",
                )
            )
    health = _worst([gpu.health for gpu in gpus] + [verdict for verdict, _ in node_reasons])
    reasons = [reason for gpu in gpus for reason in gpu.reasons]
    reasons += [text for _, text in node_reasons]
    return TelemetrySnapshot(
        node=node,
        collected_at=collected_at,
        health=health,
        reasons=reasons,
        gpus=gpus,
        kernel_xids=kernel_log.events if kernel_log else (),
        sources=tuple(sources),
        exporter=exporter,
        diag=diag,
        nvidia_smi=nvidia_smi,
        kernel_log_unparsed=kernel_log.unparsed if kernel_log else (),
    )


def _gpu_health(entry: _Entry) -> GpuHealth:
    label = _label(entry.index, entry.uuid, entry.pci)
    ecc = EccCounts(
        sbe_volatile=_max(
            [g.ecc_sbe_volatile for g in entry.exporter]
            + [g.ecc_volatile.correctable for g in entry.smi]
        ),
        dbe_volatile=_max(
            [g.ecc_dbe_volatile for g in entry.exporter]
            + [g.ecc_volatile.uncorrectable for g in entry.smi]
        ),
        sbe_aggregate=_max(
            [g.ecc_sbe_aggregate for g in entry.exporter]
            + [g.ecc_aggregate.correctable for g in entry.smi]
        ),
        dbe_aggregate=_max(
            [g.ecc_dbe_aggregate for g in entry.exporter]
            + [g.ecc_aggregate.uncorrectable for g in entry.smi]
        ),
    )
    remap = RemapState(
        correctable=_max(
            [g.remapped_rows_correctable for g in entry.exporter]
            + [g.remapped_rows.correctable for g in entry.smi]
        ),
        uncorrectable=_max(
            [g.remapped_rows_uncorrectable for g in entry.exporter]
            + [g.remapped_rows.uncorrectable for g in entry.smi]
        ),
        pending=_max(
            [g.row_remap_pending for g in entry.exporter]
            + [g.remapped_rows.pending for g in entry.smi]
        ),
        failure=_max(
            [g.row_remap_failure for g in entry.exporter]
            + [g.remapped_rows.failure for g in entry.smi]
        ),
    )
    verdicts: list[tuple[Health, str]] = []

    kernel_counts = Counter(event.xid for event in entry.events)
    for xid, count in sorted(kernel_counts.items()):
        verdicts.extend(_xid_reason(label, xid, f"{count}x in the kernel log"))
    for exporter_gpu in entry.exporter:
        last = exporter_gpu.last_xid
        if last and last not in kernel_counts:
            verdicts.extend(_xid_reason(label, last, "last Xid reported by dcgm-exporter"))

    if ecc.dbe_volatile:
        verdicts.append(
            (
                Health.FAILED,
                f"{label}: {ecc.dbe_volatile} volatile double-bit (DBE, uncorrectable) "
                "ECC error(s) since the driver loaded",
            )
        )
    elif ecc.dbe_aggregate:
        verdicts.append(
            (
                Health.DEGRADED,
                f"{label}: {ecc.dbe_aggregate} double-bit (DBE, uncorrectable) ECC "
                "error(s) over the board's life, none since the driver loaded",
            )
        )
    if ecc.sbe_volatile:
        verdicts.append(
            (
                Health.DEGRADED,
                f"{label}: {ecc.sbe_volatile} single-bit (SBE, corrected) ECC error(s) "
                "since the driver loaded",
            )
        )
    if remap.failure:
        verdicts.append((Health.FAILED, f"{label}: row remapping failed (no spare rows left)"))
    if remap.pending:
        verdicts.append(
            (
                Health.DEGRADED,
                f"{label}: a row remap is pending; it takes effect at the next GPU reset",
            )
        )
    if any(g.retired_pages_pending for g in entry.smi):
        verdicts.append((Health.DEGRADED, f"{label}: memory pages are pending retirement"))
    for smi_gpu in entry.smi:
        if smi_gpu.unreadable:
            verdicts.append(
                (
                    Health.DEGRADED,
                    f"{label}: nvidia-smi could not read {'; '.join(smi_gpu.unreadable)}",
                )
            )
    verdicts.extend(_diag_reasons(label, entry.diag))
    action = _first([g.recovery_action for g in entry.smi])
    verdicts.extend(_stuck_reasons(label, action, entry.smi))

    xids = sorted(set(kernel_counts) | {g.last_xid for g in entry.exporter if g.last_xid})
    return GpuHealth(
        index=entry.index,
        uuid=entry.uuid,
        pci_bus_id=entry.pci,
        product=entry.product,
        xids=tuple(xids),
        ecc=ecc,
        remap=remap,
        temperature_c=_first(
            [g.temperature_c for g in entry.exporter] + [g.temperature_c for g in entry.smi]
        ),
        power_w=_first([g.power_w for g in entry.exporter] + [g.power_w for g in entry.smi]),
        clock_event_reasons=_first(
            [g.clock_event_reasons for g in entry.exporter]
            + [g.clock_event_reasons for g in entry.smi]
        ),
        diag=tuple(entry.diag),
        health=_worst([verdict for verdict, _ in verdicts]),
        reasons=tuple(text for _, text in verdicts),
        recovery_action=action,
    )


# What the driver asks for, by how badly: a GPU that needs a reset or a reboot computes
# nothing trustworthy until it gets one; a pending P2P drain leaves it usable but not whole.
_ACTION_HEALTH: Final = {
    RecoveryAction.GPU_RESET: Health.FAILED,
    RecoveryAction.NODE_REBOOT: Health.FAILED,
    RecoveryAction.DRAIN_AND_RESET: Health.FAILED,
    RecoveryAction.DRAIN_P2P: Health.DEGRADED,
    RecoveryAction.UNKNOWN: Health.DEGRADED,
}


def _stuck_reasons(
    label: str, action: RecoveryAction | None, smi: list[SmiGpu]
) -> list[tuple[Health, str]]:
    """The state a stuck GPU shows without a new Xid: NVML's recovery action, or on older
    drivers the reset-status pair."""
    verdicts: list[tuple[Health, str]] = []
    if action is not None and action.pending:
        verdicts.append(
            (
                _ACTION_HEALTH[action],
                f"{label}: NVML GPU Recovery Action is {action.value}: the driver asks for it "
                "before the GPU is used again",
            )
        )
    if any(g.reset_required for g in smi):
        verdicts.append((Health.FAILED, f"{label}: nvidia-smi reports a GPU reset required"))
    elif any(g.drain_and_reset_recommended for g in smi):
        verdicts.append(
            (Health.DEGRADED, f"{label}: nvidia-smi recommends a drain and reset of the GPU")
        )
    return verdicts


_XID_HEALTH: Final = {
    XidSeverity.CRITICAL: Health.FAILED,
    XidSeverity.WARNING: Health.DEGRADED,
}


def _xid_reason(label: str, xid: int, where: str) -> list[tuple[Health, str]]:
    info = xid_info(xid)
    health = _XID_HEALTH.get(info.severity)
    if health is None:
        return []
    return [
        (
            health,
            f"{label}: Xid {xid} ({info.description}) {where}: {info.severity}, "
            f"recommended action {info.action}",
        )
    ]


def _diag_reasons(label: str, results: list[DiagResult]) -> list[tuple[Health, str]]:
    verdicts: list[tuple[Health, str]] = []
    for result in results:
        if result.status is DiagStatus.FAIL:
            health = Health.FAILED
        elif result.status is DiagStatus.WARN:
            health = Health.DEGRADED
        else:
            continue
        detail = f": {result.message}" if result.message else ""
        verdicts.append(
            (
                health,
                f"{label}: dcgmi diag test '{result.test}' ({result.category}) "
                f"{result.status.value.upper()}{detail}",
            )
        )
    return verdicts
