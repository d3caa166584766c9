"""Memory health per GPU out of ``nvidia-smi -q -x`` (XML) and ``nvidia-smi -q`` (text).

Both formats land in one :class:`NvidiaSmiReport`. What matters for SDC triage is the memory
record: ECC counts (volatile = since the driver loaded, aggregate = over the board's life;
SRAM and DRAM split on Ampere and later), remapped rows (Ampere and later) and retired pages
(before Ampere). Values nvidia-smi cannot give (``N/A``, ``[Not Supported]``) become ``None``.
A bracketed error in place of a value (``[GPU requires reset]``, ``[Unknown Error]``) also
becomes ``None`` but is kept in :attr:`SmiGpu.unreadable`: a GPU that cannot report its own
counters is itself a finding.

The XML is parsed with :mod:`xml.etree.ElementTree`, whose expat backend does not fetch the
external DTD nvidia-smi names and refuses entity-expansion bombs.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

from recovery.telemetry._common import ClockEventReason, normalize_pci_bus_id
from recovery.telemetry.errors import TelemetryParseError
from recovery.telemetry.recovery_action import RecoveryAction, parse_recovery_action

__all__ = [
    "MigDevice",
    "NvidiaSmiReport",
    "SmiEcc",
    "SmiGpu",
    "SmiRemappedRows",
    "parse_nvidia_smi_text",
    "parse_nvidia_smi_xml",
]

_TOOL: Final = "nvidia-smi"
_ABSENT: Final = frozenset({"n/a", "[n/a]", "not supported", "[not supported]", "none", ""})
_NUMBER_RE: Final = re.compile(r"^(?P<n>[-+]?\d+(?:\.\d+)?)(?:\s*[A-Za-z%()/]+)*$")


@dataclass(frozen=True)
class SmiEcc:
    """ECC error counts for one period (volatile or aggregate).

    ``correctable`` and ``uncorrectable`` are the totals over SRAM and DRAM (or the pre-Ampere
    ``total`` row): the numbers DCGM calls SBE and DBE.
    """

    sram_correctable: int | None = None
    sram_uncorrectable: int | None = None
    dram_correctable: int | None = None
    dram_uncorrectable: int | None = None
    correctable: int | None = None
    uncorrectable: int | None = None


@dataclass(frozen=True)
class SmiRemappedRows:
    """Row remapper state (Ampere and later); all ``None`` where the GPU reports ``N/A``."""

    correctable: int | None = None
    uncorrectable: int | None = None
    pending: bool | None = None
    failure: bool | None = None


@dataclass(frozen=True)
class MigDevice:
    """One MIG instance; its volatile SRAM uncorrectable count is the only error it reports."""

    index: int | None
    gpu_instance_id: int | None
    compute_instance_id: int | None
    sram_uncorrectable_volatile: int | None


@dataclass(frozen=True)
class SmiGpu:
    """One GPU as nvidia-smi described it; ``index`` is its position in the output, which is
    NVML's enumeration order."""

    index: int
    uuid: str | None
    pci_bus_id: str | None
    product_name: str | None
    mig_enabled: bool | None = None
    ecc_enabled: bool | None = None
    ecc_volatile: SmiEcc = field(default_factory=SmiEcc)
    ecc_aggregate: SmiEcc = field(default_factory=SmiEcc)
    remapped_rows: SmiRemappedRows = field(default_factory=SmiRemappedRows)
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    clock_event_reasons: tuple[str, ...] | None = None
    mig_devices: tuple[MigDevice, ...] = ()
    unreadable: tuple[str, ...] = ()
    recovery_action: RecoveryAction | None = None
    """NVML's GPU Recovery Action (R570+); ``None`` where the driver has no such field."""
    reset_required: bool | None = None
    """``gpu_reset_status/reset_required`` (drivers 535 to 550; deprecated later)."""
    drain_and_reset_recommended: bool | None = None
    """``gpu_reset_status/drain_and_reset_recommended`` (drivers 535 to 550; deprecated later)."""


