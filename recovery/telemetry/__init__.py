"""GPU telemetry of one node, collected from four tools and judged in one snapshot.

dcgm-exporter (live counters), ``dcgmi diag`` (active tests), the kernel log (Xid events)
and ``nvidia-smi -q`` (ECC and row-remap records) each see part of a GPU's health. The
incident flow needs them side by side, per GPU, with a verdict and with every tool that did
not answer named, because telemetry is evidence *against* a node, never evidence for it:
silent data corruption leaves all of it green (:data:`SDC_CAVEAT`).
"""

from recovery.telemetry._common import (
    ClockEventReason,
    decode_clock_event_mask,
    normalize_pci_bus_id,
)
from recovery.telemetry.collector import (
    DEFAULT_DIAG_IMAGE,
    DEFAULT_NODE,
    FIXTURE_FILES,
    FixtureTelemetry,
    KubeTelemetry,
    TelemetryCollector,
    packaged_fixture_root,
)
from recovery.telemetry.dcgm_exporter import ExporterGpu, ExporterScrape, parse_dcgm_exporter
from recovery.telemetry.dcgmi_diag import (
    DiagReport,
    DiagResult,
    DiagStatus,
    DiagWarning,
    parse_dcgmi_diag,
)
from recovery.telemetry.errors import TelemetryParseError, TelemetryToolError
from recovery.telemetry.nvidia_smi import (
    MigDevice,
    NvidiaSmiReport,
    SmiEcc,
    SmiGpu,
    SmiRemappedRows,
    parse_nvidia_smi_text,
    parse_nvidia_smi_xml,
)
from recovery.telemetry.recovery_action import RecoveryAction, parse_recovery_action
from recovery.telemetry.snapshot import (
    SDC_CAVEAT,
    EccCounts,
    GpuHealth,
    Health,
    RemapState,
    SourceReport,
    SourceStatus,
    TelemetrySnapshot,
    Tool,
    build_snapshot,
)
from recovery.telemetry.xid import (
    XID_POLICY,
    KernelLog,
    XidAction,
    XidEvent,
    XidInfo,
    XidPolicy,
    XidSeverity,
    parse_kernel_log,
    xid_catalog,
    xid_info,
)

__all__ = [
    "DEFAULT_DIAG_IMAGE",
    "DEFAULT_NODE",
    "FIXTURE_FILES",
    "SDC_CAVEAT",
    "XID_POLICY",
    "ClockEventReason",
    "DiagReport",
    "DiagResult",
    "DiagStatus",
    "DiagWarning",
    "EccCounts",
    "ExporterGpu",
    "ExporterScrape",
    "FixtureTelemetry",
    "GpuHealth",
    "Health",
    "KernelLog",
    "KubeTelemetry",
    "MigDevice",
    "NvidiaSmiReport",
    "RecoveryAction",
    "RemapState",
    "SmiEcc",
    "SmiGpu",
    "SmiRemappedRows",
    "SourceReport",
    "SourceStatus",
    "TelemetryCollector",
    "TelemetryParseError",
    "TelemetrySnapshot",
    "TelemetryToolError",
    "Tool",
    "XidAction",
    "XidEvent",
    "XidInfo",
    "XidPolicy",
    "XidSeverity",
    "build_snapshot",
    "decode_clock_event_mask",
    "normalize_pci_bus_id",
    "packaged_fixture_root",
    "parse_dcgm_exporter",
    "parse_dcgmi_diag",
    "parse_kernel_log",
    "parse_nvidia_smi_text",
    "parse_nvidia_smi_xml",
    "parse_recovery_action",
    "xid_catalog",
    "xid_info",
]
