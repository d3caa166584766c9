"""The webhook app (``sdcguard serve``): ``create_app``, its routes and its error handlers.

Every POST goes through the signed route (:mod:`flows.webhook.signed`: size, signature, JSON),
then its request model (:mod:`flows.webhook.models`), then the ledger in one transaction, whose
typed errors become 4xx/503 with the reason. Alarms go to the ledger through the batcher
(:mod:`flows.webhook.batcher`). GET routes change nothing and need no signature.

Endpoints are ``async`` and run the synchronous ledger in worker threads, capped by a capacity
limiter sized to the ledger's connection pool, so a burst of alarms queues in the event loop
instead of in threads blocked on pool checkout.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypeVar

import anyio
import anyio.to_thread
from fastapi import APIRouter, FastAPI, Path, Query, Request, Response
from fastapi.responses import JSONResponse

from db import (
    AlarmIn,
    IncidentState,
    InvalidRange,
    InvalidValue,
    Ledger,
    LedgerError,
    LedgerTemporaryError,
    RankIn,
    SchemaNotReady,
    UnknownIncident,
    UnknownJob,
)
from flows.metrics import install_metrics, ledger_ping
from flows.trigger import IncidentTrigger, TriggerDispatcher
from flows.webhook.batcher import DEFAULT_ALARM_BATCH, AlarmBatcher, AlarmQueue
from flows.webhook.models import (
    LEDGER_ERRORS,
    SIGNED_ERRORS,
    AlarmAccepted,
    AlarmBody,
    AuditBody,
    AuditRecorded,
    CheckpointBody,
    IncidentId,
    JobId,
    RanksBody,
    RanksRegistered,
    TriggerQueued,
)
from flows.webhook.signed import Guard, signed_route_class

__all__ = ["alarm_queue_of", "create_app", "dispatcher_of"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


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
    secret: str,
    *,
    max_body_bytes: int = 1 << 20,
    window_s: int = 300,
    max_alarm_batch: int = DEFAULT_ALARM_BATCH,
) -> FastAPI:
    """The webhook + ledger API over ``ledger``; opened incidents go to ``trigger``.

    ``secret`` is the shared HMAC key of DESIGN's "Webhook signing"; it is kept only inside the
    signature check and never logged. Concurrent alarms are recorded up to ``max_alarm_batch``
    per ledger transaction. On start-up every incident still ``open`` is fired again:
    an incident whose flow was lost with a previous process (crash between record and fire, or
    a fire still failing at shutdown) is started now — safe, since Prefect refuses a second run
    for the same idempotency key and the flow itself claims each action once.
    """
    if not secret:
        raise ValueError("the webhook secret must not be empty")
    guard = Guard(secret.encode(), max_body_bytes, window_s)
    dispatcher = TriggerDispatcher(trigger)
    pool_limit = _pool_capacity(ledger)
    limiter: anyio.CapacityLimiter | None = None

    async def in_thread(fn: Callable[..., _T], *args: Any) -> _T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)

    batcher = AlarmBatcher(ledger, dispatcher, in_thread, max_alarm_batch)

    async def refire_open_incidents() -> None:
        try:
            still_open = await in_thread(ledger.list_incidents, None, IncidentState.OPEN)
        except LedgerError as err:
            logger.error("could not list open incidents to re-fire them: %s", err)
            return
        for incident in still_open:
            logger.info(
                "re-firing incident still open at start-up",
                extra={"incident": incident.id, "job": incident.job_id},
            )
            dispatcher.submit(incident.id, incident.job_id)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        nonlocal limiter
        limiter = anyio.CapacityLimiter(pool_limit)
        dispatcher.start()
        batcher.start()
        await refire_open_incidents()
        try:
            yield
        finally:
            try:
                await batcher.close()  # first: its last batches may still open an incident
            finally:
                await anyio.to_thread.run_sync(dispatcher.close)

    app = FastAPI(
        title="sdcguard webhook",
        version="1",
        summary="Signed SDC alarms in, incidents out.",
        description=(
            "Every POST is signed: `X-SDCGuard-Timestamp: <unix seconds>` and "
            '`X-SDCGuard-Signature: sha256=<hex HMAC-SHA256(secret, "<timestamp>.<raw body>")>`'
            "; requests outside ±window or with a wrong signature get 401 and change nothing."
        ),
        lifespan=lifespan,
        strict_content_type=False,
    )
    app.state.dispatcher = dispatcher
    app.state.alarm_batcher = batcher

    @app.exception_handler(LedgerError)
    async def ledger_error(request: Request, err: Exception) -> JSONResponse:
        assert isinstance(err, LedgerError)
        status = _ledger_status(err)
        log = logger.error if status == 503 else logger.info
        log("ledger refused %s %s: %s", request.method, request.url.path, err)
        headers = {"Retry-After": "5"} if status == 503 else None
        if status == 422:  # one shape for every 422: FastAPI's list of located errors
            problem = {"type": "ledger_invalid", "loc": ["body"], "msg": str(err), "input": None}
            return JSONResponse({"detail": [problem]}, status_code=422)
        return JSONResponse({"detail": str(err)}, status_code=status, headers=headers)

    signed = APIRouter(route_class=signed_route_class(guard), responses=SIGNED_ERRORS)

    @signed.post(
        "/v1/alarms",
        status_code=202,
        response_model=AlarmAccepted,
        responses=LEDGER_ERRORS,
        summary="Record an alarm; the alarm that opens an incident starts its flow.",
    )
    async def post_alarm(alarm: AlarmBody) -> AlarmAccepted:
        record = AlarmIn(
            alarm_id=str(alarm.alarm_id),
            job_id=alarm.job_id,
            step=alarm.step,
            rank=alarm.rank,
            node=alarm.node,
            layer=alarm.layer.value,
            phase=alarm.phase.value,
            suspect_ranks=list(alarm.suspect_ranks),
            suspect_nodes=list(alarm.suspect_nodes),
            detail=dict(alarm.detail),
            sent_at=alarm.sent_at,
        )
        Ledger.validate_alarm(record)  # refused here, alone, not as part of someone's batch
        outcome = await batcher.record(record)  # the batcher fires the trigger if it opened
        if outcome.duplicate:
            logger.debug(
                "duplicate alarm",
                extra={"job": alarm.job_id, "incident": outcome.incident_id, "rank": alarm.rank},
            )
        return AlarmAccepted(incident_id=outcome.incident_id, duplicate=outcome.duplicate)

    @signed.post(
        "/v1/jobs/{job_id}/ranks",
        response_model=RanksRegistered,
        responses=LEDGER_ERRORS,
        summary="Register (or move) the ranks of a job; creates the job.",
    )
    async def post_ranks(job_id: Annotated[JobId, Path()], body: RanksBody) -> RanksRegistered:
        ranks = [
            RankIn(
                rank=r.rank,
                local_rank=r.local_rank,
                node=r.node,
                instance_id=r.instance_id,
                gpu_uuid=r.gpu_uuid,
            )
            for r in body.ranks
        ]

        def register() -> None:
            ledger.ensure_job(job_id)
            ledger.register_ranks(job_id, ranks)

        await in_thread(register)
        logger.info("registered %d ranks", len(ranks), extra={"job": job_id})
        return RanksRegistered(job_id=job_id, registered=len(ranks))

    @signed.post(
        "/v1/jobs/{job_id}/checkpoints",
        status_code=201,
        responses=LEDGER_ERRORS,
        summary="Record a checkpoint as pending; a later passed audit verifies it.",
    )
    async def post_checkpoint(
        job_id: Annotated[JobId, Path()], body: CheckpointBody
    ) -> dict[str, Any]:
        view = await in_thread(
            ledger.record_checkpoint,
            job_id,
            body.step,
            body.uri,
            body.sha256,
            body.fingerprint,
            list(body.nodes),
        )
        return view.to_dict()

    @signed.post(
        "/v1/jobs/{job_id}/audits",
        response_model=AuditRecorded,
        responses=LEDGER_ERRORS,
        summary="Record an audit; a passed one verifies earlier pending checkpoints.",
    )
    async def post_audit(job_id: Annotated[JobId, Path()], body: AuditBody) -> AuditRecorded:
        verified = await in_thread(
            ledger.record_audit, job_id, body.step, body.kind, list(body.ranks), body.passed
        )
        return AuditRecorded(job_id=job_id, step=body.step, verified_steps=list(verified))

    @signed.post(
        "/v1/incidents/{incident_id}/trigger",
        status_code=202,
        response_model=TriggerQueued,
        responses=LEDGER_ERRORS,
        summary="Fire the trigger of a recorded incident again (after a failed start).",
    )
    async def post_trigger(
        incident_id: Annotated[IncidentId, Path()],
    ) -> TriggerQueued:
        incident = await in_thread(ledger.get_incident, incident_id)
        queued = dispatcher.submit(incident.id, incident.job_id)
        return TriggerQueued(incident_id=incident.id, queued=queued)

    app.include_router(signed)

    @app.get(
        "/v1/incidents",
        responses=LEDGER_ERRORS,
        summary="Incidents, newest first; filter by job and state.",
    )
    async def get_incidents(
        job_id: Annotated[JobId | None, Query()] = None,
        state: Annotated[IncidentState | None, Query()] = None,
    ) -> dict[str, list[dict[str, Any]]]:
        incidents = await in_thread(ledger.list_incidents, job_id, state)
        return {"incidents": [incident.to_dict() for incident in incidents]}

    @app.get(
        "/v1/incidents/{incident_id}",
        responses=LEDGER_ERRORS,
        summary="One incident with its alarms, suspect range, actions and history.",
    )
    async def get_incident(incident_id: Annotated[IncidentId, Path()]) -> dict[str, Any]:
        incident = await in_thread(ledger.get_incident, incident_id)
        return incident.to_dict()

    install_metrics(app, ledger, dispatcher.backlog)

    @app.get("/healthz", summary="The ledger answers; and incidents whose flow is not started yet.")
    async def healthz(response: Response) -> dict[str, Any]:
        backlog = dispatcher.backlog()
        try:
            await in_thread(ledger_ping, ledger)
        except Exception as err:  # any failure to reach the ledger means "not healthy"
            response.status_code = 503
            logger.error(
                "healthz: ledger unreachable: %s", err, extra={"error": type(err).__name__}
            )
            return {"status": "ledger-unavailable", "error": type(err).__name__}
        return {
            "status": "ok",
            "trigger_backlog": [
                {"incident_id": p.incident_id, "attempts": p.attempts, "last_error": p.last_error}
                for p in backlog
            ],
        }

    return app


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