@dataclass(frozen=True)
class NvidiaSmiReport:
    """A whole ``nvidia-smi -q`` run. ``attached_gpus`` is what the header claims; when it
    exceeds ``len(gpus)`` the output was cut short (:attr:`complete` is false)."""

    driver_version: str | None
    cuda_version: str | None
    timestamp: str | None
    attached_gpus: int | None
    gpus: tuple[SmiGpu, ...]
    format: str

    @property
    def complete(self) -> bool:
        return self.attached_gpus is None or self.attached_gpus <= len(self.gpus)


class _Reader:
    """Turns nvidia-smi values into numbers, remembering bracketed errors per GPU."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.unreadable: list[str] = []

    def text(self, value: str | None) -> str | None:
        if value is None:
            return None
        value = " ".join(value.split())
        return None if value.lower() in _ABSENT else value

    def _usable(self, name: str, value: str | None) -> str | None:
        value = self.text(value)
        if value is not None and value.startswith("[") and value.endswith("]"):
            self.unreadable.append(f"{name}: {value}")
            return None
        return value

    def number(self, name: str, value: str | None) -> float | None:
        value = self._usable(name, value)
        if value is None:
            return None
        match = _NUMBER_RE.match(value)
        if match is None:
            raise TelemetryParseError(_TOOL, self.source, f"{name}: not a number: {value!r}")
        return float(match["n"])

    def count(self, name: str, value: str | None) -> int | None:
        number = self.number(name, value)
        if number is None:
            return None
        if number < 0 or number != int(number):
            raise TelemetryParseError(_TOOL, self.source, f"{name}: not a count: {number}")
        return int(number)

    def soft_flag(self, value: str | None) -> bool | None:
        """Yes/no where the field may also say it is deprecated: anything else is no reading."""
        lowered = (self.text(value) or "").lower()
        return {"yes": True, "no": False}.get(lowered)

    def flag(self, name: str, value: str | None) -> bool | None:
        value = self._usable(name, value)
        if value is None:
            return None
        lowered = value.lower()
        if lowered in ("yes", "enabled", "active"):
            return True
        if lowered in ("no", "disabled", "not active"):
            return False
        raise TelemetryParseError(_TOOL, self.source, f"{name}: not yes/no: {value!r}")


def _ecc(reader: _Reader, period: str, values: dict[str, str | None]) -> SmiEcc:
    """Build one period's counts from flattened ``name -> value`` pairs of either format."""

    def get(name: str) -> int | None:
        return reader.count(f"ecc {period} {name}", values.get(name))

    sram_corr = get("sram_correctable")
    sram_unc = get("sram_uncorrectable")
    parity = get("sram_uncorrectable_parity")
    secded = get("sram_uncorrectable_secded")
    if sram_unc is None and (parity is not None or secded is not None):
        sram_unc = (parity or 0) + (secded or 0)
    dram_corr = get("dram_correctable")
    dram_unc = get("dram_uncorrectable")
    correctable = _sum(sram_corr, dram_corr)
    uncorrectable = _sum(sram_unc, dram_unc)
    if correctable is None:
        correctable = get("single_bit_total")
    if uncorrectable is None:
        uncorrectable = get("double_bit_total")
    return SmiEcc(sram_corr, sram_unc, dram_corr, dram_unc, correctable, uncorrectable)


def _sum(*values: int | None) -> int | None:
    present = [value for value in values if value is not None]
    return sum(present) if present else None


def _reasons(pairs: Iterator[tuple[str, str | None]], reader: _Reader) -> tuple[str, ...] | None:
    """Active clock-event reasons from ``name -> Active/Not Active`` pairs; ``None`` if none
    were listed at all."""
    active: list[str] = []
    seen = False
    for name, value in pairs:
        seen = True
        if reader.flag(f"clock event {name}", value):
            active.append(_REASON_ALIASES.get(name, name))
    return tuple(active) if seen else None


_REASON_ALIASES: Final = {
    "idle": ClockEventReason.GPU_IDLE.value,
    "display_clock_setting": ClockEventReason.DISPLAY_CLOCKS_SETTING.value,
}


# --------------------------------------------------------------------------- XML (-q -x)


def _xml_text(element: ET.Element | None, path: str) -> str | None:
    if element is None:
        return None
    found = element.find(path)
    if found is None:
        return None
    return found.text if found.text is not None else ""


def _xml_children(element: ET.Element | None) -> dict[str, str | None]:
    if element is None:
        return {}
    return {child.tag: child.text for child in element}


