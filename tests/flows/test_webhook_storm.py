"""An alarm storm, and how the webhook coalesces it into ledger batches.

Every rank of a 4,096-rank job reports the same step at once. The webhook must record every
alarm exactly once, attach all of them to one incident and start exactly one flow — the
property that keeps a fleet-wide fault from starting 4,096 recoveries. Concurrent alarms are
written in batches (one ledger transaction each); each request still gets its own answer: a
refused alarm fails alone, a batch the database could not take is answered 503 as a whole and
can be re-sent, and alarms still queued when the service stops are recorded before it exits.

To put several alarms into one batch on purpose, a test holds the job's row (PostgreSQL) or the
write lock (SQLite) from a connection of its own: the writer's first batch then waits in the
database while the next requests queue up behind it, which ``alarm_queue_of`` shows.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from db import Ledger
from db.models import JobRow
from detection.transport.signing import signed_headers
from flows.webhook import alarm_queue_of, create_app, dispatcher_of
from flows.webhook.serve import run_in_thread
from flows.webhook.trigger import RecordingTrigger
from tests.flows.conftest import Webhook, alarm_payload, ranks_payload, row_counts

WORLD_SIZE = 4096
CLIENTS = 64
STEP = 1234
# uvicorn closes a keep-alive connection idle for 5 s (its ``timeout_keep_alive``). A client
# that reuses one at that moment sends into a closing socket and reads "connection reset by
# peer" — under a heavy machine load a client thread can sit that long between two requests.
# So the storm's clients drop idle connections well before the server does, and retry only a
# connection that could not be opened (httpx's transport retries: connect errors, never a
# request that was sent or an HTTP answer).
KEEPALIVE_S = 2.0
CONNECT_RETRIES = 3


def test_storm_records_every_alarm_once_opens_one_incident_fires_once(
    ledger: Ledger, webhook_secret: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="db.ledger")
    trigger = RecordingTrigger()
    app = create_app(ledger, trigger, webhook_secret)  # default 1 MiB: the rank map is ~0.5 MiB
    with run_in_thread(app) as url:
        _storm(Webhook(url, app, ledger, trigger, webhook_secret))
    batches = [r for r in caplog.records if r.getMessage() == "alarms recorded"]
    assert sum(getattr(r, "alarms", 0) for r in batches) == WORLD_SIZE
    assert len(batches) < WORLD_SIZE, "the storm was written one alarm per transaction"


def _storm(webhook: Webhook) -> None:
    registered = webhook.post("/v1/jobs/storm-job/ranks", ranks_payload(WORLD_SIZE, 8))
    assert registered.status_code == 200, registered.text
    bodies = [
        json.dumps(
            alarm_payload(job_id="storm-job", step=STEP, rank=rank, node=f"node-{rank // 8}")
        ).encode()
        for rank in range(WORLD_SIZE)
    ]

    def client(index: int) -> list[httpx.Response]:
        transport = httpx.HTTPTransport(
            retries=CONNECT_RETRIES, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S)
        )
        with httpx.Client(base_url=webhook.url, timeout=60, transport=transport) as http:
            return [
                http.post(
                    "/v1/alarms",
                    content=body,
                    headers={
                        **signed_headers("default", webhook.secret, "POST", "/v1/alarms", body),
                        "Content-Type": "application/json",
                    },
                )
                for body in bodies[index::CLIENTS]
            ]

    with ThreadPoolExecutor(CLIENTS) as pool:
        responses = [r for batch in pool.map(client, range(CLIENTS)) for r in batch]

    assert len(responses) == WORLD_SIZE
    assert {r.status_code for r in responses} == {202}, {
        r.status_code: r.text for r in responses if r.status_code != 202
    }
    incidents = {r.json()["incident_id"] for r in responses}
    assert len(incidents) == 1
    assert not any(r.json()["duplicate"] for r in responses)

    (incident_id,) = incidents
    incident = webhook.ledger.get_incident(incident_id)
    assert len(incident.alarms) == WORLD_SIZE
    assert sorted(alarm.rank for alarm in incident.alarms) == list(range(WORLD_SIZE))
    assert len(webhook.ledger.list_incidents("storm-job")) == 1
    assert dispatcher_of(webhook.app).wait_idle(30)
    assert webhook.trigger.calls == [(incident_id, "storm-job")]


# ---------------------------------------------------------------------- one batch, many answers


def test_a_refused_alarm_in_a_batch_fails_alone(
    ledger: Ledger, webhook_secret: str, database_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The database refuses rank 13's row; the batch it shares with 30 others is re-done alarm
    by alarm, so rank 13 gets 409 with the reason and every other alarm is recorded."""
    trigger = RecordingTrigger()
    app = create_app(ledger, trigger, webhook_secret)
    with run_in_thread(app) as url, _refusing_rank(ledger, database_backend, 13):
        hook = Webhook(url, app, ledger, trigger, webhook_secret)
        assert hook.post("/v1/jobs/job-1/ranks", ranks_payload(32)).status_code == 200
        with ThreadPoolExecutor(32) as pool:
            with _holding_the_job(ledger, "job-1"):
                first = pool.submit(hook.post, "/v1/alarms", alarm_payload(rank=0))
                _wait_for(lambda: alarm_queue_of(app).writing == 1)
                rest = [
                    pool.submit(hook.post, "/v1/alarms", alarm_payload(rank=rank))
                    for rank in range(1, 32)
                ]
                _wait_for(lambda: alarm_queue_of(app).waiting == 31)
            responses = [first.result(60)] + [f.result(60) for f in rest]

        statuses = {rank: r.status_code for rank, r in enumerate(responses)}
        assert statuses == {rank: 409 if rank == 13 else 202 for rank in range(32)}
        assert "rank 13 refused" in responses[13].json()["detail"]
        [incident] = ledger.list_incidents("job-1")
        assert sorted(a.rank for a in incident.alarms) == [r for r in range(32) if r != 13]
        assert dispatcher_of(app).wait_idle(30)
        assert trigger.calls == [(incident.id, "job-1")]
    assert any("recording them one by one" in r.getMessage() for r in caplog.records)


