"""The signed route: what every POST passes before FastAPI may look at its body.

Order of checks, each one before the next is allowed to look at the body:

1. size — ``Content-Length`` over the limit, or a streamed body growing past it: 413, and the
   rest is never read (an unauthenticated caller cannot make us buffer an unbounded body);
2. signature — HMAC over the *raw* bytes (``detection.signing.verify``, constant time): 401 with
   the reason, nothing parsed, nothing written;
3. JSON — UTF-8, no NaN/Infinity, bounded nesting, no NUL or lone surrogate in any string (the
   ledger's PostgreSQL cannot store them): 400 for a body that is not JSON at all, 422 naming
   the offending string;
4. schema — FastAPI then validates the parsed value against the endpoint's pydantic model
   (:mod:`flows.webhook.models`): 422 naming the field.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, NoReturn

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.types import Scope

from detection.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, SignatureError, verify

__all__ = ["Guard", "signed_route_class"]

logger = logging.getLogger(__name__)

_MAX_JSON_DEPTH = 32


class _Refused(Exception):
    """A request refused before it reached an endpoint; ``reason`` goes back to the caller."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


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
    """What the signed route checks against: the HMAC key, the body limit, the clock window."""

    secret: bytes
    max_body_bytes: int
    window_s: int


async def _read_bounded(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise _Refused(400, "Content-Length is not a number")
        if int(declared) > limit:
            raise _Refused(413, f"body of {declared} bytes is over the {limit}-byte limit")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _Refused(413, f"body is over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _parse_json(body: bytes) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _Refused(400, f"body is not UTF-8 text (byte {err.start}: {err.reason})") from err
    try:
        return json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as err:
        raise _Refused(
            400, f"body is not valid JSON: {err.msg} (line {err.lineno}, column {err.colno})"
        ) from err
    except RecursionError as err:
        raise _Refused(400, "body is not valid JSON: nested too deeply") from err
    except ValueError as err:  # from _no_constant
        raise _Refused(400, f"body is not valid JSON: {err}") from err


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
    shown = tuple(part if isinstance(part, int) else part[:64] for part in loc)
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
                    try:
                        verify(
                            guard.secret,
                            request.headers.get(TIMESTAMP_HEADER),
                            request.headers.get(SIGNATURE_HEADER),
                            body,
                            window_s=guard.window_s,
                        )
                    except SignatureError as err:
                        raise _Refused(401, err.reason) from err
                    if self.body_field is None and not body:
                        parsed: Any = None  # a body-less POST: only the signature matters
                    elif not _is_json_type(request.headers.get("content-type")):
                        raise _Refused(415, "body must be application/json")
                    else:
                        parsed = _parse_json(body)
                except _Refused as refused:
                    logger.warning(
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
                    return JSONResponse(
                        {"detail": refused.reason}, status_code=refused.status, headers=headers
                    )
                _check_storable(parsed)
                return await handler(_VerifiedRequest(request.scope, body, parsed))

            return signed_handler

    return SignedRoute
