"""What the webhook's routes share: the ledger, the trigger's dispatcher, the checks of a signed
request, the nonce store, the alarm batcher — and the worker threads the ledger runs in.

Endpoints are ``async`` and run the synchronous ledger in worker threads. Writes and reads have
their own capacity limiters (and, from ``sdcguard serve``, their own connection pools), so a
flood of reads waits for read threads and never takes a thread or a connection an alarm needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from fastapi import FastAPI

from db import Ledger
from flows.webhook.batcher import AlarmBatcher
from flows.webhook.models import SIGNED_ERRORS
from flows.webhook.nonces import NonceStore
from flows.webhook.signed import Guard, signed_route_class
from flows.webhook.trigger import IncidentTrigger, TriggerDispatcher

__all__ = ["LedgerThreads", "Service", "signed_post"]

_T = TypeVar("_T")
_Endpoint = TypeVar("_Endpoint", bound=Callable[..., Any])


class LedgerThreads:
    """The worker threads the ledger runs in: at most ``writes`` for writes, ``reads`` for reads.

    The limiters belong to the event loop that serves the app, so they are made when it starts
    (:meth:`start`, from the app's lifespan)."""

    def __init__(self, *, writes: int, reads: int) -> None:
        self._writes = max(1, writes)
        self._reads = max(1, reads)
        self._write_limiter: anyio.CapacityLimiter | None = None
        self._read_limiter: anyio.CapacityLimiter | None = None

    def start(self) -> None:
        self._write_limiter = anyio.CapacityLimiter(self._writes)
        self._read_limiter = anyio.CapacityLimiter(self._reads)

    async def write(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._write_limiter)

    async def read(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._read_limiter)


@dataclass(frozen=True)
class Service:
    """Everything a route of the webhook acts through; made once by ``create_app``."""

    ledger: Ledger
    reads: Ledger
    """The ledger reads go to (``sdcguard serve`` gives them their own connection pool)."""
    trigger: IncidentTrigger
    dispatcher: TriggerDispatcher
    guard: Guard
    nonces: NonceStore
    batcher: AlarmBatcher
    threads: LedgerThreads


def signed_post(
    app: FastAPI, guard: Guard, path: str, **options: Any
) -> Callable[[_Endpoint], _Endpoint]:
    """``@app.post`` with the signed route class, on the app's own router.

    Not an included ``APIRouter``: FastAPI matches an included router's routes twice per
    request (once to pick the router, once inside it), which in a 4,096-alarm storm cost
    about a sixth of the event loop's CPU.
    """
    route_class = signed_route_class(guard)
    responses = {**SIGNED_ERRORS, **options.pop("responses", {})}

    def register(endpoint: _Endpoint) -> _Endpoint:
        app.router.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            route_class_override=route_class,
            responses=responses,
            **options,
        )
        return endpoint

    return register
