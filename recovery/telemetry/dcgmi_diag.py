"""Per-test, per-GPU results out of ``dcgmi diag -r N -j``.

Three layouts are read, all keyed ``test_categories -> tests -> results``:

* ``"DCGM GPU Diagnostic"`` with ``"version": "1.7"``: a result names its GPUs in
  ``gpu_ids`` as a string (``"0,1,2,3"``); ``warnings`` are objects with ``error_id``.
* ``"DCGM GPU Diagnostic"`` from DCGM 3.x: the same, but ``tests`` holds ``null`` entries and
  ``gpu_ids`` may be a bare integer.
* ``"DCGM Diagnostic"`` from DCGM 4.x: a result names one entity (``entity_group`` "GPU",
  ``entity_id``); statuses may be capitalised ("Pass"); a ``runtime_error`` means the run
  never happened. Read from NVIDIA's published schema; no captured 4.x output was available.

A result covering several GPUs is split into one :class:`DiagResult` per GPU, so a caller can
always ask "what did GPU 2 do in ``sm_stress``". ``dcgmi`` may print text before the JSON
(NVIDIA's own test feeds it ``WARNING: ...`` lines); everything before the first ``{`` is
skipped.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from recovery.telemetry.errors import TelemetryParseError, TelemetryToolError

__all__ = ["DiagReport", "DiagResult", "DiagStatus", "DiagWarning", "parse_dcgmi_diag"]

_TOOL: Final = "dcgmi-diag"


class DiagStatus(enum.StrEnum):
    """Outcome of one diagnostic test on one entity, as ``dcgmi`` reports it."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


# Worst first wins the overall result; a skipped test neither passes nor fails a GPU.
_RANK: Final = {DiagStatus.SKIP: 0, DiagStatus.PASS: 1, DiagStatus.WARN: 2, DiagStatus.FAIL: 3}


@dataclass(frozen=True)
class DiagWarning:
    """One message attached to a result; the numeric codes are DCGM's ``dcgmError_t`` fields."""

    text: str
    error_id: int | None = None
    error_category: int | None = None
    error_severity: int | None = None


@dataclass(frozen=True)
class DiagResult:
    """One test on one entity. ``entity_group`` is "GPU" for everything DCGM 3.x reports."""

    category: str
    test: str
    entity_group: str
    entity_id: int | None
    status: DiagStatus
    warnings: tuple[DiagWarning, ...] = ()
    info: tuple[str, ...] = ()

    @property
    def gpu(self) -> int | None:
        """The DCGM GPU id, or ``None`` for a non-GPU entity (4.x can test CPUs, switches)."""
        return self.entity_id if self.entity_group == "GPU" else None

    @property
    def message(self) -> str:
        """The warning texts joined: what an operator reads next to a FAIL."""
        return "; ".join(warning.text for warning in self.warnings)


@dataclass(frozen=True)
class DiagReport:
    """A whole ``dcgmi diag`` run; ``overall`` is the worst status among the results."""

    version: str | None
    layout: str
    results: tuple[DiagResult, ...]
    overall: DiagStatus

    def failures(self) -> tuple[DiagResult, ...]:
        return tuple(result for result in self.results if result.status is DiagStatus.FAIL)

    def for_gpu(self, gpu: int) -> tuple[DiagResult, ...]:
        return tuple(result for result in self.results if result.gpu == gpu)


def parse_dcgmi_diag(text: str, *, source: str = "<text>") -> DiagReport:
    """Read ``dcgmi diag -j`` output (any layout above) into a :class:`DiagReport`.

    Raises :class:`TelemetryParseError` for text that is not one of the layouts, and
    :class:`TelemetryToolError` when the JSON says the diagnostic could not run.
    """
    document = _load_json(text, source)
    if "DCGM Diagnostic" in document:
        body = document["DCGM Diagnostic"]
        layout = "DCGM Diagnostic"
        metadata = document.get("metadata")
        version = metadata.get("version") if isinstance(metadata, dict) else None
    elif "DCGM GPU Diagnostic" in document:
        body = document["DCGM GPU Diagnostic"]
        layout = "DCGM GPU Diagnostic"
        version = None
    else:
        raise TelemetryParseError(
            _TOOL, source, f"no 'DCGM Diagnostic' section; top-level keys {sorted(document)}"
        )
    if not isinstance(body, dict):
        raise TelemetryParseError(_TOOL, source, f"{layout!r} is not an object")
    version = version if version is not None else body.get("version")
    runtime_error = body.get("runtime_error")
    if runtime_error:
        raise TelemetryToolError(_TOOL, source, f"dcgmi diag did not run: {runtime_error}")
    categories = body.get("test_categories")
    if not isinstance(categories, list):
        raise TelemetryParseError(_TOOL, source, "'test_categories' is missing or not a list")
    results = tuple(_results(categories, source))
    overall = max((result.status for result in results), key=_RANK.__getitem__, default=None)
    return DiagReport(
        version=str(version) if version is not None else None,
        layout=layout,
        results=results,
        overall=overall if overall is not None else DiagStatus.SKIP,
    )