def parse_nvidia_smi_xml(text: str, *, source: str = "<text>") -> NvidiaSmiReport:
    """Read ``nvidia-smi -q -x`` (DTD v11 and v12 seen) into a :class:`NvidiaSmiReport`."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as err:
        raise TelemetryParseError(_TOOL, source, f"invalid XML: {err}") from err
    if root.tag != "nvidia_smi_log":
        raise TelemetryParseError(
            _TOOL, source, f"root element is <{root.tag}>, not <nvidia_smi_log>"
        )
    header = _Reader(source)
    gpus = tuple(_xml_gpu(index, gpu, source) for index, gpu in enumerate(root.findall("gpu")))
    return NvidiaSmiReport(
        driver_version=header.text(_xml_text(root, "driver_version")),
        cuda_version=header.text(_xml_text(root, "cuda_version")),
        timestamp=header.text(_xml_text(root, "timestamp")),
        attached_gpus=header.count("attached_gpus", _xml_text(root, "attached_gpus")),
        gpus=gpus,
        format="xml",
    )


def _xml_gpu(index: int, gpu: ET.Element, source: str) -> SmiGpu:
    reader = _Reader(source)
    pci = reader.text(_xml_text(gpu, "pci/pci_bus_id")) or reader.text(gpu.get("id"))
    try:
        pci_bus_id = normalize_pci_bus_id(pci) if pci else None
    except ValueError as err:
        raise TelemetryParseError(_TOOL, source, str(err)) from err

    ecc = gpu.find("ecc_errors")
    volatile = _xml_ecc_values(ecc.find("volatile") if ecc is not None else None)
    aggregate = _xml_ecc_values(ecc.find("aggregate") if ecc is not None else None)

    remap = gpu.find("remapped_rows")
    remapped = SmiRemappedRows(
        correctable=reader.count("remapped_row_corr", _xml_text(remap, "remapped_row_corr")),
        uncorrectable=reader.count("remapped_row_unc", _xml_text(remap, "remapped_row_unc")),
        pending=reader.flag("remapped_row_pending", _xml_text(remap, "remapped_row_pending")),
        failure=reader.flag("remapped_row_failure", _xml_text(remap, "remapped_row_failure")),
    )

    reasons_element = gpu.find("clocks_event_reasons")
    prefix = "clocks_event_reason_"
    if reasons_element is None:
        reasons_element = gpu.find("clocks_throttle_reasons")
        prefix = "clocks_throttle_reason_"
    reason_pairs = (
        (child.tag.removeprefix(prefix), child.text)
        for child in (reasons_element if reasons_element is not None else ())
    )

    power = None
    for path in (
        "gpu_power_readings/power_draw",
        "power_readings/power_draw",
        "gpu_power_readings/average_power_draw",
        "power_readings/average_power_draw",
        "gpu_power_readings/instant_power_draw",
    ):
        power = reader.number(path, _xml_text(gpu, path))
        if power is not None:
            break

    return SmiGpu(
        index=index,
        uuid=reader.text(_xml_text(gpu, "uuid")),
        pci_bus_id=pci_bus_id,
        product_name=reader.text(_xml_text(gpu, "product_name")),
        mig_enabled=reader.flag("current_mig", _xml_text(gpu, "mig_mode/current_mig")),
        ecc_enabled=reader.flag("current_ecc", _xml_text(gpu, "ecc_mode/current_ecc")),
        ecc_volatile=_ecc(reader, "volatile", volatile),
        ecc_aggregate=_ecc(reader, "aggregate", aggregate),
        remapped_rows=remapped,
        retired_pages_sbe=reader.count(
            "retired sbe",
            _xml_text(gpu, "retired_pages/multiple_single_bit_retirement/retired_count"),
        ),
        retired_pages_dbe=reader.count(
            "retired dbe", _xml_text(gpu, "retired_pages/double_bit_retirement/retired_count")
        ),
        retired_pages_pending=reader.flag(
            "pending retirement", _xml_text(gpu, "retired_pages/pending_retirement")
        ),
        temperature_c=reader.number("gpu_temp", _xml_text(gpu, "temperature/gpu_temp")),
        power_w=power,
        clock_event_reasons=_reasons(reason_pairs, reader),
        mig_devices=tuple(
            _xml_mig(device, reader) for device in gpu.iterfind("mig_devices/mig_device")
        ),
        unreadable=tuple(reader.unreadable),
        recovery_action=parse_recovery_action(_xml_text(gpu, "gpu_recovery_action")),
        reset_required=reader.soft_flag(_xml_text(gpu, "gpu_reset_status/reset_required")),
        drain_and_reset_recommended=reader.soft_flag(
            _xml_text(gpu, "gpu_reset_status/drain_and_reset_recommended")
        ),
    )


def _xml_ecc_values(period: ET.Element | None) -> dict[str, str | None]:
    """Flatten one ECC period: Ampere+ has ``sram_*``/``dram_*`` leaves; older boards have
    ``single_bit``/``double_bit`` groups with a ``total`` leaf."""
    values = _xml_children(period)
    if period is not None:
        for group in ("single_bit", "double_bit"):
            values[f"{group}_total"] = _xml_text(period, f"{group}/total")
    return values


def _xml_mig(device: ET.Element, reader: _Reader) -> MigDevice:
    return MigDevice(
        index=reader.count("mig index", _xml_text(device, "index")),
        gpu_instance_id=reader.count("gpu_instance_id", _xml_text(device, "gpu_instance_id")),
        compute_instance_id=reader.count(
            "compute_instance_id", _xml_text(device, "compute_instance_id")
        ),
        sram_uncorrectable_volatile=reader.count(
            "mig sram_uncorrectable",
            _xml_text(device, "ecc_error_count/volatile_count/sram_uncorrectable"),
        ),
    )


# --------------------------------------------------------------------------- text (-q)


@dataclass
class _Node:
    key: str
    value: str | None
    children: list[_Node] = field(default_factory=list)

    def find(self, *path: str) -> _Node | None:
        node: _Node | None = self
        for key in path:
            if node is None:
                return None
            node = next((child for child in node.children if child.key == key), None)
        return node

    def value_at(self, *path: str) -> str | None:
        node = self.find(*path)
        return node.value if node is not None else None

    def walk(self) -> Iterator[_Node]:
        for child in self.children:
            yield child
            yield from child.walk()


_GPU_HEADER_RE: Final = re.compile(
    r"^GPU (?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d)\s*$"
)
_KEY_VALUE_RE: Final = re.compile(r"^(?P<key>[^:]+?)\s*:\s?(?P<value>.*)$")


def _text_tree(text: str) -> tuple[_Node, list[_Node]]:
    """The ``-q`` layout is an indented outline; build it as a tree, GPUs as top-level nodes."""
    header = _Node("header", None)
    gpus: list[_Node] = []
    stack: list[tuple[int, _Node]] = [(-1, header)]
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("==="):
            continue
        indent = len(line) - len(line.lstrip(" "))
        if indent == 0 and (match := _GPU_HEADER_RE.match(stripped)):
            node = _Node("GPU", match["pci"])
            gpus.append(node)
            stack = [(0, node)]
            continue
        kv = _KEY_VALUE_RE.match(stripped)
        node = _Node(kv["key"].strip(), kv["value"].strip()) if kv else _Node(stripped, None)
        while len(stack) > 1 and stack[-1][0] >= indent:
            stack.pop()
        stack[-1][1].children.append(node)
        stack.append((indent, node))
    return header, gpus


def _text_ecc_values(period: _Node | None) -> dict[str, str | None]:
    names = {
        "SRAM Correctable": "sram_correctable",
        "SRAM Uncorrectable": "sram_uncorrectable",
        "SRAM Uncorrectable Parity": "sram_uncorrectable_parity",
        "SRAM Uncorrectable SEC-DED": "sram_uncorrectable_secded",
        "DRAM Correctable": "dram_correctable",
        "DRAM Uncorrectable": "dram_uncorrectable",
    }
    if period is None:
        return {}
    values = {names[child.key]: child.value for child in period.children if child.key in names}
    values["single_bit_total"] = period.value_at("Single Bit", "Total")
    values["double_bit_total"] = period.value_at("Double Bit", "Total")
    return values


def parse_nvidia_smi_text(text: str, *, source: str = "<text>") -> NvidiaSmiReport:
    """Read plain ``nvidia-smi -q`` into a :class:`NvidiaSmiReport`.

    Output cut off mid-GPU still parses: the last GPU's missing sections stay ``None`` and
    :attr:`NvidiaSmiReport.complete` turns false when fewer GPUs than attached were described.
    """
    header, gpu_nodes = _text_tree(text)
    if header.find("Driver Version") is None and not gpu_nodes:
        raise TelemetryParseError(_TOOL, source, "no 'Driver Version' line and no GPU section")
    reader = _Reader(source)
    return NvidiaSmiReport(
        driver_version=reader.text(header.value_at("Driver Version")),
        cuda_version=reader.text(header.value_at("CUDA Version")),
        timestamp=reader.text(header.value_at("Timestamp")),
        attached_gpus=reader.count("Attached GPUs", header.value_at("Attached GPUs")),
        gpus=tuple(_text_gpu(index, node, source) for index, node in enumerate(gpu_nodes)),
        format="text",
    )


def _text_gpu(index: int, gpu: _Node, source: str) -> SmiGpu:
    reader = _Reader(source)
    pci = gpu.value_at("PCI", "Bus Id") or gpu.value
    try:
        pci_bus_id = normalize_pci_bus_id(pci) if pci else None
    except ValueError as err:
        raise TelemetryParseError(_TOOL, source, str(err)) from err
    ecc = gpu.find("ECC Errors")
    remap = gpu.find("Remapped Rows")
    reasons = gpu.find("Clocks Event Reasons") or gpu.find("Clocks Throttle Reasons")
    reason_pairs = (
        (node.key.lower().replace(" ", "_"), node.value)
        for node in (reasons.walk() if reasons is not None else iter(()))
    )
    power = reader.number("Power Draw", gpu.value_at("GPU Power Readings", "Power Draw"))
    if power is None:
        power = reader.number("Power Draw", gpu.value_at("Power Readings", "Power Draw"))
    return SmiGpu(
        index=index,
        uuid=reader.text(gpu.value_at("GPU UUID")),
        pci_bus_id=pci_bus_id,
        product_name=reader.text(gpu.value_at("Product Name")),
        mig_enabled=reader.flag("MIG Mode", gpu.value_at("MIG Mode", "Current")),
        ecc_enabled=reader.flag("ECC Mode", gpu.value_at("ECC Mode", "Current")),
        ecc_volatile=_ecc(
            reader, "volatile", _text_ecc_values(ecc.find("Volatile") if ecc else None)
        ),
        ecc_aggregate=_ecc(
            reader, "aggregate", _text_ecc_values(ecc.find("Aggregate") if ecc else None)
        ),
        remapped_rows=SmiRemappedRows(
            correctable=reader.count("Remapped Correctable", _value(remap, "Correctable Error")),
            uncorrectable=reader.count(
                "Remapped Uncorrectable", _value(remap, "Uncorrectable Error")
            ),
            pending=reader.flag("Remapped Pending", _value(remap, "Pending")),
            failure=reader.flag("Remapping Failure", _value(remap, "Remapping Failure Occurred")),
        ),
        retired_pages_sbe=reader.count(
            "Retired SBE", gpu.value_at("Retired Pages", "Single Bit ECC")
        ),
        retired_pages_dbe=reader.count(
            "Retired DBE", gpu.value_at("Retired Pages", "Double Bit ECC")
        ),
        retired_pages_pending=reader.flag(
            "Pending Page Blacklist", gpu.value_at("Retired Pages", "Pending Page Blacklist")
        ),
        temperature_c=reader.number(
            "GPU Current Temp", gpu.value_at("Temperature", "GPU Current Temp")
        ),
        power_w=power,
        clock_event_reasons=_reasons(reason_pairs, reader),
        unreadable=tuple(reader.unreadable),
        recovery_action=parse_recovery_action(gpu.value_at("GPU Recovery Action")),
        reset_required=reader.soft_flag(gpu.value_at("GPU Reset Status", "Reset Required")),
        drain_and_reset_recommended=reader.soft_flag(
            gpu.value_at("GPU Reset Status", "Drain and Reset Recommended")
        ),
    )


def _value(node: _Node | None, key: str) -> str | None:
    return node.value_at(key) if node is not None else None
