"""Errors of the telemetry package, placed in the :mod:`recovery.errors` hierarchy.

A parse error is permanent: the same bytes will never parse on a retry, so flows must not
spend their retry budget on it. A tool that ran but reported that it could not do its job
(``dcgmi diag`` with a ``runtime_error``) is temporary: the host engine may be back a minute
later. The collectors catch both per tool and record them in the snapshot's sources, so one
broken tool never hides what the others said.
"""

from __future__ import annotations

from recovery.errors import PermanentError, TemporaryError

__all__ = ["TelemetryParseError", "TelemetryToolError"]


class TelemetryParseError(PermanentError):
    """A tool's output is not in the format we read; ``system`` names the tool."""

    def __init__(self, tool: str, source: str, reason: str) -> None:
        super().__init__(tool, "parse", source, reason)


class TelemetryToolError(TemporaryError):
    """A tool ran but said it could not produce a result (it names its own error)."""

    def __init__(self, tool: str, target: str, reason: str) -> None:
        super().__init__(tool, "run", target, reason)
