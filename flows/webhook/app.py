"""The webhook app (``sdcguard serve``): ``create_app`` puts the service together.

Every POST goes through the signed route (:mod:`flows.webhook.signed`: size, authentication,
JSON), then its request model (:mod:`flows.webhook.models`), then :func:`admit` (the caller's
scope covers the job; the nonce is claimed once, :mod:`flows.webhook.nonces`), then the ledger
in one transaction, whose typed errors become 4xx/503 with the reason. Alarms go to the ledger
through the batcher (:mod:`flows.webhook.batcher`), which claims each request's nonce in the
transaction that records its alarm. GET routes change nothing and need a
``reader``: a signed GET or a bearer token.

Endpoints are ``async`` and run the synchronous ledger in worker threads. Writes and reads have
their own capacity limiters (and, from ``sdcguard serve``, their own connection pools), so a
flood of reads waits for read threads and never takes a thread or a connection an alarm needs.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from fastapi import FastAPI

from db import (
    IncidentState,
    Ledger,
    LedgerError,
)
from flows.webhook.auth import Credentials
from flows.webhook.batcher import DEFAULT_ALARM_BATCH, AlarmBatcher, AlarmQueue
from flows.webhook.errors import install_error_handlers
from flows.webhook.nonces import NonceStore
from flows.webhook.reads import ReadBudget
from flows.webhook.routes import (
    add_alarm_routes,
    add_external_alarm_routes,
    add_health_routes,
    add_incident_routes,
    add_job_routes,
)
from flows.webhook.service import LedgerThreads, Service
from flows.webhook.signed import (
    Guard,
)
from flows.webhook.trigger import DEFAULT_RETRY_DELAYS_S, IncidentTrigger, TriggerDispatcher

__all__ = ["alarm_queue_of", "create_app", "dispatcher_of"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_Endpoint = TypeVar("_Endpoint", bound=Callable[..., Any])


def alarm_queue_of(app: FastAPI) -> AlarmQueue:
    """How many alarms wait for the ledger and how many are being written (to watch a storm)."""
    batcher = app.state.alarm_batcher
    assert isinstance(batcher, AlarmBatcher)
    return batcher.snapshot()


def dispatcher_of(app: FastAPI) -> TriggerDispatcher:
    """The dispatcher that fires the app's trigger (to wait for it, or to read its backlog)."""
    dispatcher = app.state.dispatcher
    assert isinstance(dispatcher, TriggerDispatcher)
    return dispatcher