def test_a_batch_the_database_cannot_take_is_answered_503_and_can_be_resent(
    ledger: Ledger, webhook_secret: str
) -> None:
    """The alarms table disappears under a waiting batch: every request of it, and of the batch
    queued behind it, is told to retry (503, Retry-After); re-sent later, each is recorded.
    The nonce is claimed in the batch's transaction, so the failed batch consumed none: the
    very same signed requests, re-sent byte for byte, are accepted — and only once."""
    trigger = RecordingTrigger()
    app = create_app(ledger, trigger, webhook_secret)
    with run_in_thread(app) as url:
        hook = Webhook(url, app, ledger, trigger, webhook_secret)
        requests = [_signed_alarm(webhook_secret, alarm_payload(rank=rank)) for rank in range(16)]

        def send(request: tuple[bytes, dict[str, str]]) -> httpx.Response:
            return hook.post_raw("/v1/alarms", *request)

        try:
            with ThreadPoolExecutor(16) as pool:
                with _alarms_table_gone(ledger):
                    futures = [pool.submit(send, requests[0])]
                    _wait_for(lambda: alarm_queue_of(app).writing == 1)
                    futures += [pool.submit(send, r) for r in requests[1:]]
                    _wait_for(lambda: alarm_queue_of(app).waiting == 15)
                refused = [f.result(60) for f in futures]
        finally:
            _restore_alarms_table(ledger)
        assert {r.status_code for r in refused} == {503}, [r.text for r in refused]
        assert {r.headers.get("retry-after") for r in refused} == {"5"}
        assert ledger.list_incidents("job-1") == []

        resent = [send(r) for r in requests]
        assert {r.status_code for r in resent} == {202}, [r.text for r in resent]
        assert {send(r).status_code for r in requests} == {401}  # now they are replays
        [incident] = ledger.list_incidents("job-1")
        assert len(incident.alarms) == 16
        assert dispatcher_of(app).wait_idle(30)
        assert trigger.calls == [(incident.id, "job-1")]


