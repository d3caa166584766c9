"""The demo's incident flow: run in a daemon thread, followed through the ledger, and — with
approval in the UI — the address of its paused run on the one Prefect server.

Everything printed here is read back from a record (the ledger's stage actions, the Prefect
run's state): the demo says what happened, never what it expects to happen.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.input.run_input import keyset_from_paused_state
from rich.console import Console
from rich.markup import escape

from db import Ledger
from flows.incident.approval.form import flow_run_name
from flows.incident.flow import respond
from flows.incident.policy import IncidentPolicy
from flows.local.prefect_server import PrefectServer
from recovery.local.process_group import group_alive

__all__ = ["DemoError", "FlowThread", "follow_flow", "stop_record"]

log = logging.getLogger(__name__)


class DemoError(RuntimeError):
    """The demo could not show what it promises; the message says which step and why."""


class _Progress:
    """Prints each incident stage once, as the ledger records it: the flow's own record."""

    def __init__(self, console: Console, ledger: Ledger) -> None:
        self._console = console
        self._ledger = ledger
        self._seen: set[tuple[str, str]] = set()

    def poll(self, incident_id: str) -> str:
        incident = self._ledger.get_incident(incident_id)
        for action in incident.actions:
            if action.kind != "stage":
                continue
            key = (action.target, action.status.value)
            if key in self._seen or action.status.value == "claimed":
                continue
            self._seen.add(key)
            # the ledger's words, printed as they are (never read as console markup)
            outcome = escape(str((action.detail or {}).get("outcome", "")))
            colour = "green" if action.status.value == "succeeded" else "red"
            self._console.print(
                f"  [{colour}]✔[/] [bold]{action.target}[/] — {outcome}"
                if colour == "green"
                else f"  [red]✘ {action.target}[/] — {outcome}"
            )
        return incident.state.value


class FlowThread:
    """The demo's trigger: the incident flow for each opened incident, in a daemon thread.

    A daemon, so that an interrupted demo (Ctrl-C, SIGTERM) ends without waiting for a flow
    paused for approval on a server that is being stopped; the ledger keeps where it was.
    """

    def __init__(self, policy: IncidentPolicy) -> None:
        self._policy = policy
        self._lock = threading.Lock()
        self._started: set[str] = set()
        self.finished = threading.Event()
        self.summary: dict[str, Any] = {}
        self.error: BaseException | None = None

    def fire(self, incident_id: str, job_id: str) -> None:
        with self._lock:
            if incident_id in self._started:
                return
            self._started.add(incident_id)
        threading.Thread(
            target=self._run, args=(incident_id,), name=f"incident-{incident_id}", daemon=True
        ).start()

    def _run(self, incident_id: str) -> None:
        try:
            self.summary.update(respond(incident_id, self._policy))
        except BaseException as err:  # reported by the demo's main thread
            self.error = err
            log.error("incident flow failed: %r", err, extra={"incident": incident_id})
        finally:
            self.finished.set()


def follow_flow(
    console: Console,
    ledger: Ledger,
    flow: FlowThread,
    incident_id: str,
    *,
    timeout_s: float,
    approve_at: PrefectServer | None,
) -> dict[str, Any]:
    """Print each stage as the ledger records it and, with ``approve_at``, the address of the
    paused run on that server once its form is up. Returns the summary of a resolved incident;
    anything else is a :class:`DemoError`."""
    progress = _Progress(console, ledger)
    deadline = time.monotonic() + timeout_s
    shown = approve_at is None
    while not flow.finished.wait(0.5):
        state = progress.poll(incident_id)
        if not shown and state == "awaiting_approval":
            run_id = _paused_run(incident_id)
            if run_id is not None:
                shown = True
                assert approve_at is not None
                _show_approval(console, incident_id, approve_at.flow_run_url(run_id))
        if time.monotonic() > deadline:
            raise DemoError(f"the incident flow did not finish within {timeout_s} s")
    state = progress.poll(incident_id)
    if flow.error is not None:
        raise DemoError(f"the incident flow failed: {flow.error!r}") from flow.error
    if state != "resolved":
        raise DemoError(f"the incident ended {state!r}: {flow.summary.get('reason')}")
    return flow.summary


def _paused_run(incident_id: str) -> UUID | None:
    """The incident's flow run once it is paused *and* its form is saved (just after the pause;
    a UI opened in between would find no form to show)."""
    name = flow_run_name(incident_id)
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name]))
        )
        for run in runs:
            if run.state is None or not run.state.is_paused():
                continue
            keyset = keyset_from_paused_state(run.state)
            if client.filter_flow_run_input(
                run.id, key_prefix=keyset["schema"], limit=1, exclude_keys=set()
            ):
                return run.id
    return None


def _show_approval(console: Console, incident_id: str, url: str) -> None:
    console.print(
        f"  [yellow]waiting for approval[/] of incident {incident_id}: open the paused run, "
        "read the evidence, choose Resume and answer the form:"
    )
    # one unwrapped line, no markup: the address must survive a narrow terminal and a pipe
    console.print(f"  approve at {url}", soft_wrap=True, markup=False, highlight=False)


def stop_record(ledger: Ledger, incident_id: str, pid: int, running: bool) -> dict[str, Any]:
    """How the flow's stop stage found the faulty job, as its ledger action says, and whether
    the process it was is gone."""
    incident = ledger.get_incident(incident_id)
    stop = next((a for a in incident.actions if a.kind == "stop-job"), None)
    detail = (stop.detail or {}) if stop is not None else {}
    return {
        "running_at_alarm": running,
        "result": detail.get("stop"),
        "detail": detail.get("detail"),
        "pid": pid,
        "pid_alive": group_alive(pid),
    }
