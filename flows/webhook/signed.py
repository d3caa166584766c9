"""The signed route: what every POST passes before FastAPI may look at its body.

Order of checks, each one before the next is allowed to look at the body:

1. size — ``Content-Length`` over the limit, or a streamed body growing past it: 413, the rest
   read and dropped within a bound so that the sender can read the answer, never buffered (an
   unauthenticated caller cannot make us hold or read an unbounded body);
2. authentication — the canonical-request HMAC over method, path, query and the *raw* bytes
   (``detection.transport.signing.verify``, constant time, the key looked up by its id), or a bearer
   token (reader token or Kubernetes service-account token) with a fresh timestamp and nonce:
   401 with the reason, nothing parsed, nothing written;
3. JSON — UTF-8, no duplicate keys, no NaN/Infinity, bounded nesting, no NUL or lone surrogate
   in any string or key (the ledger's PostgreSQL cannot store them): 400 for a body that is not
   JSON at all or repeats a key, 422 naming the offending string;
4. schema — FastAPI then validates the parsed value against the endpoint's pydantic model
   (:mod:`flows.webhook.models`): 422 naming the field.

The endpoint then calls :func:`admit` before it writes: the caller's scope must cover the job
(403), and the request's nonce is claimed in the nonce store (401 on a second use). The alarm
endpoint calls :func:`authorize` instead (the same checks without the claim) and hands the
nonce to the alarm batch, which claims it in the transaction that records the alarm. Reads use
:func:`authenticate_read`: the same signature (empty body) or a bearer token, ``reader`` role.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, NoReturn

import anyio
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect
from starlette.types import Scope

from detection.transport.signing import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    SignatureError,
    verify,
)
from flows.webhook.auth import Credentials, Principal, Role, uri_under_prefix
from flows.webhook.batcher import InThread
from flows.webhook.nonces import NonceStore
from recovery.errors import RecoveryError

__all__ = [
    "Caller",
    "Guard",
    "Refused",
    "admit",
    "authenticate_read",
    "authorize",
    "check_checkpoint_uri",
    "printable",
    "signed_route_class",
]

logger = logging.getLogger(__name__)

_MAX_JSON_DEPTH = 32
# What a refused body is still read for (and dropped), so its sender gets the 413: see
# _read_bounded. Beyond either bound the connection is closed unread.
_DRAIN_MAX_BYTES = 64 << 20
_DRAIN_MAX_S = 10.0


class Refused(Exception):
    """A request refused before it wrote anything; ``reason`` goes back to the caller."""

    def __init__(self, status: int, reason: str, *, retry_after_s: int = 1) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.retry_after_s = retry_after_s  # a 429's Retry-After


class _VerifiedRequest(Request):
    """A request whose body was already read, size-checked, verified and parsed.

    FastAPI then validates the parsed value against the endpoint's model as usual.
    """

    def __init__(self, scope: Scope, body: bytes, parsed: Any) -> None:
        super().__init__(scope)
        self._verified_body = body
        self._verified_json = parsed

    async def body(self) -> bytes:
        return self._verified_body

    async def json(self) -> Any:
        return self._verified_json


@dataclass(frozen=True)
class Guard:
    """What the signed route checks against: the credentials, the body limit, the clock
    window; ``in_thread`` runs a TokenReview off the event loop."""

    credentials: Credentials
    max_body_bytes: int
    window_s: int
    in_thread: InThread


@dataclass(frozen=True)
class Caller:
    """An authenticated request: who sent it, and the nonce the nonce store must see once."""

    principal: Principal
    nonce: str | None
    key_id: str


def printable(text: str, limit: int = 64) -> str:
    """``text`` safe for any JSON answer or log line: lone surrogates escaped, cut short."""
    return text[:limit].encode("utf-8", "backslashreplace").decode("utf-8")


def _bearer(request: Request) -> str | None:
    value = request.headers.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Refused(401, "Authorization must be 'Bearer <token>'")
    return token.strip()


def _target(request: Request) -> str:
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


async def _authenticate(request: Request, body: bytes, guard: Guard, *, need_nonce: bool) -> Caller:
    """Who sent ``request``: a signing key, or a bearer token; :class:`Refused` (401) if none."""
    if request.headers.get(SIGNATURE_HEADER) is not None:
        try:
            signed = verify(
                guard.credentials.secret_of,
                request.headers,
                request.method,
                _target(request),
                body,
                window_s=guard.window_s,
            )
        except SignatureError as err:
            raise Refused(401, err.reason) from err
        principal = guard.credentials.key_principal(signed.key_id)
        return Caller(principal, signed.nonce, signed.key_id)
    token = _bearer(request)
    if token is None:
        raise Refused(401, f"unsigned request: sign it ({SIGNATURE_HEADER}) or send a bearer token")
    nonce: str | None = None
    if need_nonce:  # a bearer POST must still be fresh and unique
        try:
            verify_fresh(request, guard.window_s)
        except SignatureError as err:
            raise Refused(401, err.reason) from err
        nonce = request.headers.get(NONCE_HEADER)
    try:
        found = await guard.in_thread(lambda: guard.credentials.bearer_principal(token))
    except RecoveryError as err:  # the API server could not answer: the caller retries
        logger.error("TokenReview failed: %s", err, extra={"error": type(err).__name__})
        raise Refused(503, "cannot check the token now; retry later") from err
    if found is None:
        raise Refused(401, "bearer token not accepted")
    return Caller(found, nonce, found.name[:255])


def verify_fresh(request: Request, window_s: int) -> None:
    """A bearer POST's timestamp and nonce headers: present, well-formed, inside the window."""
    ts = request.headers.get(TIMESTAMP_HEADER) or ""
    nonce = request.headers.get(NONCE_HEADER) or ""
    if not ts.isascii() or not ts.isdigit():
        raise SignatureError(f"{TIMESTAMP_HEADER} is missing or not a unix timestamp")
    if abs(time.time() - int(ts)) > window_s:
        raise SignatureError(f"timestamp outside the ±{window_s} s window")
    if not re.fullmatch(r"[A-Za-z0-9_-]{16,64}", nonce):
        raise SignatureError(f"{NONCE_HEADER} must be 16-64 characters of [A-Za-z0-9_-]")


