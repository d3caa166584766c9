"""The trigger dispatcher and the local triggers: off the request path, retried, never lost."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from flows.webhook.trigger import (
    IncidentTrigger,
    LocalTrigger,
    NoTrigger,
    PrefectTrigger,
    RecordingTrigger,
    TriggerDispatcher,
    TriggerError,
)


class FlakyTrigger(RecordingTrigger):
    """Fails the first ``failures`` fires, then records."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.remaining = failures
        self.attempts = 0

    def fire(self, incident_id: str, job_id: str) -> None:
        self.attempts += 1
        if self.remaining > 0:
            self.remaining -= 1
            raise TriggerError(incident_id, "deployment not found")
        super().fire(incident_id, job_id)


class BlockingTrigger(RecordingTrigger):
    """Holds every fire until released, to observe the dispatcher while a fire is in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def fire(self, incident_id: str, job_id: str) -> None:
        self.entered.set()
        assert self.release.wait(10)
        super().fire(incident_id, job_id)


def test_every_trigger_satisfies_the_protocol() -> None:
    triggers: list[object] = [
        PrefectTrigger(),
        LocalTrigger(lambda _incident: None),
        RecordingTrigger(),
        NoTrigger(),
    ]
    assert all(isinstance(t, IncidentTrigger) for t in triggers)


def test_submit_does_not_wait_for_the_trigger() -> None:
    trigger = BlockingTrigger()
    dispatcher = TriggerDispatcher(trigger)
    dispatcher.start()
    try:
        assert dispatcher.submit("inc-1", "job-1")
        assert trigger.entered.wait(5)
        assert [p.incident_id for p in dispatcher.backlog()] == ["inc-1"]
        assert not dispatcher.submit("inc-1", "job-1"), "an incident in flight is not re-queued"
    finally:
        trigger.release.set()
        dispatcher.close()
    assert trigger.calls == [("inc-1", "job-1")]


def test_failed_fire_is_retried_with_backoff_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    trigger = FlakyTrigger(failures=2)
    dispatcher = TriggerDispatcher(trigger, retry_delays_s=(0.01, 0.02))
    dispatcher.start()
    try:
        dispatcher.submit("inc-1", "job-1")
        assert trigger.wait_for(1, timeout=10)
        assert dispatcher.wait_idle(10)
    finally:
        dispatcher.close()

    assert trigger.attempts == 3
    assert trigger.calls == [("inc-1", "job-1")]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2
    assert all(getattr(r, "incident", None) == "inc-1" for r in errors)
    assert "deployment not found" in errors[0].getMessage()


def test_close_returns_and_logs_what_was_never_started(caplog: pytest.LogCaptureFixture) -> None:
    trigger = FlakyTrigger(failures=1_000)
    dispatcher = TriggerDispatcher(trigger, retry_delays_s=(60.0,))
    dispatcher.start()
    dispatcher.submit("inc-1", "job-1")

    left = dispatcher.close(timeout=5)

    assert [(p.incident_id, p.attempts) for p in left] == [("inc-1", 1)]
    assert any("never started" in r.getMessage() for r in caplog.records)
    assert not dispatcher.submit("inc-2", "job-1"), "a closed dispatcher accepts nothing"


def test_resubmitting_a_waiting_retry_fires_it_now() -> None:
    trigger = FlakyTrigger(failures=1)
    dispatcher = TriggerDispatcher(trigger, retry_delays_s=(3600.0,))
    dispatcher.start()
    try:
        dispatcher.submit("inc-1", "job-1")
        deadline = time.monotonic() + 10
        while dispatcher.backlog()[0].last_error is None:  # failed and waiting for its retry
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert dispatcher.submit("inc-1", "job-1")
        assert trigger.wait_for(1, timeout=10)
    finally:
        dispatcher.close()
    assert trigger.attempts == 2


def test_local_trigger_runs_the_flow_in_a_worker_thread() -> None:
    ran: list[tuple[str, str]] = []
    done = threading.Event()

    def flow(incident_id: str) -> None:
        ran.append((incident_id, threading.current_thread().name))
        done.set()

    trigger = LocalTrigger(flow)
    trigger.fire("inc-1", "job-1")
    assert done.wait(10)
    trigger.close()

    assert ran[0][0] == "inc-1"
    assert ran[0][1].startswith("incident")


def test_local_trigger_logs_a_failed_flow(caplog: pytest.LogCaptureFixture) -> None:
    def flow(incident_id: str) -> None:
        raise RuntimeError(f"cordon failed for {incident_id}")

    trigger = LocalTrigger(flow)
    trigger.fire("inc-1", "job-1")
    trigger.close(wait=True)

    failed = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(failed) == 1
    assert getattr(failed[0], "incident", None) == "inc-1"


def test_closed_local_trigger_refuses_with_a_trigger_error() -> None:
    trigger = LocalTrigger(lambda _incident: None)
    trigger.close()
    with pytest.raises(TriggerError, match="closed"):
        trigger.fire("inc-1", "job-1")


def test_no_trigger_starts_nothing_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    NoTrigger().fire("inc-1", "job-1")
    assert any("starts no flow" in r.getMessage() for r in caplog.records)
