"""botocore failures as the typed errors flows act on, shared by every AWS adapter.

One mapping so that HyperPod and S3 agree on what is worth retrying: throttling, 5xx and
connection failures are temporary; not-found, access-denied and bad requests are permanent. Each
service names its own error codes for those classes; the HTTP status decides the rest.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from botocore.exceptions import (
    ClientError,
    HTTPClientError,
    NoCredentialsError,
    ParamValidationError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from recovery.errors import (
    ConflictError,
    ForbiddenError,
    NotFoundError,
    PermanentError,
    RecoveryError,
    TemporaryError,
    ThrottledError,
)

__all__ = ["ServiceCodes", "from_botocore"]


@dataclass(frozen=True)
class ServiceCodes:
    """A service's error codes for each class; statuses (429, 404, 403, 409, 5xx) apply too."""

    throttling: Collection[str] = ()
    not_found: Collection[str] = ()
    forbidden: Collection[str] = ()
    conflict: Collection[str] = ()
    temporary: Collection[str] = ()
    conflict_statuses: Collection[int] = (409,)


def from_botocore(
    err: Exception, *, system: str, verb: str, target: str, codes: ServiceCodes
) -> RecoveryError:
    """Map ``err`` (after botocore's own retries) to the temporary/permanent split."""
    if isinstance(err, ClientError):
        code = str(err.response.get("Error", {}).get("Code", ""))
        status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        reason = f"{code or status}: {err.response.get('Error', {}).get('Message', err)}"
        if code in codes.throttling or status == 429:
            return ThrottledError(system, verb, target, reason)
        if code in codes.not_found or status == 404:
            return NotFoundError(system, verb, target, reason)
        if code in codes.forbidden or status == 403:
            return ForbiddenError(system, verb, target, reason)
        if code in codes.conflict or status in codes.conflict_statuses:
            return ConflictError(system, verb, target, reason)
        if status >= 500 or code in codes.temporary:
            return TemporaryError(system, verb, target, reason)
        return PermanentError(system, verb, target, reason)
    if isinstance(err, BotoConnectionError | HTTPClientError):
        return TemporaryError(system, verb, target, f"connection: {err}")
    if isinstance(err, NoCredentialsError):
        return ForbiddenError(system, verb, target, str(err))
    if isinstance(err, ParamValidationError):
        return PermanentError(system, verb, target, f"invalid request: {err}")
    return PermanentError(system, verb, target, f"{type(err).__name__}: {err}")