async def authenticate_read(request: Request, guard: Guard) -> Principal:
    """The ``reader`` behind a GET (signed with an empty body, or a bearer token)."""
    caller = await _authenticate(request, b"", guard, need_nonce=False)
    if Role.READER not in caller.principal.roles:
        raise Refused(403, f"{printable(caller.principal.name)} may not read")
    return caller.principal


REPLAYED = "replayed request: this nonce was used before"


def authorize(request: Request, job_id: str, *, checkpoint_uri: str | None = None) -> Caller:
    """The caller of the signed request, if it may write for ``job_id``; else :class:`Refused`.

    403 when the caller may not write for that job (or ``checkpoint_uri`` lies outside the
    job's prefix). The nonce is not claimed here: the caller claims ``Caller.nonce`` in the
    transaction of its write (the alarm batch), or calls :func:`admit`.
    """
    caller = request.state.caller
    assert isinstance(caller, Caller)
    principal = caller.principal
    if Role.WRITER not in principal.roles:
        raise Refused(403, f"{printable(principal.name)} may not write")
    if not principal.covers(job_id):
        raise Refused(403, f"{printable(principal.name)} may not write for job {job_id}")
    if checkpoint_uri is not None:
        check_checkpoint_uri(principal, job_id, checkpoint_uri)
    return caller


async def admit(
    request: Request, job_id: str, nonces: NonceStore, *, checkpoint_uri: str | None = None
) -> Principal:
    """Let the signed request write for ``job_id``, or raise :class:`Refused`.

    :func:`authorize`'s 403s, then 401 when its nonce was used before (claimed in the replay
    store, in a transaction of its own). Called by each endpoint after its body validated and
    before its first write.
    """
    caller = authorize(request, job_id, checkpoint_uri=checkpoint_uri)
    if caller.nonce is not None and not await nonces.claim(caller.nonce, caller.key_id):
        raise Refused(401, REPLAYED)
    return caller.principal


def check_checkpoint_uri(principal: Principal, job_id: str, uri: str) -> None:
    """403 unless ``uri`` lies under the checkpoint prefix the caller's key sets for the job."""
    prefix = principal.prefix_for(job_id)
    if prefix is not None and not uri_under_prefix(uri, prefix):
        raise Refused(403, f"checkpoint URI must lie under {prefix}")


