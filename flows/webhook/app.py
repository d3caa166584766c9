"""The webhook app (``sdcguard serve``): ``create_app``, its routes and its error handlers.

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
from typing import Annotated, Any, TypeVar

import anyio
import anyio.to_thread
from fastapi import FastAPI, Path, Query, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from db import (
    AlarmIn,
    IncidentState,
    InvalidRange,
    InvalidValue,
    Ledger,
    LedgerError,
    LedgerTemporaryError,
    NonceReused,
    RankIn,
    SchemaNotReady,
    UnknownIncident,
    UnknownJob,
)
from flows.webhook.auth import Credentials
from flows.webhook.batcher import DEFAULT_ALARM_BATCH, AlarmBatcher, AlarmQueue
from flows.webhook.incidents_api import incidents_router
from flows.webhook.metrics import install_metrics, ledger_ping
from flows.webhook.models import (
    LEDGER_ERRORS,
    READ_ERRORS,
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
from flows.webhook.nonces import NonceStore
from flows.webhook.reads import ReadBudget, Reader, covered_jobs, decode_cursor, encode_cursor
from flows.webhook.signed import (
    REPLAYED,
    Guard,
    Refused,
    admit,
    authorize,
    printable,
    refusal,
    signed_route_class,
)
from flows.webhook.trigger import DEFAULT_RETRY_DELAYS_S, IncidentTrigger, TriggerDispatcher

__all__ = ["alarm_queue_of", "create_app", "dispatcher_of"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_Endpoint = TypeVar("_Endpoint", bound=Callable[..., Any])


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
    dispatcher = TriggerDispatcher(trigger, retry_delays_s=trigger_retry_delays_s)
    pool_limit = _pool_capacity(ledger)
    if reads is ledger:  # one pool: reads get their threads out of it, writes keep the rest
        pool_limit = max(1, pool_limit - read_threads)
    limiter: anyio.CapacityLimiter | None = None
    read_limiter: anyio.CapacityLimiter | None = None

    async def in_thread(fn: Callable[..., _T], *args: Any) -> _T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)

    async def in_read_thread(fn: Callable[..., _T], *args: Any) -> _T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=read_limiter)

    guard = Guard(creds, max_body_bytes, window_s, in_read_thread)
    nonces = NonceStore(ledger, in_thread, window_s, shared=ledger.engine.dialect.name != "sqlite")
    batcher = AlarmBatcher(ledger, dispatcher, in_thread, max_alarm_batch, keep=nonces.keep)

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
        nonlocal limiter, read_limiter
        limiter = anyio.CapacityLimiter(pool_limit)
        read_limiter = anyio.CapacityLimiter(max(1, read_threads))
        dispatcher.start()
        nonces.start()
        batcher.start()
        await refire_open_incidents()
        try:
            yield
        finally:
            try:
                await batcher.close()  # first: its last batches may still open an incident
                await nonces.close()
            finally:
                await anyio.to_thread.run_sync(dispatcher.close)

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
    app.state.guard = guard
    app.state.read_budget = ReadBudget(reads_per_s, burst=max(1, int(reads_per_s)))
    app.state.alarm_batcher = batcher

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

    signed_route = signed_route_class(guard)

    def signed_post(path: str, **options: Any) -> Callable[[_Endpoint], _Endpoint]:
        """``@app.post`` with the signed route class, on the app's own router.

        Not an included ``APIRouter``: FastAPI matches an included router's routes twice per
        request (once to pick the router, once inside it), which in a 4,096-alarm storm cost
        about a sixth of the event loop's CPU.
        """

        responses = {**SIGNED_ERRORS, **options.pop("responses", {})}

        def register(endpoint: _Endpoint) -> _Endpoint:
            app.router.add_api_route(
                path,
                endpoint,
                methods=["POST"],
                route_class_override=signed_route,
                responses=responses,
                **options,
            )
            return endpoint

        return register

    @signed_post(
        "/v1/alarms",
        status_code=202,
        response_model=AlarmAccepted,
        responses=LEDGER_ERRORS,
        summary="Record an alarm; the alarm that opens an incident starts its flow.",
    )
    async def post_alarm(alarm: AlarmBody, request: Request) -> AlarmAccepted:
        caller = authorize(request, alarm.job_id)  # its nonce is claimed with the alarm's batch
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
        nonce = None if caller.nonce is None else (caller.nonce, caller.key_id)
        outcome = await batcher.record(record, nonce)  # the batcher fires the trigger if opened
        if isinstance(outcome, NonceReused):
            raise Refused(401, REPLAYED)
        if outcome.duplicate:
            logger.debug(
                "duplicate alarm",
                extra={"job": alarm.job_id, "incident": outcome.incident_id, "rank": alarm.rank},
            )
        return AlarmAccepted(incident_id=outcome.incident_id, duplicate=outcome.duplicate)

    @signed_post(
        "/v1/jobs/{job_id}/ranks",
        response_model=RanksRegistered,
        responses=LEDGER_ERRORS,
        summary="Register (or move) the ranks of a job; creates the job.",
    )
    async def post_ranks(
        job_id: Annotated[JobId, Path()], body: RanksBody, request: Request
    ) -> RanksRegistered:
        await admit(request, job_id, nonces)
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
            ledger.register_ranks(job_id, ranks, generation=body.generation)

        await in_thread(register)
        logger.info("registered %d ranks", len(ranks), extra={"job": job_id})
        return RanksRegistered(job_id=job_id, registered=len(ranks))

    @signed_post(
        "/v1/jobs/{job_id}/checkpoints",
        status_code=201,
        responses=LEDGER_ERRORS,
        summary="Record a checkpoint as pending; a later passed audit verifies it.",
    )
    async def post_checkpoint(
        job_id: Annotated[JobId, Path()], body: CheckpointBody, request: Request
    ) -> dict[str, Any]:
        await admit(request, job_id, nonces, checkpoint_uri=body.uri)

        def record() -> dict[str, Any]:
            view = ledger.record_checkpoint(
                job_id, body.step, body.uri, body.sha256, body.fingerprint, list(body.nodes)
            )
            if body.status == "quarantined":
                ledger.quarantine_range(job_id, body.step, body.step)
                view = next(
                    v
                    for v in ledger.list_checkpoints(job_id)
                    if v.step == body.step and v.uri == body.uri and v.sha256 == body.sha256
                )
            return view.to_dict()

        return await in_thread(record)

    @signed_post(
        "/v1/jobs/{job_id}/audits",
        response_model=AuditRecorded,
        responses=LEDGER_ERRORS,
        summary="Record an audit; a passed one verifies earlier pending checkpoints.",
    )
    async def post_audit(
        job_id: Annotated[JobId, Path()], body: AuditBody, request: Request
    ) -> AuditRecorded:
        await admit(request, job_id, nonces)
        verified = await in_thread(
            ledger.record_audit, job_id, body.step, body.kind, list(body.ranks), body.passed
        )
        return AuditRecorded(job_id=job_id, step=body.step, verified_steps=list(verified))

    @signed_post(
        "/v1/incidents/{incident_id}/trigger",
        status_code=202,
        response_model=TriggerQueued,
        responses=LEDGER_ERRORS,
        summary="Fire the trigger of a recorded incident again (after a failed start).",
    )
    async def post_trigger(
        incident_id: Annotated[IncidentId, Path()], request: Request
    ) -> TriggerQueued:
        incident = await in_thread(ledger.get_incident, incident_id)
        await admit(request, incident.job_id, nonces)
        queued = dispatcher.submit(incident.id, incident.job_id)
        return TriggerQueued(incident_id=incident.id, queued=queued)

    app.include_router(incidents_router(ledger, trigger, guard))

    @app.get(
        "/v1/incidents",
        responses={**READ_ERRORS, **LEDGER_ERRORS},
        summary="Incident summaries, newest first, a page at a time; filter by job and state.",
    )
    async def get_incidents(
        principal: Reader,
        job_id: Annotated[JobId | None, Query()] = None,
        state: Annotated[IncidentState | None, Query()] = None,
        limit: Annotated[int, Query(ge=1, le=200)] = 50,
        cursor: Annotated[str | None, Query(max_length=512, pattern=r"^[A-Za-z0-9_-]+$")] = None,
    ) -> dict[str, Any]:
        jobs: frozenset[str] | None = None
        if job_id is not None and not principal.covers(job_id):
            raise Refused(403, f"{printable(principal.name)} may not read job {job_id}")
        if not principal.all_jobs and job_id is None:
            jobs = await in_read_thread(covered_jobs, reads, principal)
        after = None if cursor is None else decode_cursor(cursor)

        def page() -> Any:
            return reads.list_incidents_page(job_id, state, limit=limit, after=after, jobs=jobs)

        found = await in_read_thread(page)
        return {
            "incidents": found.incidents,
            "next_cursor": encode_cursor(found.next_after),
        }

    @app.get(
        "/v1/incidents/{incident_id}",
        responses={**READ_ERRORS, **LEDGER_ERRORS},
        summary="One incident with its alarms, suspect range, actions and history.",
    )
    async def get_incident(
        principal: Reader, incident_id: Annotated[IncidentId, Path()]
    ) -> dict[str, Any]:
        incident = await in_read_thread(reads.get_incident, incident_id)
        if not principal.covers(incident.job_id):
            raise UnknownIncident(incident_id)  # not 403: do not confirm that it exists
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
