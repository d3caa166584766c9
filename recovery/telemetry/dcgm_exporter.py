"""Per-GPU health readings out of a dcgm-exporter ``/metrics`` scrape.

The text is read with ``prometheus_client``'s own parser, so every exposition quirk (escaped
labels, ``# NOTE`` comments, a missing trailing newline, counters that the parser renames
``*_total``) is handled the way Prometheus itself handles it.

A field the scrape does not carry stays ``None``, never ``0``: dcgm-exporter exports only the
counters in its CSV, and its default CSV leaves the ECC counters commented out. "No DBE
counter" must not read as "no DBE".
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client.parser import text_string_to_metric_families

from recovery.telemetry._common import decode_clock_event_mask, normalize_pci_bus_id
from recovery.telemetry.errors import TelemetryParseError

__all__ = ["ExporterGpu", "ExporterScrape", "parse_dcgm_exporter"]

_LOG = logging.getLogger(__name__)
_TOOL: Final = "dcgm-exporter"

# DCGM field -> (ExporterGpu attribute, kind). Both names of the clock-event mask map to one
# attribute: DCGM renamed CLOCK_THROTTLE_REASONS to CLOCKS_EVENT_REASONS in 3.3.
_FIELDS: Final[dict[str, tuple[str, str]]] = {
    "DCGM_FI_DEV_XID_ERRORS": ("last_xid", "int"),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": ("ecc_sbe_volatile", "int"),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ("ecc_dbe_volatile", "int"),
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": ("ecc_sbe_aggregate", "int"),
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": ("ecc_dbe_aggregate", "int"),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": ("remapped_rows_correctable", "int"),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": ("remapped_rows_uncorrectable", "int"),
    "DCGM_FI_DEV_ROW_REMAP_PENDING": ("row_remap_pending", "bool"),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": ("row_remap_failure", "bool"),
    "DCGM_FI_DEV_GPU_TEMP": ("temperature_c", "float"),
    "DCGM_FI_DEV_MEMORY_TEMP": ("memory_temperature_c", "float"),
    "DCGM_FI_DEV_POWER_USAGE": ("power_w", "float"),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("pcie_replay_count", "int"),
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": ("clock_event_mask", "int"),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": ("clock_event_mask", "int"),
}


@dataclass(frozen=True)
class ExporterGpu:
    """One physical GPU as dcgm-exporter saw it; every reading is ``None`` when not exported.

    ``last_xid`` is DCGM's "value of the last Xid error encountered" (``0``: none since the
    exporter started), not a count. ``pci_bus_id`` is normalised (``0000:31:00.0``).
    """

    gpu: int | None
    uuid: str | None
    device: str | None
    pci_bus_id: str | None
    model_name: str | None
    hostname: str | None
    driver_version: str | None
    last_xid: int | None = None
    ecc_sbe_volatile: int | None = None
    ecc_dbe_volatile: int | None = None
    ecc_sbe_aggregate: int | None = None
    ecc_dbe_aggregate: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    row_remap_pending: bool | None = None
    row_remap_failure: bool | None = None
    temperature_c: float | None = None
    memory_temperature_c: float | None = None
    power_w: float | None = None
    pcie_replay_count: int | None = None
    clock_event_mask: int | None = None
    clock_event_reasons: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ExporterScrape:
    """All GPUs of one scrape, plus the health fields that came without any GPU label.

    ``unattributed`` names fields we read that appeared on an unlabelled series: they cannot
    be pinned on a GPU, so they are listed rather than guessed at or silently dropped.
    """

    gpus: tuple[ExporterGpu, ...]
    unattributed: tuple[str, ...] = ()


def _gpu_key(labels: dict[str, str]) -> tuple[str, str] | None:
    """Identity of the physical GPU a series belongs to: UUID first, then index, then device.

    MIG series (``GPU_I_ID``) carry the parent GPU's UUID and fold into it.
    """
    uuid = labels.get("UUID") or labels.get("uuid")
    if uuid:
        return ("uuid", uuid)
    if labels.get("gpu"):
        return ("gpu", labels["gpu"])
    if labels.get("device"):
        return ("device", labels["device"])
    return None


def _convert(field: str, kind: str, value: float, source: str) -> int | float | bool | None:
    if math.isnan(value):
        return None
    if kind == "float":
        return value
    if math.isinf(value) or value < 0 or value != int(value):
        raise TelemetryParseError(_TOOL, source, f"{field} is not a non-negative integer: {value}")
    if kind == "bool":
        return value != 0
    return int(value)


def _worse(current: Any, new: Any) -> Any:
    """Two readings of one field for one GPU (MIG instances): keep the worse, i.e. larger."""
    if current is None:
        return new
    if new is None:
        return current
    return max(current, new)


def parse_dcgm_exporter(text: str, *, source: str = "<text>") -> ExporterScrape:
    """Read a dcgm-exporter scrape into one :class:`ExporterGpu` per physical GPU.

    ``source`` (a path or URL) only names the input in errors. GPUs keep the order of their
    first series. Raises :class:`TelemetryParseError` when the text is not a valid Prometheus
    exposition or a counter holds a value no GPU can have.
    """
    identities: dict[tuple[str, str], dict[str, str]] = {}
    readings: dict[tuple[str, str], dict[str, Any]] = {}
    unattributed: set[str] = set()
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as err:
        raise TelemetryParseError(_TOOL, source, f"not a Prometheus exposition: {err}") from err
    for family in families:
        spec = _FIELDS.get(family.name)
        for sample in family.samples:
            key = _gpu_key(sample.labels)
            if key is None:
                if spec is not None:
                    unattributed.add(family.name)
                continue
            identity = identities.setdefault(key, {})
            for label, text_value in sample.labels.items():
                identity.setdefault(label, text_value)
            per_gpu = readings.setdefault(key, {})
            if spec is None:
                continue
            attr, kind = spec
            value = _convert(family.name, kind, float(sample.value), source)
            per_gpu[attr] = _worse(per_gpu.get(attr), value)
    gpus = tuple(_build_gpu(identities[key], readings[key], source) for key in identities)
    if unattributed:
        _LOG.info(
            "dcgm-exporter series without a GPU label",
            extra={"source": source, "fields": sorted(unattributed)},
        )
    return ExporterScrape(gpus=gpus, unattributed=tuple(sorted(unattributed)))


def _build_gpu(labels: dict[str, str], values: dict[str, Any], source: str) -> ExporterGpu:
    gpu_label = labels.get("gpu")
    try:
        gpu = int(gpu_label) if gpu_label else None
        pci = normalize_pci_bus_id(labels["pci_bus_id"]) if labels.get("pci_bus_id") else None
    except ValueError as err:
        raise TelemetryParseError(_TOOL, source, f"bad GPU label: {err}") from err
    mask = values.get("clock_event_mask")
    return ExporterGpu(
        gpu=gpu,
        uuid=labels.get("UUID") or labels.get("uuid"),
        device=labels.get("device"),
        pci_bus_id=pci,
        model_name=labels.get("modelName"),
        hostname=labels.get("Hostname"),
        driver_version=labels.get("DCGM_FI_DRIVER_VERSION"),
        clock_event_reasons=decode_clock_event_mask(mask) if mask is not None else None,
        **values,
    )