async def _read_bounded(request: Request, limit: int) -> bytes:
    """The body, at most ``limit`` bytes; 413 past it, once the rest has been drained.

    Most HTTP clients send the whole body before they read the answer. Closing the connection
    on unread input makes the kernel answer with a reset, and such a client never sees the 413
    (from ~4 MiB on loopback): so a refused body is read on and dropped, at most
    ``_DRAIN_MAX_BYTES`` and ``_DRAIN_MAX_S``, before the answer. Past either bound — or for a
    ``Content-Length`` past the byte bound — it is refused at once: what an unauthenticated
    caller can make us read stays bounded, and nothing refused is ever buffered.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise Refused(400, "Content-Length is not a number")
        if int(declared) > limit:
            refused = Refused(413, f"body of {declared} bytes is over the {limit}-byte limit")
            if int(declared) <= _DRAIN_MAX_BYTES:
                await _drain(request, 0)
            raise refused
    chunks: list[bytes] = []
    size = 0
    stream = request.stream()
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            await _drain(request, size, stream)
            raise Refused(413, f"body is over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


async def _drain(request: Request, size: int, stream: AsyncIterator[bytes] | None = None) -> None:
    """Read and drop the rest of a refused body, within the drain bounds (see above)."""
    with anyio.move_on_after(_DRAIN_MAX_S), contextlib.suppress(ClientDisconnect):
        async for chunk in stream if stream is not None else request.stream():
            size += len(chunk)
            if size > _DRAIN_MAX_BYTES:
                return


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(f"duplicate key {printable(key)!r}")


def _parse_json(body: bytes) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise Refused(400, f"body is not UTF-8 text (byte {err.start}: {err.reason})") from err
    try:
        return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as err:
        raise Refused(
            400, f"body is not valid JSON: {err.msg} (line {err.lineno}, column {err.colno})"
        ) from err
    except RecursionError as err:
        raise Refused(400, "body is not valid JSON: nested too deeply") from err
    except _DuplicateKey as err:  # last-one-wins would let a signed body mean two things
        raise Refused(400, f"body is not valid JSON for this API: {err}") from err
    except ValueError as err:  # from _no_constant
        raise Refused(400, f"body is not valid JSON: {err}") from err


def _check_storable(value: Any) -> None:
    """Refuse what PostgreSQL cannot store (NUL, lone surrogates) and absurd nesting, by location.

    ``json.loads`` accepts ``"\\u0000"`` and ``"\\ud800"``; PostgreSQL refuses both in text and
    jsonb, which would surface as a 500 after the request was accepted.
    """
    stack: list[tuple[Any, tuple[int | str, ...]]] = [(value, ("body",))]
    while stack:
        item, loc = stack.pop()
        if len(loc) > _MAX_JSON_DEPTH + 1:
            _invalid(loc, "json_too_deep", f"nested deeper than {_MAX_JSON_DEPTH} levels")
        if isinstance(item, str):
            _check_text(item, loc)
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, (*loc, key))
                stack.append((child, (*loc, key)))
        elif isinstance(item, list):
            stack.extend((child, (*loc, i)) for i, child in enumerate(item))
        elif isinstance(item, float) and not math.isfinite(item):
            _invalid(loc, "finite_number", "number is out of range")


def _check_text(text: str, loc: tuple[int | str, ...]) -> None:
    if "\x00" in text:
        _invalid(loc, "string_nul", "string contains a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        _invalid(loc, "string_unicode", "string contains a lone UTF-16 surrogate")


def _invalid(loc: tuple[int | str, ...], kind: str, message: str) -> NoReturn:
    shown = tuple(part if isinstance(part, int) else printable(part) for part in loc)
    raise RequestValidationError([{"type": kind, "loc": shown, "msg": message, "input": None}])


def _is_json_type(content_type: str | None) -> bool:
    if content_type is None:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def signed_route_class(guard: Guard) -> type[APIRoute]:
    """A route class whose POSTs answer 400/401/413/415/422 before any endpoint code runs."""

    class SignedRoute(APIRoute):
        """Checks size, signature and JSON of a POST before FastAPI parses its body."""

        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def signed_handler(request: Request) -> Response:
                if request.method != "POST":
                    return await handler(request)
                try:
                    body = await _read_bounded(request, guard.max_body_bytes)
                    caller = await _authenticate(request, body, guard, need_nonce=True)
                    if self.body_field is None and not body:
                        parsed: Any = None  # a body-less POST: only the signature matters
                    elif not _is_json_type(request.headers.get("content-type")):
                        raise Refused(415, "body must be application/json")
                    else:
                        parsed = _parse_json(body)
                except Refused as refused:
                    return refusal(request, refused)
                _check_storable(parsed)
                verified = _VerifiedRequest(request.scope, body, parsed)
                verified.state.caller = caller
                return await handler(verified)

            return signed_handler

    return SignedRoute


def refusal(request: Request, refused: Refused) -> JSONResponse:
    """The answer to a refused request, logged with the client and never echoing a secret."""
    logger.log(
        logging.DEBUG if refused.status == 429 else logging.WARNING,  # a flood logs nothing
        "refused %s %s: %s",
        request.method,
        request.url.path,
        refused.reason,
        extra={
            "status": refused.status,
            "client": request.client.host if request.client else None,
        },
    )
    headers = {"Connection": "close"} if refused.status == 413 else None
    if refused.status == 401:
        headers = {"WWW-Authenticate": 'SDCGuard-HMAC-SHA256, Bearer realm="sdcguard"'}
    if refused.status == 429:
        headers = {"Retry-After": str(max(1, refused.retry_after_s))}
    return JSONResponse({"detail": refused.reason}, status_code=refused.status, headers=headers)
