"""What starts the incident flow once an alarm has opened an incident.

The webhook calls a trigger only for the alarm whose ``record_alarm`` returned ``opened=True``:
the ledger decides, in one transaction, which alarm opened the incident, so one incident starts
one flow however many ranks report it. The trigger is the last line of that guarantee:
:class:`PrefectTrigger` also hands Prefect an idempotency key, so even a second ``fire`` for the
same incident (a retry, a restart that re-fires open incidents) cannot create a second run.

Firing talks to outside systems and may be slow or fail, so the webhook never calls a trigger on
the request path: :class:`TriggerDispatcher` fires from its own thread and keeps failed fires in
a retry queue (logged at ERROR) — the alarm is already in the ledger, and a trigger failure must
never lose it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

__all__ = [
    "DEFAULT_RETRY_DELAYS_S",
    "INCIDENT_OPENED_EVENT",
    "IncidentTrigger",
    "LocalTrigger",
    "NoTrigger",
    "PendingFire",
    "PrefectTrigger",
    "RecordingTrigger",
    "TriggerDispatcher",
    "TriggerError",
    "incident_event_id",
]

logger = logging.getLogger(__name__)

INCIDENT_OPENED_EVENT = "sdcguard.incident.opened"
DEFAULT_RETRY_DELAYS_S: tuple[float, ...] = (1.0, 2.0, 5.0, 15.0, 60.0)
# uuid5 namespace of the incident-opened events: a re-fired incident emits the same event id,
# which Prefect's event store keeps once.
_EVENT_NAMESPACE = uuid.UUID("5d1c6a0e-6f3b-4c1e-9b8e-2f4f0d6a7c11")


class TriggerError(Exception):
    """Starting the flow for an incident failed; the dispatcher retries it.

    Every trigger failure is treated as temporary: a missing deployment or an unreachable Prefect
    API is fixed by an operator while the incident waits, and re-firing is idempotent.
    """

    def __init__(self, incident_id: str, reason: str) -> None:
        super().__init__(f"incident {incident_id}: {reason}")
        self.incident_id = incident_id
        self.reason = reason


@runtime_checkable
class IncidentTrigger(Protocol):
    """Starts the incident-response flow for an incident the ledger has just opened."""

    def fire(self, incident_id: str, job_id: str) -> None:
        """Start the flow; raise :class:`TriggerError` (or any error) if it could not be started.

        May block for a while (network); the webhook calls it off the request path.
        """
        ...


def incident_event_id(incident_id: str) -> uuid.UUID:
    """Deterministic id of the ``sdcguard.incident.opened`` event of one incident."""
    return uuid.uuid5(_EVENT_NAMESPACE, incident_id)


class PrefectTrigger:
    """Creates a flow run of a Prefect deployment and emits ``sdcguard.incident.opened``.

    Prefect's open-source server has no inbound webhooks, which is why sdcguard runs its own
    service. Two ways remain to start a run from it: emit an event and let an *automation* on that
    event run the deployment, or call ``run_deployment`` directly. We call it directly because:

    * ``emit_event`` is fire-and-forget (it returns ``None`` and logs if the events websocket is
      down), so the service could never know whether a run was started; ``run_deployment`` either
      returns the flow run or raises, and a failure goes to the dispatcher's retry queue;
    * the idempotency key ``incident-<id>`` makes Prefect itself refuse a second run of the same
      incident, which an automation (one run per matching event) does not give us;
    * nothing has to be configured on the Prefect server besides the deployment.

    The event is emitted as well, with an id derived from the incident id (re-fires do not
    duplicate it), so the alarm shows in Prefect's event feed and operators can hang their own
    automations (notifications, paging) on it.
    """

    def __init__(self, deployment: str = "incident-response/incident") -> None:
        self.deployment = deployment

    def fire(self, incident_id: str, job_id: str) -> None:
        # Imported here: importing prefect costs seconds, and only this trigger needs it.
        from prefect.events import emit_event

        emit_event(
            event=INCIDENT_OPENED_EVENT,
            resource={
                "prefect.resource.id": f"sdcguard.incident.{incident_id}",
                "prefect.resource.name": incident_id,
            },
            related=[
                {
                    "prefect.resource.id": f"sdcguard.job.{job_id}",
                    "prefect.resource.role": "job",
                    "prefect.resource.name": job_id,
                }
            ],
            payload={"incident_id": incident_id, "job_id": job_id},
            id=incident_event_id(incident_id),
        )
        self._run(incident_id, job_id, f"incident-{incident_id}")

    def fire_retry(self, incident_id: str, job_id: str, retry: int) -> None:
        """Start the run of an operator's retry number ``retry`` (its own idempotency key)."""
        self._run(incident_id, job_id, f"incident-{incident_id}-retry-{retry}")

    def _run(self, incident_id: str, job_id: str, key: str) -> None:
        from prefect.client.schemas.objects import FlowRun
        from prefect.deployments import run_deployment

        extra = {"incident": incident_id, "job": job_id}
        try:
            flow_run = run_deployment(
                name=self.deployment,
                parameters={"incident_id": incident_id},
                timeout=0,
                idempotency_key=key,
                as_subflow=False,
            )
        except Exception as err:
            raise TriggerError(
                incident_id, f"could not run deployment {self.deployment!r}: {err}"
            ) from err
        # run_deployment dispatches on the caller: from this (non-async) thread it is synchronous.
        if not isinstance(flow_run, FlowRun):
            raise TriggerError(incident_id, "run_deployment returned a coroutine in a sync context")
        logger.info(
            "incident flow run %s created from deployment %s",
            flow_run.id,
            self.deployment,
            extra={**extra, "flow_run": str(flow_run.id)},
        )