def create_app(
    ledger: Ledger,
    trigger: IncidentTrigger,
    credentials: Credentials | str,
    *,
    max_body_bytes: int = 1 << 20,
    window_s: int = 300,
    max_alarm_batch: int = DEFAULT_ALARM_BATCH,
    read_ledger: Ledger | None = None,
    read_threads: int = 4,
    reads_per_s: float = 50.0,
    docs: bool = False,
    trigger_retry_delays_s: Sequence[float] = DEFAULT_RETRY_DELAYS_S,
) -> FastAPI:
    """The webhook + ledger API over ``ledger``; opened incidents go to ``trigger``.

    ``credentials`` are the server-side keys, reader tokens and service accounts
    (:mod:`flows.webhook.auth`); a plain string is one shared key (id ``default``) for every
    job, for a single machine. Secrets stay inside the checks and are never logged. Concurrent
    alarms are recorded up to ``max_alarm_batch`` per ledger transaction. Reads run on
    ``read_ledger`` (default: ``ledger``) in at most ``read_threads`` threads of their own, at
    most ``reads_per_s`` per second (429 above: :class:`ReadBudget`). ``docs`` serves ``/docs``
    and ``/openapi.json`` (off by default: the schema is no secret, but nothing unauthenticated
    should answer). A fire that fails is retried after ``trigger_retry_delays_s``
    (:class:`flows.webhook.trigger.TriggerDispatcher`). On start-up every incident still ``open`` is
    fired again: an incident whose flow was lost with a previous process (crash between record
    and fire, or a fire still failing at shutdown) is started now — safe, since Prefect refuses
    a second run for the same idempotency key and the flow itself claims each action once.
    """
    creds = Credentials.shared(credentials) if isinstance(credentials, str) else credentials
    reads = read_ledger or ledger
    pool_limit = _pool_capacity(ledger)
    if reads is ledger:  # one pool: reads get their threads out of it, writes keep the rest
        pool_limit = max(1, pool_limit - read_threads)
    threads = LedgerThreads(writes=pool_limit, reads=read_threads)
    dispatcher = TriggerDispatcher(trigger, retry_delays_s=trigger_retry_delays_s)
    nonces = NonceStore(
        ledger, threads.write, window_s, shared=ledger.engine.dialect.name != "sqlite"
    )
    service = Service(
        ledger=ledger,
        reads=reads,
        trigger=trigger,
        dispatcher=dispatcher,
        guard=Guard(creds, max_body_bytes, window_s, threads.read),
        nonces=nonces,
        batcher=AlarmBatcher(ledger, dispatcher, threads.write, max_alarm_batch, keep=nonces.keep),
        threads=threads,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with _running(service):
            yield

    app = FastAPI(
        title="sdcguard webhook",
        version="1",
        summary="Signed SDC alarms in, incidents out.",
        description=(
            "Every POST is signed over its canonical request (method, path, query, SHA-256 of "
            "the body, timestamp, key id, nonce): headers `X-SDCGuard-Timestamp`, "
            "`X-SDCGuard-Key-Id`, `X-SDCGuard-Nonce`, `X-SDCGuard-Signature: sha256=<hex>` "
            '(DESIGN "Webhook signing"). Unsigned, forged, stale or replayed requests get '
            "401, a key outside its jobs 403; neither changes anything. Reads need a reader: "
            "a signed GET or `Authorization: Bearer <token>`."
        ),
        lifespan=lifespan,
        strict_content_type=False,
        # The service reports through Prometheus (/metrics) and JSON logs; FastAPI's own
        # OpenTelemetry hooks would ask for a tracer on every request of an alarm storm.
        telemetry={"tracing": False, "metrics": False, "logs": False},
        docs_url="/docs" if docs else None,
        redoc_url=None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.dispatcher = dispatcher
    app.state.guard = service.guard
    app.state.read_budget = ReadBudget(reads_per_s, burst=max(1, int(reads_per_s)))
    app.state.alarm_batcher = service.batcher

    install_error_handlers(app)
    add_alarm_routes(app, service)
    add_external_alarm_routes(app, service)
    add_job_routes(app, service)
    add_incident_routes(app, service)
    add_health_routes(app, service)
    return app


@asynccontextmanager
async def _running(service: Service) -> AsyncIterator[None]:
    """The app's background parts while it serves: started in order, stopped in reverse.

    On start-up every incident still ``open`` is fired again: its flow may have been lost with a
    previous process (a crash between record and fire, or a fire still failing at shutdown).
    """
    service.threads.start()
    service.dispatcher.start()
    service.nonces.start()
    service.batcher.start()
    await _refire_open_incidents(service)
    try:
        yield
    finally:
        try:
            await service.batcher.close()  # first: its last batches may still open an incident
            await service.nonces.close()
        finally:
            await anyio.to_thread.run_sync(service.dispatcher.close)


async def _refire_open_incidents(service: Service) -> None:
    try:
        still_open = await service.threads.write(
            service.ledger.list_incidents, None, IncidentState.OPEN
        )
    except LedgerError as err:
        logger.error("could not list open incidents to re-fire them: %s", err)
        return
    for incident in still_open:
        logger.info(
            "re-firing incident still open at start-up",
            extra={"incident": incident.id, "job": incident.job_id},
        )
        service.dispatcher.submit(incident.id, incident.job_id)


def _pool_capacity(ledger: Ledger) -> int:
    """Threads that may use the ledger at once: its pool's connections, at least 1.

    More threads than connections only queue on pool checkout (and hit its timeout under a
    storm); SQLite serialises writers anyway, and its pool is not bounded the same way.
    """
    pool = ledger.engine.pool
    size = getattr(pool, "size", None)
    overflow = getattr(pool, "_max_overflow", 0)
    if callable(size):
        return max(1, int(size()) + max(0, int(overflow)))
    return 8
