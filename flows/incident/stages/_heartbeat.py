"""The heartbeat of a running stage: its ledger claims' leases renewed while it works.

A claim's lease is what lets another run continue an incident whose run died without a word
(a SIGKILLed worker that Prefect has not yet marked ``Crashed``): once the lease has expired,
the next run takes the claim over. A lease that had to outlast the longest stage (a
replacement waits up to the policy's ``replacement_timeout_s``) would make that wait an hour;
so the lease is short (``SDCGUARD_FLOW_CLAIM_LEASE_S``, minutes) and a live stage renews it:
:class:`ClaimHeartbeat` holds the stage's claim, and the claim of the side effect in flight,
from a daemon thread, every third of the lease — two renewals may be missed before the lease
runs out.

Invariants:

* the heartbeat runs exactly while its stage body runs: :func:`flows.incident.stages.record_stage`
  starts it after winning the claim and stops it (joined) before the outcome is recorded,
  whatever ends the body — a return, an exception, or an engine signal (``BaseException``);
* a renewal that finds the claim lost (taken over, or no longer claimed) stops renewing and
  is remembered: :meth:`ClaimHeartbeat.check`, part of the check that precedes every
  destructive call (:func:`flows.incident.stages.perform`), raises that :class:`db.ClaimLost`, so a
  stage that lost its claim while it waited makes no further destructive call;
* a renewal the ledger refuses for another reason (the database briefly away) is logged and
  tried again at the next beat; if the lease runs out meanwhile, the ledger — not this
  thread — decides who holds the claim, and the next check finds out.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from types import TracebackType
from typing import Any

from db import ClaimLost, Ledger

__all__ = ["ClaimHeartbeat", "current_heartbeat"]

log = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 30.0


class ClaimHeartbeat:
    """Renew the leases of ``owner``'s claims on ``stage_key`` (and :meth:`hold`'s keys) every
    ``lease_s / 3`` seconds from a daemon thread, until :meth:`stop` or a lost claim."""

    def __init__(
        self,
        ledger: Ledger,
        stage_key: str,
        owner: str,
        lease_s: float,
        *,
        context: dict[str, Any],
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, not {lease_s!r}")
        self.stage_key = stage_key
        self.owner = owner
        self.lease_s = lease_s
        self.interval_s = lease_s / 3
        self._ledger = ledger
        self._extra = {**context, "owner": owner}
        self._keys: list[str] = [stage_key]
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._lost: ClaimLost | None = None
        self._beats = 0
        self._thread = threading.Thread(
            target=self._run, name=f"claim-heartbeat-{stage_key}", daemon=True
        )

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> ClaimHeartbeat:
        self._thread.start()
        log.debug("claim heartbeat started every %.1f s", self.interval_s, extra=self._extra)
        return self

    def stop(self) -> None:
        """Stop renewing and wait for a renewal in progress to end (idempotent)."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(_JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                log.error(
                    "claim heartbeat still renewing %.0f s after stop",
                    _JOIN_TIMEOUT_S,
                    extra=self._extra,
                )

    def __enter__(self) -> ClaimHeartbeat:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- what the stage sees ------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def beats(self) -> int:
        """Renewal rounds that reached the ledger and found every claim still ours."""
        return self._beats

    @property
    def lost(self) -> ClaimLost | None:
        """The loss a renewal found, or None while every claim was still ours at the last beat."""
        return self._lost

    def check(self) -> None:
        """Raise the :class:`db.ClaimLost` a renewal found; before every destructive call."""
        if self._lost is not None:
            raise self._lost

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[None]:
        """Renew ``key`` too for a block: the claim of the side effect the stage performs."""
        with self._lock:
            self._keys.append(key)
        try:
            yield
        finally:
            with self._lock:  # between rounds: never renewed after its outcome is recorded
                self._keys.remove(key)

    # -- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            try:
                # the whole round under the lock: a side effect's claim leaves the set (before
                # its outcome is recorded) only between rounds, never to be renewed after it
                with self._lock:
                    for key in self._keys:
                        self._ledger.hold_claim(key, self.owner, self.lease_s)
            except ClaimLost as err:
                self._lost = err
                log.warning(
                    "claim lost while the stage ran: %s; it makes no further destructive call",
                    err,
                    extra={**self._extra, "action": err.key, "holder": err.holder},
                )
                return
            except Exception as err:  # the ledger away: the lease decides; next beat retries
                log.error(
                    "claim lease not renewed: %s: %s; retrying in %.1f s",
                    type(err).__name__,
                    err,
                    self.interval_s,
                    extra=self._extra,
                )
                continue
            self._beats += 1


current_heartbeat: ContextVar[ClaimHeartbeat | None] = ContextVar(
    "sdcguard_stage_heartbeat", default=None
)
"""The heartbeat of the stage this code runs in (set by
:func:`flows.incident.stages.record_stage`)."""