class LocalTrigger:
    """Runs the incident flow in worker threads of this service (``--trigger local``).

    ``fire`` only submits, so the dispatcher is never blocked for the length of a flow. A flow
    that fails is the flow's own failure (recorded in the ledger by the flow), not a trigger
    failure: it is logged here and not re-submitted.
    """

    def __init__(self, run: Callable[[str], object], *, max_workers: int = 2) -> None:
        self._run = run
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="incident")

    def fire(self, incident_id: str, job_id: str) -> None:
        try:
            future = self._pool.submit(self._run, incident_id)
        except RuntimeError as err:  # the pool is shut down
            raise TriggerError(incident_id, "the local flow runner is closed") from err
        future.add_done_callback(lambda f: self._report(f, incident_id, job_id))

    @staticmethod
    def _report(future: Future[object], incident_id: str, job_id: str) -> None:
        err = future.exception()
        extra = {"incident": incident_id, "job": job_id}
        if err is not None:
            logger.error("incident flow failed: %r", err, extra=extra, exc_info=err)
        else:
            logger.info("incident flow finished", extra=extra)

    def close(self, wait: bool = True) -> None:
        """Stop taking incidents; with ``wait`` let the running flows finish."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)


class RecordingTrigger:
    """Records every fire (tests); ``wait_for`` blocks until a number of fires arrived."""

    def __init__(self) -> None:
        self._calls: list[tuple[str, str]] = []
        self._changed = threading.Condition()

    def fire(self, incident_id: str, job_id: str) -> None:
        with self._changed:
            self._calls.append((incident_id, job_id))
            self._changed.notify_all()

    @property
    def calls(self) -> list[tuple[str, str]]:
        with self._changed:
            return list(self._calls)

    def wait_for(self, count: int, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: len(self._calls) >= count, timeout)


class NoTrigger:
    """Starts nothing (``--trigger none``): the incident waits in the ledger for an operator."""

    def fire(self, incident_id: str, job_id: str) -> None:
        logger.info(
            "incident opened; trigger mode 'none' starts no flow",
            extra={"incident": incident_id, "job": job_id},
        )


@dataclass(order=True)
class PendingFire:
    """An incident whose flow has not been started yet, and when it is tried next."""

    due: float
    seq: int
    incident_id: str = field(compare=False)
    job_id: str = field(compare=False)
    attempts: int = field(default=0, compare=False)
    last_error: str | None = field(default=None, compare=False)


class TriggerDispatcher:
    """Fires a trigger from one background thread, retrying failures with backoff.

    Invariants: ``submit`` never blocks on the trigger; an incident is queued at most once at a
    time (a second submit while it waits is a no-op); a failed fire stays queued, retried after
    ``retry_delays_s`` (the last delay repeats) and logged at ERROR each time, until it succeeds
    or the service stops — then :meth:`close` logs the incidents left unstarted, and returns them.
    """

    def __init__(
        self,
        trigger: IncidentTrigger,
        *,
        retry_delays_s: Sequence[float] = DEFAULT_RETRY_DELAYS_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not retry_delays_s or min(retry_delays_s) < 0:
            raise ValueError("retry_delays_s must be a non-empty sequence of delays >= 0")
        self.trigger = trigger
        self._delays = tuple(retry_delays_s)
        self._clock = clock
        self._heap: list[PendingFire] = []
        self._queued: dict[str, PendingFire] = {}
        self._in_flight: str | None = None
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._loop, name="sdcguard-trigger", daemon=True)
            self._thread.start()

    def submit(self, incident_id: str, job_id: str) -> bool:
        """Fire as soon as possible; a queued incident waiting for a retry is moved forward.

        Returns False only when nothing was queued: the incident is being fired right now, or
        the dispatcher is closing (logged at ERROR).
        """
        with self._cond:
            if self._closing:
                logger.error(
                    "incident opened while the service stops; its flow is not started",
                    extra={"incident": incident_id, "job": job_id},
                )
                return False
            if incident_id == self._in_flight:
                return False
            queued = self._queued.get(incident_id)
            if queued is not None:
                queued.due = self._clock()
                heapq.heapify(self._heap)
            else:
                pending = PendingFire(self._clock(), next(self._seq), incident_id, job_id)
                self._queued[incident_id] = pending
                heapq.heappush(self._heap, pending)
            self._cond.notify_all()
            return True

    def backlog(self) -> list[PendingFire]:
        """Incidents whose flow is queued, being started or waiting for a retry."""
        with self._cond:
            return sorted(self._queued.values())

    def wait_idle(self, timeout: float) -> bool:
        """Block until nothing is queued or in flight; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._queued and self._in_flight is None, timeout
            )

    def close(self, timeout: float = 10.0) -> list[PendingFire]:
        """Fire what is due within ``timeout``, stop, and return the incidents left unstarted."""
        deadline = self._clock() + timeout
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    self._in_flight is None
                    and not any(p.attempts == 0 for p in self._queued.values())
                ),
                max(0.0, deadline - self._clock()),
            )
            self._closing = True
            self._cond.notify_all()
            left = sorted(self._queued.values())
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - self._clock()))
        for pending in left:
            logger.error(
                "incident flow was never started (%d attempts, last error: %s); it is re-fired "
                "when the service starts again while the incident is still open",
                pending.attempts,
                pending.last_error,
                extra={"incident": pending.incident_id, "job": pending.job_id},
            )
        return left

    def _next_due(self) -> PendingFire | None:
        """Pop the earliest due fire, waiting for it; None once closing. Holds ``_cond``."""
        while not self._closing:
            if self._heap:
                wait = self._heap[0].due - self._clock()
                if wait <= 0:
                    pending = heapq.heappop(self._heap)
                    pending.attempts += 1
                    self._in_flight = pending.incident_id
                    return pending
                self._cond.wait(wait)
            else:
                self._cond.wait()
        return None

    def _loop(self) -> None:
        while True:
            with self._cond:
                pending = self._next_due()
            if pending is None:
                return
            extra = {"incident": pending.incident_id, "job": pending.job_id}
            try:
                self.trigger.fire(pending.incident_id, pending.job_id)
            except Exception as err:
                delay = self._delays[min(pending.attempts - 1, len(self._delays) - 1)]
                reason = str(err) or type(err).__name__
                logger.error(
                    "starting the incident flow failed (attempt %d), retrying in %.0f s: %s",
                    pending.attempts,
                    delay,
                    reason,
                    extra=extra,
                    exc_info=err,
                )
                with self._cond:
                    pending.last_error = reason
                    pending.due = self._clock() + delay
                    pending.seq = next(self._seq)
                    heapq.heappush(self._heap, pending)
                    self._in_flight = None
                    self._cond.notify_all()
            else:
                # say what the trigger did, not what it might have done: NoTrigger starts nothing
                logger.debug(
                    "trigger %s handled the incident", type(self.trigger).__name__, extra=extra
                )
                with self._cond:
                    del self._queued[pending.incident_id]
                    self._in_flight = None
                    self._cond.notify_all()
