"""Errors raised by the adapters to outside systems.

The split that matters to callers is temporary vs permanent: flows retry a
:class:`TemporaryError` with backoff (throttling, 409 conflicts, connection resets) and stop on a
:class:`PermanentError` (404, 403, validation). Every error names the system, the verb and the
target so an operator can act on the message alone.
"""

from __future__ import annotations

__all__ = [
    "ConflictError",
    "ForbiddenError",
    "NotFoundError",
    "PermanentError",
    "RecoveryError",
    "TemporaryError",
    "ThrottledError",
]


class RecoveryError(Exception):
    """An action on an outside system failed."""

    def __init__(self, system: str, verb: str, target: str, reason: str) -> None:
        super().__init__(f"{system}: {verb} {target}: {reason}")
        self.system = system
        self.verb = verb
        self.target = target
        self.reason = reason


class TemporaryError(RecoveryError):
    """Worth retrying with backoff: the same call may succeed later."""


class PermanentError(RecoveryError):
    """Retrying the same call cannot help."""


class ConflictError(TemporaryError):
    """An optimistic-concurrency conflict (HTTP 409, resourceVersion) left after our own retries."""


class ThrottledError(TemporaryError):
    """The outside system asked us to slow down (429, ThrottlingException) past our own retries."""


class NotFoundError(PermanentError):
    """The target does not exist (HTTP 404, unknown instance)."""


class ForbiddenError(PermanentError):
    """We are not allowed to do this (HTTP 403, AccessDenied)."""
