"""``/metrics`` in the Prometheus text format: what an operator watches sdcguard by.

Most series are read from the ledger at scrape time (a custom collector), so they are true
across every webhook replica and flow-run pod without any of them keeping counters, and a
restart loses nothing:

- ``sdcguard_alarms_total{layer, outcome}`` — alarms recorded; ``outcome`` ``opened`` (the alarm
  opened its incident) or ``joined`` (it joined an open one);
- ``sdcguard_incidents{state}`` — incidents per state, every state listed (0 included);
- ``sdcguard_trigger_backlog`` — opened incidents whose flow is not started yet;
- ``sdcguard_stage_duration_seconds{stage}`` — finished incident stages (a summary);
- ``sdcguard_approval_wait_seconds`` — from awaiting approval to the decision (a summary).

Ingest latency is the one series measured here, per request:
``sdcguard_ingest_seconds{route, status}`` (a histogram of the alarm routes' handling time).
Invariant: a scrape never writes to the ledger; a ledger error fails the scrape (503), it is
never reported as zeros.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from db import IncidentState, Ledger
from db.models import ActionRow, AlarmRow, IncidentEventRow, IncidentRow

__all__ = ["INGEST_ROUTES", "LedgerCollector", "install_metrics", "ledger_ping"]

log = logging.getLogger(__name__)

INGEST_ROUTES = ("/v1/alarms",)
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LedgerCollector(Collector):
    """The ledger-derived series (see the module docstring); ``backlog`` counts the trigger's
    pending incidents."""

    def __init__(self, ledger: Ledger, backlog: Callable[[], Sequence[Any]]) -> None:
        self._ledger = ledger
        self._backlog = backlog

    def describe(self) -> Iterator[Metric]:
        """Nothing up front: registering must not read the ledger (the app may start first)."""
        return iter(())

    def collect(self) -> Iterator[Metric]:
        with self._ledger.engine.connect() as conn:
            alarms = conn.execute(
                select(AlarmRow.incident_id, AlarmRow.layer, AlarmRow.received_at, AlarmRow.id)
            ).all()
            states: dict[IncidentState, int] = {
                state: int(count)
                for state, count in conn.execute(
                    select(IncidentRow.state, func.count()).group_by(IncidentRow.state)
                ).all()
            }
            stages = conn.execute(
                select(ActionRow.target, ActionRow.started_at, ActionRow.finished_at).where(
                    ActionRow.kind == "stage", ActionRow.finished_at.is_not(None)
                )
            ).all()
            waits = conn.execute(
                select(IncidentEventRow.incident_id, IncidentEventRow.at, IncidentRow.decided_at)
                .join(IncidentRow, IncidentRow.id == IncidentEventRow.incident_id)
                .where(
                    IncidentEventRow.to_state == IncidentState.AWAITING_APPROVAL,
                    IncidentRow.decided_at.is_not(None),
                )
            ).all()
        yield _alarm_family(alarms)
        incidents = GaugeMetricFamily(
            "sdcguard_incidents", "Incidents per state.", labels=["state"]
        )
        for state in IncidentState:
            incidents.add_metric([state.value], float(states.get(state, 0)))
        yield incidents
        yield GaugeMetricFamily(
            "sdcguard_trigger_backlog",
            "Opened incidents whose flow run is not started yet.",
            value=float(len(self._backlog())),
        )
        durations = SummaryMetricFamily(
            "sdcguard_stage_duration_seconds", "Finished incident stages.", labels=["stage"]
        )
        per_stage: dict[str, list[float]] = {}
        for stage, started, finished in stages:
            if finished is None:
                continue
            per_stage.setdefault(str(stage), []).append((finished - started).total_seconds())
        for stage, values in sorted(per_stage.items()):
            durations.add_metric([stage], count_value=len(values), sum_value=sum(values))
        yield durations
        first_wait: dict[str, float] = {}
        for incident_id, entered, decided in waits:
            if decided is None:
                continue
            wait = max(0.0, (decided - entered).total_seconds())
            first_wait[incident_id] = max(first_wait.get(incident_id, 0.0), wait)
        approval = SummaryMetricFamily(
            "sdcguard_approval_wait_seconds", "From awaiting approval to the decision."
        )
        approval.add_metric([], count_value=len(first_wait), sum_value=sum(first_wait.values()))
        yield approval


def ledger_ping(ledger: Ledger) -> None:
    """One round trip to the ledger's database (``SELECT 1``); raises when it cannot answer."""
    with ledger.engine.connect() as conn:
        conn.execute(select(1)).scalar_one()


def _alarm_family(rows: Sequence[Any]) -> CounterMetricFamily:
    first: dict[str, tuple[Any, str]] = {}
    for incident_id, _layer, received_at, alarm_id in rows:
        key = (received_at, alarm_id)
        if incident_id not in first or key < first[incident_id]:
            first[incident_id] = key
    counts: dict[tuple[str, str], int] = {}
    for incident_id, layer, received_at, alarm_id in rows:
        outcome = "opened" if first[incident_id] == (received_at, alarm_id) else "joined"
        counts[(str(layer), outcome)] = counts.get((str(layer), outcome), 0) + 1
    family = CounterMetricFamily(
        "sdcguard_alarms", "Alarms recorded, by layer and outcome.", labels=["layer", "outcome"]
    )
    for (layer, outcome), count in sorted(counts.items()):
        family.add_metric([layer, outcome], float(count))
    return family


class _IngestTimer:
    """Pure ASGI middleware timing the alarm routes into ``histogram``.

    Not Starlette's ``BaseHTTPMiddleware``: that runs the rest of the app in a task of its own
    behind memory streams for every request, which cost more CPU than the alarm itself in a
    4,096-rank storm; this one only wraps ``send`` to see the status.
    """

    def __init__(self, app: ASGIApp, histogram: Histogram) -> None:
        self.app = app
        self.histogram = histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in INGEST_ROUTES:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the server answers when the app raises before its response starts

        async def timed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            self.histogram.labels(path, str(status)).observe(time.perf_counter() - started)


def install_metrics(app: FastAPI, ledger: Ledger, backlog: Callable[[], Sequence[Any]]) -> None:
    """Add ``GET /metrics`` and the ingest-latency middleware to ``app`` (one registry per
    app, so two apps in one process never share series)."""
    registry = CollectorRegistry()
    registry.register(LedgerCollector(ledger, backlog))
    ingest = Histogram(
        "sdcguard_ingest_seconds",
        "Time to handle an alarm request, from arrival to response.",
        labelnames=["route", "status"],
        buckets=_BUCKETS,
        registry=registry,
    )

    app.add_middleware(_IngestTimer, histogram=ingest)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        from starlette.concurrency import run_in_threadpool

        try:
            body = await run_in_threadpool(generate_latest, registry)
        except Exception as err:  # a ledger error: the scrape fails, it never reads zeros
            log.error("metrics scrape failed: %s", err, extra={"error": type(err).__name__})
            return Response("ledger unavailable\n", status_code=503, media_type="text/plain")
        return Response(body, media_type=CONTENT_TYPE_LATEST)
