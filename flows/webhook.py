"""The alarm webhook and ledger API (``sdcguard serve``), as a FastAPI app.

Order of checks on every POST, each one before the next is allowed to look at the body:

1. size — ``Content-Length`` over the limit, or a streamed body growing past it: 413, and the
   rest is never read (an unauthenticated caller cannot make us buffer an unbounded body);
2. signature — HMAC over the *raw* bytes (``detection.signing.verify``, constant time): 401 with
   the reason, nothing parsed, nothing written;
3. JSON — UTF-8, no NaN/Infinity, bounded nesting, no NUL or lone surrogate in any string (the
   ledger's PostgreSQL cannot store them): 400 for a body that is not JSON at all, 422 naming
   the offending string;
4. schema — pydantic request models with strict types and bounds: 422 naming the field;
5. ledger — one transaction; its typed errors become 4xx/503 with the reason.

Endpoints are ``async`` and run the synchronous ledger in worker threads, capped by a capacity
limiter sized to the ledger's connection pool, so a burst of alarms queues in the event loop
instead of in threads blocked on pool checkout.

Alarms are group-committed. In a storm every rank of a job reports the same step at once, and
one transaction per alarm serialises on that job's row. So ``POST /v1/alarms`` validates its
alarm completely (steps 1-4 and the ledger's own checks), then hands it to
:class:`_AlarmBatcher`, whose single writer records whatever has queued up meanwhile with one
``Ledger.record_alarms`` call. No request waits for a timer: a lone alarm is written at once,
and the alarms that arrive during that write form the next batch. The contract per request is
unchanged: its own outcome, its own status, the trigger fired once for the alarm that opened
the incident.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, NoReturn, Protocol, TypeVar

import anyio
import anyio.to_thread
from fastapi import APIRouter, FastAPI, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    StrictBool,
    StringConstraints,
    model_validator,
)
from starlette.types import Scope

from db import (
    AlarmIn,
    AlarmOutcome,
    AuditKind,
    IncidentState,
    InvalidRange,
    InvalidValue,
    Ledger,
    LedgerError,
    LedgerTemporaryError,
    LedgerUnavailable,
    RankIn,
    SchemaNotReady,
    UnknownIncident,
    UnknownJob,
)
from detection.alarm import Layer, Phase
from detection.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, SignatureError, verify
from flows.trigger import IncidentTrigger, TriggerDispatcher

__all__ = [
    "DEFAULT_ALARM_BATCH",
    "AlarmAccepted",
    "AlarmBody",
    "AlarmQueue",
    "AuditBody",
    "AuditRecorded",
    "CheckpointBody",
    "ErrorBody",
    "RankEntry",
    "RanksBody",
    "RanksRegistered",
    "TriggerQueued",
    "alarm_queue_of",
    "create_app",
    "dispatcher_of",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# Columns of the ledger are 32-bit integers and 255-character strings; bounds here keep a
# valid-looking request from reaching the database only to fail there with a 500.
_MAX_INT = 2**31 - 1
_MAX_JSON_DEPTH = 32
_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:@+=-]*$"
# Alarms per ledger transaction. A 4,096-rank storm then commits in a handful of batches, and a
# batch stays short enough that no request waits long behind it.
DEFAULT_ALARM_BATCH = 512

JobId = Annotated[
    str,
    StringConstraints(strict=True, min_length=1, max_length=255, pattern=_ID_PATTERN),
    Field(description="Job id: letters, digits and _.:@+=-, starting with a letter or digit."),
]
NodeName = Annotated[
    str,
    StringConstraints(strict=True, min_length=1, max_length=255, pattern=_ID_PATTERN),
    Field(description="Node name as the orchestrator knows it (e.g. a Kubernetes node name)."),
]
IncidentId = Annotated[
    str,
    StringConstraints(strict=True, min_length=1, max_length=64, pattern=_ID_PATTERN),
    Field(description="Incident id, as POST /v1/alarms returned it."),
]
Step = Annotated[int, Field(strict=True, ge=0, le=_MAX_INT, description="Training step, from 0.")]
RankNumber = Annotated[int, Field(strict=True, ge=0, le=_MAX_INT)]
Token = Annotated[
    str,
    StringConstraints(strict=True, min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$"),
]


def _rfc3339_text(value: object) -> object:
    """``sent_at`` must be RFC 3339 *text*: pydantic alone would also take a unix number."""
    if not isinstance(value, str):
        raise ValueError("must be an RFC 3339 date-time string, e.g. 2025-01-31T12:00:00Z")
    return value


def _in_utc(value: datetime) -> datetime:
    """Normalise to UTC here, where an overflow is a 422, not a 500 inside the ledger.

    ``9999-12-31T23:59:59-01:00`` is valid RFC 3339 but lies past year 9999 in UTC.
    """
    try:
        return value.astimezone(UTC)
    except OverflowError as err:
        raise ValueError("date-time is out of range once converted to UTC") from err


Rfc3339 = Annotated[
    AwareDatetime,
    BeforeValidator(_rfc3339_text),
    AfterValidator(_in_utc),
    Field(description="RFC 3339 date-time with a time zone, e.g. 2025-01-31T12:00:00Z."),
]


class _Body(BaseModel):
    """Request bodies ignore unknown fields: a newer sender must never lose an alarm to a 422."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class AlarmBody(_Body):
    """DESIGN ``POST /v1/alarms``."""

    alarm_id: uuid.UUID = Field(description="Sender-chosen uuid; re-sends are recorded once.")
    job_id: JobId
    step: Step = Field(description="The step whose computation was found wrong.")
    rank: RankNumber = Field(description="The rank that reports the alarm.")
    node: NodeName = Field(description="The reporting rank's node.")
    layer: Layer
    phase: Phase
    suspect_ranks: list[RankNumber]
    suspect_nodes: list[NodeName]
    detail: dict[str, JsonValue] = Field(default_factory=dict)
    sent_at: Rfc3339


