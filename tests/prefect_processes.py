"""Processes of a Prefect deployment under test: a server, ``prefect`` CLI calls, workers.

Shared by the tests that deploy ``prefect.yaml`` and run flows in a real ``prefect worker``
(``tests/flows/test_deploy.py``, ``tests/recovery/test_real_mode_e2e.py``). Each process runs in
its own process group from the repository root, so the worker's flow-run processes find the
code where ``prefect deploy`` recorded it, and a test's exit takes the whole group down.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import httpx
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.incident.approval.form import flow_run_name

__all__ = [
    "PREFECT",
    "REPO",
    "flow_run_state",
    "flow_run_state_full",
    "free_port",
    "kill",
    "prefect_healthy",
    "process",
    "run_cli",
    "wait_for",
]

REPO = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(what: str, check: Callable[[], bool], timeout_s: float, poll_s: float = 0.5) -> None:
    """Poll ``check`` until it is true; :class:`TimeoutError` naming ``what`` after the limit."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:g} s")
        time.sleep(poll_s)


def kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process group: no clean shutdown, as when a node or pod dies."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@contextlib.contextmanager
def process(
    argv: list[str], env: Mapping[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """Start a process in its own group; SIGINT (then SIGKILL) that group on the way out."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            env=dict(env),
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def run_cli(argv: list[str], env: Mapping[str, str]) -> str:
    """Run a CLI from the repository root; its stdout, or an assertion error with its output."""
    done = subprocess.run(
        argv, env=dict(env), cwd=REPO, capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, f"{argv} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def prefect_healthy(api_url: str) -> bool:
    try:
        return httpx.get(f"{api_url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def flow_run_state(api_url: str, incident_id: str) -> str | None:
    """The state type of the incident's flow run; ``None`` when it has no run yet."""
    state = flow_run_state_full(api_url, incident_id)
    return state[0] if state else None


def flow_run_state_full(api_url: str, incident_id: str) -> tuple[str, str] | None:
    """(type, name) of the incident's flow run's state; ``None`` when it has no run yet."""
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[flow_run_name(incident_id)]))
        )
    if not runs or runs[0].state is None:
        return None
    return runs[0].state.type.value, str(runs[0].state.name)
