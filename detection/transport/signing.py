"""Webhook request signing, shared by the alarm sender and the webhook.

A request is signed *as what it is*: the HMAC-SHA256 covers a canonical request built from the
method, the path, the query, a SHA-256 of the raw body, the timestamp, the key id and a
per-request nonce (DESIGN "Webhook signing")::

    SDCGUARD-HMAC-SHA256
    POST
    /v1/jobs/job-1/audits
    <canonical query: name=value pairs, percent-encoded, sorted, joined by &>
    <hex SHA-256 of the raw body>
    <unix seconds>
    <key id>
    <nonce>

Invariants: a signature made for one path, query, method, key or body verifies for no other
(so a signed audit of job A replayed to job B's path is refused); it verifies only within
``window_s`` of its timestamp, and the nonce lets the receiver refuse a second use inside that
window; signatures are compared in constant time, so they cannot be guessed byte by byte.
The key id names the secret that signed; the receiver looks it up and never trusts the claim
without the matching HMAC.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, unquote

__all__ = [
    "ALGORITHM",
    "DEFAULT_KEY_ID",
    "KEY_ID_HEADER",
    "NONCE_HEADER",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "SignatureError",
    "SignedRequest",
    "canonical_path",
    "canonical_query",
    "canonical_request",
    "sign",
    "signed_headers",
    "verify",
]

TIMESTAMP_HEADER = "X-SDCGuard-Timestamp"
SIGNATURE_HEADER = "X-SDCGuard-Signature"
KEY_ID_HEADER = "X-SDCGuard-Key-Id"
NONCE_HEADER = "X-SDCGuard-Nonce"
ALGORITHM = "SDCGUARD-HMAC-SHA256"
DEFAULT_KEY_ID = "default"
_PREFIX = "sha256="
_KEY_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@+=-]{0,127}$")
_NONCE = re.compile(r"^[A-Za-z0-9_-]{16,64}$")
# RFC 3986 unreserved characters stay as they are; everything else is percent-encoded.
_UNRESERVED = "-_.~"


class SignatureError(Exception):
    """The request is unsigned, forged or stale; ``reason`` is safe to return to the caller."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class SignedRequest:
    """What a verified signature vouches for: who signed, when, and the request's nonce."""

    key_id: str
    timestamp: int
    nonce: str


def _key(secret: str | bytes) -> bytes:
    return secret.encode() if isinstance(secret, str) else secret


def canonical_path(path: str) -> str:
    """The path as signed: percent-decoded once, then re-encoded the one RFC 3986 way.

    Sender and receiver may see the same path spelled differently (``%2D`` or ``-``); both
    sides sign this form, so the spelling never breaks a signature and never lets two
    different paths share one.
    """
    return quote(unquote(path or "/"), safe="/" + _UNRESERVED)


def canonical_query(query: str) -> str:
    """The query as signed: pairs decoded, sorted, re-encoded; empty for no query."""
    pairs = parse_qsl(query, keep_blank_values=True)
    return "&".join(
        f"{quote(name, safe=_UNRESERVED)}={quote(value, safe=_UNRESERVED)}"
        for name, value in sorted(pairs)
    )


def canonical_request(
    method: str, path: str, query: str, body: bytes, timestamp: int, key_id: str, nonce: str
) -> bytes:
    """The exact bytes the HMAC covers (see the module docstring)."""
    return "\n".join(
        (
            ALGORITHM,
            method.upper(),
            canonical_path(path),
            canonical_query(query),
            hashlib.sha256(body).hexdigest(),
            str(timestamp),
            key_id,
            nonce,
        )
    ).encode()


def sign(
    secret: str | bytes,
    method: str,
    target: str,
    body: bytes,
    *,
    timestamp: int,
    key_id: str,
    nonce: str,
) -> str:
    """``sha256=<hex>`` over the canonical request; ``target`` is the path with its query."""
    path, _, query = target.partition("?")
    message = canonical_request(method, path, query, body, timestamp, key_id, nonce)
    return _PREFIX + hmac.new(_key(secret), message, hashlib.sha256).hexdigest()


def signed_headers(
    key_id: str,
    secret: str | bytes,
    method: str,
    target: str,
    body: bytes = b"",
    *,
    now: float | None = None,
    nonce: str | None = None,
) -> dict[str, str]:
    """The four headers of a signed request to ``target`` (path and query, as sent).

    A fresh nonce per call: each attempt of a retried request is a new request to the
    receiver's replay store, so a retry after a lost answer is never refused as a replay.
    """
    if not _KEY_ID.match(key_id):
        raise ValueError(f"key id {key_id!r} is not 1-128 characters of [A-Za-z0-9_.:@+=-]")
    ts = int(time.time() if now is None else now)
    request_nonce = nonce or uuid.uuid4().hex
    return {
        TIMESTAMP_HEADER: str(ts),
        KEY_ID_HEADER: key_id,
        NONCE_HEADER: request_nonce,
        SIGNATURE_HEADER: sign(
            secret, method, target, body, timestamp=ts, key_id=key_id, nonce=request_nonce
        ),
    }


def verify(
    secret_of: Callable[[str], bytes | None],
    headers: Mapping[str, str],
    method: str,
    target: str,
    body: bytes,
    *,
    now: float | None = None,
    window_s: int = 300,
) -> SignedRequest:
    """Check the signature headers of a request; return what they vouch for.

    ``secret_of`` maps a key id to its secret (``None``: unknown key). Raises
    :class:`SignatureError` with a reason safe to send back. The nonce is only checked for
    form here: refusing its second use is the receiver's replay store's job.
    """
    ts_text, key_id = headers.get(TIMESTAMP_HEADER), headers.get(KEY_ID_HEADER)
    nonce, signature = headers.get(NONCE_HEADER), headers.get(SIGNATURE_HEADER)
    if not ts_text or not signature or not key_id or not nonce:
        raise SignatureError(
            f"missing signature headers ({TIMESTAMP_HEADER}, {KEY_ID_HEADER}, "
            f"{NONCE_HEADER}, {SIGNATURE_HEADER})"
        )
    if not ts_text.isascii() or not ts_text.isdigit():
        raise SignatureError(f"{TIMESTAMP_HEADER} is not a unix timestamp")
    ts = int(ts_text)
    current = time.time() if now is None else now
    if abs(current - ts) > window_s:
        raise SignatureError(f"timestamp outside the ±{window_s} s window")
    if not _KEY_ID.match(key_id):
        raise SignatureError(f"{KEY_ID_HEADER} is malformed")
    if not _NONCE.match(nonce):
        raise SignatureError(f"{NONCE_HEADER} must be 16-64 characters of [A-Za-z0-9_-]")
    if not signature.isascii() or not signature.startswith(_PREFIX):
        raise SignatureError(f"{SIGNATURE_HEADER} must start with '{_PREFIX}'")
    secret = secret_of(key_id)
    # An unknown key id is checked against a throwaway key, so the answer takes as long as a
    # wrong signature and says the same: the caller learns nothing about which ids exist.
    expected = sign(
        secret if secret is not None else b"\x00" * 32,
        method,
        target,
        body,
        timestamp=ts,
        key_id=key_id,
        nonce=nonce,
    )
    if not hmac.compare_digest(expected, signature) or secret is None:
        raise SignatureError("signature does not match")
    return SignedRequest(key_id=key_id, timestamp=ts, nonce=nonce)
