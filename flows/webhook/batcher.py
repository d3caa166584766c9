"""Group commit of alarms: concurrent ``POST /v1/alarms`` become ``Ledger.record_alarms`` batches.

In a storm every rank of a job reports the same step at once, and one transaction per alarm
serialises on that job's row. So ``POST /v1/alarms`` validates its alarm completely (the signed
route's checks, the request model and the ledger's own checks), then hands it to
:class:`AlarmBatcher`, whose single writer records whatever has queued up meanwhile with one
``Ledger.record_alarms`` call. A lone alarm is written at once, and the alarms that arrive
during that write form the next batch; in a storm (alarms within 50 ms of the last batch) the
writer lingers two milliseconds first, so that the senders it just answered can join (group
commit). The contract per request is
unchanged: its own outcome, its own status, the trigger fired once for the alarm that opened
the incident.

Each request's nonce rides with its alarm and is claimed in the batch's own transaction
(``Ledger.record_fresh_alarms``): a replayed request is answered ``NonceReused`` (the endpoint's
401) with nothing written, and a nonce is consumed exactly when its alarm's outcome commits —
a batch that fails consumes none, so its re-sent alarms are not taken for replays. One
transaction per batch, where a separate nonce claim would be a second commit per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, TypeVar

from db import (
    AlarmIn,
    AlarmOutcome,
    Ledger,
    LedgerError,
    LedgerTemporaryError,
    LedgerUnavailable,
    NonceClaim,
    NonceReused,
    SchemaNotReady,
)
from flows.webhook.trigger import TriggerDispatcher

__all__ = ["DEFAULT_ALARM_BATCH", "AlarmBatcher", "AlarmQueue", "InThread"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# Alarms per ledger transaction. A 4,096-rank storm then commits in a handful of batches, and a
# batch stays short enough that no request waits long behind it.
DEFAULT_ALARM_BATCH = 512
# In a storm (an alarm arriving within _STORM_WINDOW_S of the last batch's end), how long the
# writer waits before taking the next batch. A batch costs a fixed number of round trips
# whatever its size, and the senders the last batch answered are about to send again: two
# milliseconds let more of them join, which in a 4,096-alarm burst on two cores shortened the
# burst by about a tenth. An alarm that finds the writer idle for longer is written at once.
_STORM_LINGER_S = 0.002
_STORM_WINDOW_S = 0.05
# How often a batch also deletes expired nonces: only the table's size depends on it.
_PRUNE_EVERY_S = 60.0


class InThread(Protocol):
    """Runs a synchronous ledger call in a worker thread, within the app's thread limit."""

    def __call__(self, fn: Callable[[], _T], /) -> Awaitable[_T]: ...


@dataclass(frozen=True)
class AlarmQueue:
    """A snapshot of the alarm writer: alarms waiting for the next batch, alarms in the ledger
    call now, and whether new alarms are still taken (false once shutdown began)."""

    waiting: int
    writing: int
    accepting: bool


_Result = AlarmOutcome | NonceReused


@dataclass(frozen=True)
class _QueuedAlarm:
    alarm: AlarmIn
    nonce: NonceClaim | None
    future: asyncio.Future[_Result]


class AlarmBatcher:
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
      ledger error is re-tried alarm by alarm (each with its own nonce, in its own
      transaction), so only the alarm at fault gets its error and only its nonce stays free;
    * a nonce is claimed in the transaction that records its alarm (``keep``: how long the
      ledger keeps it), never in one of its own.
    """

    def __init__(
        self,
        ledger: Ledger,
        dispatcher: TriggerDispatcher,
        in_thread: InThread,
        max_batch: int,
        *,
        keep: timedelta,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._ledger = ledger
        self._dispatcher = dispatcher
        self._in_thread = in_thread
        self._max_batch = max_batch
        self._keep = keep
        self._next_prune = 0.0  # monotonic time of the next batch that prunes expired nonces
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

    async def record(self, alarm: AlarmIn, nonce: NonceClaim | None = None) -> _Result:
        """Queue ``alarm`` (sent with ``nonce``) for the next batch; wait for its own outcome,
        :class:`db.NonceReused` when the nonce was used before (then nothing was written)."""
        if self._closing or self._task is None or self._task.done():
            raise LedgerUnavailable("the webhook is not accepting alarms now; send it again")
        future: asyncio.Future[_Result] = asyncio.get_running_loop().create_future()
        self._queue.append(_QueuedAlarm(alarm, nonce, future))
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
        last_write = -_STORM_WINDOW_S  # monotonic end of the last batch's write
        try:
            while True:
                if not self._queue:
                    if self._closing:
                        return
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                stormy = time.monotonic() - last_write < _STORM_WINDOW_S
                if stormy and len(self._queue) < self._max_batch and not self._closing:
                    await asyncio.sleep(_STORM_LINGER_S)  # let the answered senders catch up
                size = min(len(self._queue), self._max_batch)
                batch = [self._queue.popleft() for _ in range(size)]
                self._writing = size
                await self._write(batch)
                self._writing = 0
                batch = []
                last_write = time.monotonic()
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
        results: Sequence[_Result | BaseException]
        try:
            results = await self._record(batch)
        except Exception as err:  # a bug, not a refusal: each request answers 500
            logger.exception("recording a batch of %d alarms failed", len(batch))
            results = [err] * len(batch)
        for item, result in zip(batch, results, strict=True):
            if isinstance(result, AlarmOutcome) and result.opened:
                self._fire(item.alarm, result)
            _resolve(item, result)

    async def _record(self, batch: list[_QueuedAlarm]) -> Sequence[_Result | BaseException]:
        alarms = [item.alarm for item in batch]
        nonces = [item.nonce for item in batch]
        prune = time.monotonic() >= self._next_prune
        if prune:
            self._next_prune = time.monotonic() + _PRUNE_EVERY_S

        def record() -> list[_Result]:
            return self._ledger.record_fresh_alarms(alarms, nonces, keep=self._keep, prune=prune)

        try:
            return await self._in_thread(record)
        except (LedgerTemporaryError, SchemaNotReady) as err:
            logger.error("a batch of %d alarms was not recorded: %s", len(alarms), err)
            return [err] * len(alarms)
        except LedgerError as err:
            logger.warning(
                "a batch of %d alarms was refused (%s); recording them one by one",
                len(alarms),
                err,
            )
            return await self._in_thread(lambda: self._one_by_one(batch))

    def _one_by_one(self, batch: Sequence[_QueuedAlarm]) -> list[_Result | BaseException]:
        """Each alarm with its nonce in its own transaction; a ledger error answers only the
        alarm at fault, and its rolled-back nonce stays unclaimed (a re-send gets the same)."""
        results: list[_Result | BaseException] = []
        for item in batch:
            try:
                [result] = self._ledger.record_fresh_alarms(
                    [item.alarm], [item.nonce], keep=self._keep
                )
                results.append(result)
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


def _resolve(item: _QueuedAlarm, result: _Result | BaseException) -> None:
    """Answer one waiting request; a request that gave up (cancelled) needs no answer."""
    if item.future.done():
        return
    if isinstance(result, BaseException):
        item.future.set_exception(result)
    else:
        item.future.set_result(result)
