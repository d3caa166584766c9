"""Closing approvals nobody answered in time, even when no flow run is left to do it.

A suspended approval (:func:`flows.incident.approval.form.ask_for_approval` in a deployment run)
holds no process. When its timeout passes, Prefect's server fails the suspended run ("The flow was
paused and never resumed", its ``FailExpiredPauses`` service) without running any of the
flow's code, so the flow never records the expiry itself. The webhook service — which runs
whether or not a worker is up — therefore sweeps the ledger: an incident still
``awaiting_approval`` with no decision, whose recorded deadline passed, is closed ``expired``
(:meth:`db.Ledger.expire_overdue_approval`, atomic with a decision arriving at the same time)
and a human is told, as the flow would have.

Invariant: the sweep only closes what is overdue by more than ``grace_s``, so an in-process
pause (which expires itself at the deadline) always wins the race to record its own expiry.
"""

from __future__ import annotations

import logging
import threading

from db import IncidentState, IncidentView, Ledger
from flows.incident.notify import NeedsHuman, needs_human
from flows.settings import ExpirySettings

__all__ = ["ExpirySweeper", "close_overdue_approvals"]

log = logging.getLogger(__name__)


def close_overdue_approvals(ledger: Ledger, *, grace_s: float) -> list[IncidentView]:
    """Close every overdue approval in the ledger; return the incidents closed now."""
    closed: list[IncidentView] = []
    for incident in ledger.list_incidents(state=IncidentState.AWAITING_APPROVAL):
        expired = ledger.expire_overdue_approval(incident.id, grace_s=grace_s)
        if expired is None:
            continue
        closed.append(expired)
        log.warning(
            "approval overdue: incident closed expired",
            extra={"incident": expired.id, "job": expired.job_id},
        )
        try:
            needs_human(
                expired.id,
                expired.job_id,
                NeedsHuman.EXPIRED,
                f"{expired.reason}; `sdcguard incident retry {expired.id}` asks again",
            )
        except Exception as err:  # the ledger is right; paging failed: say so, keep sweeping
            log.error("could not page for %s: %s", expired.id, err, extra={"incident": expired.id})
    return closed


class ExpirySweeper:
    """A daemon thread running :func:`close_overdue_approvals` every ``interval_s``."""

    def __init__(self, ledger: Ledger, settings: ExpirySettings | None = None) -> None:
        self._ledger = ledger
        self._settings = settings or ExpirySettings()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sdcguard-expiry", daemon=True)

    def start(self) -> ExpirySweeper:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def __enter__(self) -> ExpirySweeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self._settings.interval_s):
            try:
                close_overdue_approvals(self._ledger, grace_s=self._settings.grace_s)
            except Exception as err:  # a ledger outage must not end the sweeping
                log.error("expiry sweep failed: %s", err)