class AlarmAccepted(BaseModel):
    incident_id: str
    duplicate: bool = Field(description="True when this alarm_id was already recorded.")


class RankEntry(_Body):
    rank: RankNumber
    local_rank: RankNumber
    node: NodeName
    instance_id: Token | None = None
    gpu_uuid: Token | None = None


class RanksBody(_Body):
    """DESIGN ``POST /v1/jobs/{job_id}/ranks``; each rank appears once."""

    ranks: list[RankEntry] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_ranks(self) -> RanksBody:
        seen: set[int] = set()
        for entry in self.ranks:
            if entry.rank in seen:
                raise ValueError(f"rank {entry.rank} is listed twice")
            seen.add(entry.rank)
        return self


class RanksRegistered(BaseModel):
    job_id: str
    registered: int


class CheckpointBody(_Body):
    """DESIGN ``POST /v1/jobs/{job_id}/checkpoints``."""

    step: Step
    uri: Annotated[
        str,
        StringConstraints(strict=True, min_length=1, max_length=1024, pattern=r"^[^\x00-\x1f]+$"),
    ]
    sha256: Annotated[str, StringConstraints(strict=True, pattern=r"^[0-9a-f]{64}$")]
    fingerprint: Annotated[str, StringConstraints(strict=True, pattern=r"^[0-9a-f]{32}$")]
    nodes: list[NodeName]
    status: Literal["pending", "quarantined"] = Field(
        default="pending",
        description="`quarantined`: the job's checkpoint gate closed on an alarm and holds "
        "this checkpoint quarantined (sent again for a checkpoint first posted pending).",
    )


class AuditBody(_Body):
    """DESIGN ``POST /v1/jobs/{job_id}/audits``."""

    step: Step
    kind: AuditKind
    ranks: list[RankNumber]
    passed: StrictBool


class AuditRecorded(BaseModel):
    job_id: str
    step: int
    verified_steps: list[int] = Field(description="Checkpoint steps this audit verified.")


class TriggerQueued(BaseModel):
    incident_id: str
    queued: bool = Field(description="False when the incident's flow is being started right now.")


class ErrorBody(BaseModel):
    detail: str


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
class _Guard:
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


def _signed_route_class(guard: _Guard) -> type[APIRoute]:
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


