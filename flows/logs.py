"""Logging set-up of sdcguard's processes: JSON lines that keep the ``extra=`` context.

Every log call in sdcguard passes its context in ``extra`` (``job``, ``incident``, ``rank``,
``node``, ``step``, …). The plain ``%(message)s`` format drops it, so in production
(``SDCGUARD_LOG_FORMAT=json``, the container default) each record is one JSON object with the
time, level, logger, message and every extra field, as python-json-logger renders them — what a
log pipeline can filter by incident or node. ``text`` keeps the human format for terminals.

Processes Prefect starts (a worker, and each flow run it launches) configure logging from
Prefect's own settings before any sdcguard code runs, so they get JSON through
``PREFECT_LOGGING_SETTINGS_PATH`` = :data:`PREFECT_LOGGING_CONFIG`, a copy of Prefect's default
configuration whose console handler uses :func:`json_formatter` (set in the work pool's
environment; prefect.yaml and the image do).

Invariant: :func:`configure_logging` is idempotent — calling it again replaces our handler,
never adds a second one (no duplicated lines).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Final, TextIO

from pythonjsonlogger.json import JsonFormatter

__all__ = [
    "CONTEXT_FIELDS",
    "LOG_FORMAT_ENV",
    "PREFECT_LOGGING_CONFIG",
    "configure_logging",
    "json_formatter",
]

LOG_FORMAT_ENV = "SDCGUARD_LOG_FORMAT"
CONTEXT_FIELDS = ("job", "incident", "rank", "node", "step")
_MARK = "_sdcguard_handler"
PREFECT_LOGGING_CONFIG: Final = Path(__file__).with_name("prefect-logging.yaml")
"""Prefect's logging configuration with JSON console lines (``PREFECT_LOGGING_SETTINGS_PATH``)."""


def json_formatter() -> logging.Formatter:
    """One JSON object per record: ``time``, ``level``, ``logger``, ``message`` + extras."""
    return JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        timestamp=False,
    )


def configure_logging(
    fmt: str | None = None, *, level: int = logging.INFO, stream: TextIO | None = None
) -> logging.Handler:
    """Install sdcguard's handler on the root logger; ``fmt`` ``json`` or ``text`` (default:
    ``$SDCGUARD_LOG_FORMAT``, else ``text``). Returns the handler."""
    chosen = (fmt or os.environ.get(LOG_FORMAT_ENV) or "text").strip().lower()
    if chosen not in ("json", "text"):
        raise ValueError(f"{LOG_FORMAT_ENV} must be json or text, not {chosen!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(
        json_formatter()
        if chosen == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    setattr(handler, _MARK, True)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _MARK, False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return handler
