"""Refusing replays of the signed POSTs other than alarms: each nonce claimed before the write.

Invariant: a request whose nonce was claimed before (by this replica or another, within the
keep time of more than twice the signing window) is refused with 401 and changes nothing; later
than that its timestamp is outside the window and it is refused anyway. Claims are grouped:
while one ledger transaction claims a batch, the nonces that arrive meanwhile form the next.

Alarms do not come here: the alarm batch claims each request's nonce in the transaction that
records its alarm (:mod:`flows.webhook.batcher`), in the ledger on either backend, so an alarm
storm costs no extra commit and a failed batch consumes no nonce. A signed nonce cannot move
between the two stores: the signature binds the path.

Where the other nonces live: in the ledger (``request_nonces``) on PostgreSQL, so every
replica refuses a replay another one accepted. On the embedded SQLite ledger — one machine, one
webhook process — they live in this process: a nonce seen before a restart is forgotten by the
new process, so a replay of a rank registration, checkpoint, audit or trigger *within the
signing window of a restart* is not caught there (its timestamp still bounds it to the window;
alarms are caught, their nonces are in the ledger). Use PostgreSQL wherever that matters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from db import Ledger, LedgerUnavailable
from flows.webhook.batcher import InThread

__all__ = ["NonceStore"]

logger = logging.getLogger(__name__)

_MAX_BATCH = 1024


@dataclass(frozen=True)
class _Claim:
    nonce: str
    key_id: str
    future: asyncio.Future[bool]


class NonceStore:
    """Claims nonces in batches; :meth:`claim` answers whether this is the nonce's first use."""

    def __init__(
        self, ledger: Ledger, in_thread: InThread, window_s: int, *, shared: bool = True
    ) -> None:
        self._ledger = ledger
        self._in_thread = in_thread
        self._keep = timedelta(seconds=2 * window_s + 60)
        self._shared = shared
        self._local: OrderedDict[str, float] = OrderedDict()  # nonce -> monotonic expiry
        self._queue: deque[_Claim] = deque()
        self._wakeup = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None

    @property
    def keep(self) -> timedelta:
        """How long a nonce is kept: more than twice the signing window."""
        return self._keep

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="sdcguard-nonce-store"
            )

    async def close(self) -> None:
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await self._task

    async def claim(self, nonce: str, key_id: str) -> bool:
        if not self._shared:
            return self._claim_locally(nonce)
        if self._closing or self._task is None or self._task.done():
            raise LedgerUnavailable("the webhook is not accepting requests now; send it again")
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue.append(_Claim(nonce, key_id, future))
        self._wakeup.set()
        return await future

    def _claim_locally(self, nonce: str) -> bool:
        """The in-process store: insertion order is expiry order, so pruning pops the front."""
        now = time.monotonic()
        while self._local and next(iter(self._local.values())) < now:
            self._local.popitem(last=False)
        if nonce in self._local:
            return False
        self._local[nonce] = now + self._keep.total_seconds()
        return True

    async def _run(self) -> None:
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = [self._queue.popleft() for _ in range(min(_MAX_BATCH, len(self._queue)))]
            await self._write(batch)

    async def _write(self, batch: Sequence[_Claim]) -> None:
        pairs = [(c.nonce, c.key_id) for c in batch]
        try:
            fresh = await self._in_thread(lambda: self._ledger.claim_nonces(pairs, keep=self._keep))
        except Exception as err:  # every waiter gets the error; the loop goes on
            logger.error("could not claim %d nonces: %s", len(batch), err)
            for claim in batch:
                if not claim.future.done():
                    claim.future.set_exception(err)
            return
        for claim, first in zip(batch, fresh, strict=True):
            if not claim.future.done():
                claim.future.set_result(first)