class _InThread(Protocol):
    def __call__(self, fn: Callable[[], _T], /) -> Awaitable[_T]: ...


@dataclass(frozen=True)
class AlarmQueue:
    """A snapshot of the alarm writer: alarms waiting for the next batch, alarms in the ledger
    call now, and whether new alarms are still taken (false once shutdown began)."""

    waiting: int
    writing: int
    accepting: bool


@dataclass(frozen=True)
class _QueuedAlarm:
    alarm: AlarmIn
    future: asyncio.Future[AlarmOutcome]


class _AlarmBatcher:
    """Coalesces concurrent alarm requests into ``Ledger.record_alarms`` batches.

    Invariants:

    * one writer task: at most one alarm batch is in the ledger at a time, in arrival order;
    * every queued future is resolved — with its own outcome, or with the error that kept its
      alarm from being recorded — including at shutdown, where :meth:`close` drains the queue
      before it returns and later requests are refused with a temporary error (503);
    * the trigger is fired by the writer, for exactly the outcomes with ``opened=True``: a
      request cancelled while it waits cannot lose the start of an incident's flow;
    * a failed batch fails no valid alarm for another's sake: a temporary error (database
      down, lost races) is every request's answer, since re-sending is what fixes it; any other
      ledger error is re-tried alarm by alarm, so only the alarm at fault gets its error.
    """

    def __init__(
        self,
        ledger: Ledger,
        dispatcher: TriggerDispatcher,
        in_thread: _InThread,
        max_batch: int,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._ledger = ledger
        self._dispatcher = dispatcher
        self._in_thread = in_thread
        self._max_batch = max_batch
        self._queue: deque[_QueuedAlarm] = deque()
        self._wakeup = asyncio.Event()
        self._closing = False
        self._writing = 0
        self._task: asyncio.Task[None] | None = None

    def snapshot(self) -> AlarmQueue:
        """Safe from any thread: reads two counters and a flag."""
        accepting = self._task is not None and not self._task.done() and not self._closing
        return AlarmQueue(waiting=len(self._queue), writing=self._writing, accepting=accepting)

    def start(self) -> None:
        """Start the writer on the running event loop (the app's lifespan)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="sdcguard-alarm-writer"
            )

    async def record(self, alarm: AlarmIn) -> AlarmOutcome:
        """Queue ``alarm`` for the next batch and wait for its own outcome."""
        if self._closing or self._task is None or self._task.done():
            raise LedgerUnavailable("the webhook is not accepting alarms now; send it again")
        future: asyncio.Future[AlarmOutcome] = asyncio.get_running_loop().create_future()
        self._queue.append(_QueuedAlarm(alarm, future))
        self._wakeup.set()
        return await future

    async def close(self) -> None:
        """Record everything already queued, then stop the writer."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        batch: list[_QueuedAlarm] = []
        try:
            while True:
                if not self._queue:
                    if self._closing:
                        return
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                size = min(len(self._queue), self._max_batch)
                batch = [self._queue.popleft() for _ in range(size)]
                self._writing = size
                await self._write(batch)
                self._writing = 0
                batch = []
        finally:
            self._writing = 0
            # Only reached with work left when the writer itself is cancelled or broken.
            stranded = batch + list(self._queue)
            self._queue.clear()
            if stranded:
                logger.error("alarm writer stopped with %d alarms unrecorded", len(stranded))
            for item in stranded:
                _resolve(
                    item,
                    LedgerUnavailable("the webhook stopped before recording this alarm; resend"),
                )

    async def _write(self, batch: list[_QueuedAlarm]) -> None:
        results: Sequence[AlarmOutcome | BaseException]
        try:
            results = await self._record([item.alarm for item in batch])
        except Exception as err:  # a bug, not a refusal: each request answers 500
            logger.exception("recording a batch of %d alarms failed", len(batch))
            results = [err] * len(batch)
        for item, result in zip(batch, results, strict=True):
            if isinstance(result, AlarmOutcome) and result.opened:
                self._fire(item.alarm, result)
            _resolve(item, result)

    async def _record(self, alarms: list[AlarmIn]) -> Sequence[AlarmOutcome | BaseException]:
        try:
            return await self._in_thread(lambda: self._ledger.record_alarms(alarms))
        except (LedgerTemporaryError, SchemaNotReady) as err:
            logger.error("a batch of %d alarms was not recorded: %s", len(alarms), err)
            return [err] * len(alarms)
        except LedgerError as err:
            logger.warning(
                "a batch of %d alarms was refused (%s); recording them one by one",
                len(alarms),
                err,
            )
            return await self._in_thread(lambda: self._one_by_one(alarms))

    def _one_by_one(self, alarms: Sequence[AlarmIn]) -> list[AlarmOutcome | BaseException]:
        """Each alarm in its own transaction; a ledger error answers only the alarm at fault."""
        results: list[AlarmOutcome | BaseException] = []
        for alarm in alarms:
            try:
                results.append(self._ledger.record_alarm(alarm))
            except LedgerError as err:  # handed to that alarm's request, which answers with it
                results.append(err)
        return results

    def _fire(self, alarm: AlarmIn, outcome: AlarmOutcome) -> None:
        logger.warning(
            "alarm opened an incident",
            extra={
                "job": alarm.job_id,
                "incident": outcome.incident_id,
                "rank": alarm.rank,
                "node": alarm.node,
                "step": alarm.step,
            },
        )
        self._dispatcher.submit(outcome.incident_id, alarm.job_id)


def _resolve(item: _QueuedAlarm, result: AlarmOutcome | BaseException) -> None:
    """Answer one waiting request; a request that gave up (cancelled) needs no answer."""
    if item.future.done():
        return
    if isinstance(result, BaseException):
        item.future.set_exception(result)
    else:
        item.future.set_result(result)


_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "Body is not JSON (or not UTF-8)."},
    401: {"model": ErrorBody, "description": "Unsigned, forged or stale request; nothing written."},
    413: {"model": ErrorBody, "description": "Body over the size limit."},
    415: {"model": ErrorBody, "description": "Body is not application/json."},
    503: {"model": ErrorBody, "description": "Ledger unavailable or not migrated; retry later."},
}
_LEDGER_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody, "description": "Unknown job or incident."},
    409: {"model": ErrorBody, "description": "Conflicts with the ledger's state."},
    503: {"model": ErrorBody, "description": "Ledger unavailable or not migrated; retry later."},
}


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
    assert isinstance(batcher, _AlarmBatcher)
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
    guard = _Guard(secret.encode(), max_body_bytes, window_s)
    dispatcher = TriggerDispatcher(trigger)
    pool_limit = _pool_capacity(ledger)
    limiter: anyio.CapacityLimiter | None = None

    async def in_thread(fn: Callable[..., _T], *args: Any) -> _T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)

    batcher = _AlarmBatcher(ledger, dispatcher, in_thread, max_alarm_batch)

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

    signed = APIRouter(route_class=_signed_route_class(guard), responses=_ERRORS)

    @signed.post(
        "/v1/alarms",
        status_code=202,
        response_model=AlarmAccepted,
        responses=_LEDGER_ERRORS,
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
        responses=_LEDGER_ERRORS,
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
        responses=_LEDGER_ERRORS,
        summary="Record a checkpoint as pending; a later passed audit verifies it.",
    )
    async def post_checkpoint(
        job_id: Annotated[JobId, Path()], body: CheckpointBody
    ) -> dict[str, Any]:
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

    @signed.post(
        "/v1/jobs/{job_id}/audits",
        response_model=AuditRecorded,
        responses=_LEDGER_ERRORS,
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
        responses=_LEDGER_ERRORS,
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
        responses=_LEDGER_ERRORS,
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
        responses=_LEDGER_ERRORS,
        summary="One incident with its alarms, suspect range, actions and history.",
    )
    async def get_incident(incident_id: Annotated[IncidentId, Path()]) -> dict[str, Any]:
        incident = await in_thread(ledger.get_incident, incident_id)
        return incident.to_dict()

    @app.get("/healthz", summary="Liveness, and incidents whose flow is not started yet.")
    async def healthz() -> dict[str, Any]:
        backlog = dispatcher.backlog()
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