def test_alarms_queued_at_shutdown_are_recorded_before_it_ends(
    ledger: Ledger, webhook_secret: str
) -> None:
    """Shutdown stops taking alarms (503) but answers every one already queued, with its
    outcome: none is dropped, and the incident's flow is submitted before the trigger stops."""
    trigger = RecordingTrigger()
    app = create_app(ledger, trigger, webhook_secret)
    ledger.ensure_job("job-1")

    async def scenario() -> tuple[list[httpx.Response], httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://webhook") as client:

            async def post(payload: dict[str, Any]) -> httpx.Response:
                body = json.dumps(payload).encode()
                headers = {
                    **signed_headers("default", webhook_secret, "POST", "/v1/alarms", body),
                    "Content-Type": "application/json",
                }
                return await client.post("/v1/alarms", content=body, headers=headers)

            lifespan = app.router.lifespan_context(app)
            await lifespan.__aenter__()
            stopping: asyncio.Task[Any] | None = None
            try:
                with _holding_the_job(ledger, "job-1"):
                    tasks = [asyncio.create_task(post(alarm_payload(rank=0)))]
                    await _wait_async(lambda: alarm_queue_of(app).writing == 1)
                    tasks += [asyncio.create_task(post(alarm_payload(rank=r))) for r in range(1, 8)]
                    await _wait_async(lambda: alarm_queue_of(app).waiting == 7)
                    stopping = asyncio.create_task(lifespan.__aexit__(None, None, None))
                    await _wait_async(lambda: not alarm_queue_of(app).accepting)
                    late = await post(alarm_payload(rank=99))
                # The job is free again: the queued alarms go in while shutdown waits for them.
                return [await task for task in tasks], late
            finally:
                if stopping is None:
                    await lifespan.__aexit__(None, None, None)
                else:
                    await stopping

    answered, late = asyncio.run(scenario())
    assert [r.status_code for r in answered] == [202] * 8
    assert late.status_code == 503
    [incident] = ledger.list_incidents("job-1")
    assert sorted(a.rank for a in incident.alarms) == list(range(8))
    assert trigger.calls == [(incident.id, "job-1")]
    assert row_counts(ledger)["alarms"] == 8


# ---------------------------------------------------------------------- helpers


def _signed_alarm(secret: str, payload: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    body = json.dumps(payload).encode()
    return body, signed_headers("default", secret, "POST", "/v1/alarms", body)


def _wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the webhook never reached the expected state"
        time.sleep(0.01)


async def _wait_async(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the webhook never reached the expected state"
        await asyncio.sleep(0.01)


@contextmanager
def _holding_the_job(ledger: Ledger, job_id: str) -> Iterator[None]:
    """Block alarm writers of ``job_id`` until the block ends: the job's row lock on PostgreSQL,
    the database's write lock on SQLite (``BEGIN IMMEDIATE`` comes with the ledger's engine)."""
    with ledger.engine.connect() as conn, conn.begin():
        conn.execute(sa.select(JobRow.id).where(JobRow.id == job_id).with_for_update())
        yield


@contextmanager
def _refusing_rank(ledger: Ledger, backend: str, rank: int) -> Iterator[None]:
    """The database itself refuses alarm rows of one rank (a trigger), as a constraint would."""
    with ledger.engine.begin() as conn:
        if backend == "sqlite":
            conn.exec_driver_sql(
                f"CREATE TRIGGER refuse_rank BEFORE INSERT ON alarms WHEN NEW.rank = {rank} "
                f"BEGIN SELECT RAISE(ABORT, 'rank {rank} refused'); END"
            )
        else:
            conn.exec_driver_sql(
                "CREATE FUNCTION refuse_rank() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                f"IF NEW.rank = {rank} THEN RAISE EXCEPTION 'rank {rank} refused'; END IF; "
                "RETURN NEW; END; $$"
            )
            conn.exec_driver_sql(
                "CREATE TRIGGER refuse_rank BEFORE INSERT ON alarms "
                "FOR EACH ROW EXECUTE FUNCTION refuse_rank()"
            )
    try:
        yield
    finally:
        with ledger.engine.begin() as conn:
            if backend == "sqlite":
                conn.exec_driver_sql("DROP TRIGGER refuse_rank")
            else:
                conn.exec_driver_sql("DROP TRIGGER refuse_rank ON alarms")
                conn.exec_driver_sql("DROP FUNCTION refuse_rank()")


@contextmanager
def _alarms_table_gone(ledger: Ledger) -> Iterator[None]:
    """Rename the alarms table in a transaction that stays open for the block: writers wait for
    it (its lock), and when it commits at the end of the block they find no table."""
    with ledger.engine.connect() as conn, conn.begin():
        conn.exec_driver_sql("ALTER TABLE alarms RENAME TO alarms_away")
        yield


def _restore_alarms_table(ledger: Ledger) -> None:
    """Put the table back (if it went away), so later tests find the schema whole."""
    with ledger.engine.begin() as conn:
        if sa.inspect(conn).has_table("alarms_away"):
            conn.exec_driver_sql("ALTER TABLE alarms_away RENAME TO alarms")
