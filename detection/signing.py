"""Webhook request signing, shared by the alarm sender and the webhook.

Invariant: a request is accepted only if its HMAC-SHA256 over ``"<timestamp>.<raw body>"`` matches
under the shared secret *and* its timestamp lies within ``window_s`` of now. Signing the timestamp
with the body is what makes replay protection possible; comparing in constant time is what keeps
the signature from leaking byte by byte.
"""

from __future__ import annotations

import hashlib
import hmac
import time

__all__ = [
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "SignatureError",
    "sign",
    "signed_headers",
    "verify",
]

TIMESTAMP_HEADER = "X-SDCGuard-Timestamp"
SIGNATURE_HEADER = "X-SDCGuard-Signature"
_PREFIX = "sha256="


class SignatureError(Exception):
    """The request is unsigned, forged or stale; ``reason`` is safe to return to the caller."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _key(secret: str | bytes) -> bytes:
    return secret.encode() if isinstance(secret, str) else secret


def sign(secret: str | bytes, timestamp: int, body: bytes) -> str:
    mac = hmac.new(_key(secret), f"{timestamp}.".encode() + body, hashlib.sha256)
    return _PREFIX + mac.hexdigest()


def signed_headers(secret: str | bytes, body: bytes, now: float | None = None) -> dict[str, str]:
    ts = int(time.time() if now is None else now)
    return {TIMESTAMP_HEADER: str(ts), SIGNATURE_HEADER: sign(secret, ts, body)}


def verify(
    secret: str | bytes,
    timestamp_header: str | None,
    signature_header: str | None,
    body: bytes,
    now: float | None = None,
    window_s: int = 300,
) -> int:
    """Return the verified timestamp or raise :class:`SignatureError`."""
    if not timestamp_header or not signature_header:
        raise SignatureError("missing signature headers")
    try:
        ts = int(timestamp_header)
    except ValueError:
        raise SignatureError(f"{TIMESTAMP_HEADER} is not a unix timestamp") from None
    current = time.time() if now is None else now
    if abs(current - ts) > window_s:
        raise SignatureError(f"timestamp outside the ±{window_s} s window")
    if not signature_header.startswith(_PREFIX):
        raise SignatureError(f"{SIGNATURE_HEADER} must start with '{_PREFIX}'")
    if not hmac.compare_digest(sign(secret, ts, body), signature_header):
        raise SignatureError("signature does not match")
    return ts
