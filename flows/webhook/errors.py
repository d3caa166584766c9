"""How the webhook answers what it refuses: ledger errors, refused requests, invalid bodies.

A ledger error becomes 4xx/503 with the reason a caller may read; a refused signed request its
401/403/413; a schema error FastAPI's 422 list of located errors — with every input escaped, so
a lone surrogate can never make a 422 into a 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from db import (
    InvalidRange,
    InvalidValue,
    LedgerError,
    LedgerTemporaryError,
    SchemaNotReady,
    UnknownIncident,
    UnknownJob,
)
from flows.webhook.signed import Refused, printable, refusal

__all__ = ["install_error_handlers"]

logger = logging.getLogger(__name__)


def _ledger_status(err: LedgerError) -> int:
    """HTTP status of a ledger error.

    ``UnknownJob`` is 404, not 409: the URL names ``/v1/jobs/{job_id}`` and that resource does
    not exist; nothing about the job's state conflicts. A sender sees it when it records a
    checkpoint or an audit before rank 0 registered the ranks (or sent an alarm).
    """
    if isinstance(err, LedgerTemporaryError | SchemaNotReady):
        return 503
    if isinstance(err, UnknownJob | UnknownIncident):
        return 404
    if isinstance(err, InvalidValue | InvalidRange):
        return 422
    return 409


def _public_message(err: LedgerError, status: int, method: str) -> str:
    """What a caller may read. Never the text of an unavailable database (it names hosts and
    roles); to a reader, never a driver's error text either. A writer is told why its own
    record was refused (a constraint, a conflict), so its sender can log the reason."""
    if status == 503:
        return "the ledger is unavailable; retry later"
    if method != "POST" and type(err) is LedgerError:
        return "the ledger could not answer this read"
    return printable(str(err), 2000)


def _safe_json(value: Any) -> Any:
    """A JSON value with every string escaped of lone surrogates (a 422 must never be a 500)."""
    if isinstance(value, str):
        return printable(value, 2000)
    if isinstance(value, dict):
        return {_safe_json(k): _safe_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_safe_json(v) for v in value]
    return value


def install_error_handlers(app: FastAPI) -> None:
    """The app's answers to a ledger error, a refused request and an invalid body."""

    @app.exception_handler(LedgerError)
    async def ledger_error(request: Request, err: Exception) -> JSONResponse:
        assert isinstance(err, LedgerError)
        status = _ledger_status(err)
        log = logger.error if status == 503 else logger.info
        log("ledger refused %s %s: %s", request.method, request.url.path, err)
        headers = {"Retry-After": "5"} if status == 503 else None
        message = _public_message(err, status, request.method)
        if status == 422:  # one shape for every 422: FastAPI's list of located errors
            problem = {"type": "ledger_invalid", "loc": ["body"], "msg": message, "input": None}
            return JSONResponse({"detail": [problem]}, status_code=422)
        return JSONResponse({"detail": message}, status_code=status, headers=headers)

    @app.exception_handler(Refused)
    async def refused(request: Request, err: Exception) -> JSONResponse:
        assert isinstance(err, Refused)
        return refusal(request, err)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, err: Exception) -> JSONResponse:
        """FastAPI's 422 shape, with inputs escaped: a lone surrogate must not make it a 500."""
        assert isinstance(err, RequestValidationError)
        errors = _safe_json(jsonable_encoder(err.errors(), custom_encoder={bytes: repr}))
        return JSONResponse({"detail": errors}, status_code=422)
