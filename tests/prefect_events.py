"""Prefect's per-process workers (events, API logs) emptied while their server is still up.

Prefect sends events from one background worker per process, bound to the API URL that was
current when the worker started. Left running across tests, it carries one test's server into
the next: a later test's events go to a server an earlier test started (and its check of the
event feed fails), or the worker drains at the end into a server that is gone and hangs the
session's teardown. So no worker outlives the test that started it (``tests/conftest.py``), and
a test that stops a server of its own empties the workers before it does (:func:`flush`).
"""

from __future__ import annotations

import sys

__all__ = ["PrefectWorkersStuck", "flush"]

DEFAULT_TIMEOUT_S = 60.0


class PrefectWorkersStuck(RuntimeError):
    """A worker still held events after the timeout: its server is gone or does not answer."""


def flush(timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Send what Prefect's events and API-log workers hold, and stop them; the next event
    starts a fresh worker bound to the API current then. Nothing to do where this process
    never imported Prefect's workers (most of the suite: importing Prefect costs seconds)."""
    for module_name, class_name in (
        ("prefect.events.worker", "EventsWorker"),
        ("prefect.logging.handlers", "APILogWorker"),
    ):
        module = sys.modules.get(module_name)
        if module is None:
            continue
        worker = getattr(module, class_name)
        pending = worker.drain_all(timeout=timeout_s, at_exit=False)[1]
        if pending:
            raise PrefectWorkersStuck(
                f"Prefect's {class_name} still sending after {timeout_s:g} s: a test stopped "
                "the server it sends to before flushing (tests.prefect_events.flush)"
            )