def _load_json(text: str, source: str) -> dict[str, Any]:
    start = text.find("{")
    if start < 0:
        raise TelemetryParseError(_TOOL, source, "no JSON object in the output")
    try:
        document, _ = json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError as err:
        raise TelemetryParseError(_TOOL, source, f"invalid JSON: {err}") from err
    if not isinstance(document, dict):
        raise TelemetryParseError(_TOOL, source, "the JSON document is not an object")
    return document


def _results(categories: list[Any], source: str) -> Iterator[DiagResult]:
    for category in categories:
        if not isinstance(category, dict):
            raise TelemetryParseError(
                _TOOL, source, f"a test category is not an object: {category!r}"
            )
        category_name = str(category.get("category", ""))
        for test in category.get("tests") or ():
            if test is None:  # DCGM 3.x really emits these between tests
                continue
            if not isinstance(test, dict) or "name" not in test:
                raise TelemetryParseError(
                    _TOOL, source, f"a test is not an object with a name: {test!r}"
                )
            for result in test.get("results") or ():
                yield from _split(category_name, str(test["name"]), result, source)


def _split(category: str, test: str, result: Any, source: str) -> Iterator[DiagResult]:
    where = f"{category}/{test}"
    if not isinstance(result, dict):
        raise TelemetryParseError(_TOOL, source, f"{where}: a result is not an object")
    status = _status(result.get("status"), where, source)
    warnings = tuple(_warning(item, where, source) for item in result.get("warnings") or ())
    info = tuple(str(item) for item in result.get("info") or ())
    if "entity_group" in result or "entity_id" in result:
        group = str(result.get("entity_group", "GPU"))
        yield DiagResult(
            category,
            test,
            group,
            _int(result.get("entity_id"), where, source),
            status,
            warnings,
            info,
        )
        return
    gpu_ids = result.get("gpu_ids", result.get("gpu_id"))
    for gpu in _gpu_ids(gpu_ids, where, source):
        yield DiagResult(category, test, "GPU", gpu, status, warnings, info)


def _status(value: Any, where: str, source: str) -> DiagStatus:
    try:
        return DiagStatus(str(value).strip().lower())
    except ValueError as err:
        raise TelemetryParseError(_TOOL, source, f"{where}: unknown status {value!r}") from err


def _warning(item: Any, where: str, source: str) -> DiagWarning:
    if isinstance(item, str):
        return DiagWarning(text=item)
    if isinstance(item, dict) and "warning" in item:
        return DiagWarning(
            text=str(item["warning"]),
            error_id=_int(item.get("error_id"), where, source),
            error_category=_int(item.get("error_category"), where, source),
            error_severity=_int(item.get("error_severity"), where, source),
        )
    raise TelemetryParseError(_TOOL, source, f"{where}: unreadable warning {item!r}")


def _int(value: Any, where: str, source: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TelemetryParseError(_TOOL, source, f"{where}: not an integer: {value!r}")
    try:
        return int(value)
    except ValueError as err:
        raise TelemetryParseError(_TOOL, source, f"{where}: not an integer: {value!r}") from err


def _gpu_ids(value: Any, where: str, source: str) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, str) and value.strip():
        parsed = [_int(part.strip(), where, source) for part in value.split(",")]
        return [gpu for gpu in parsed if gpu is not None]
    raise TelemetryParseError(_TOOL, source, f"{where}: unreadable gpu_ids {value!r}")
