"""One Prefect API for a local command: the one at ``PREFECT_API_URL``, or a server started here.

``sdcguard demo`` and ``sdcguard replay-incident`` run the incident flow in this process and
answer (or let a person answer) its approval form. Everything involved — the flow, the
approver, the events worker, the printed UI address — must talk to one and the same server:
Prefect's fallback, a temporary ("ephemeral") server started by whichever client first finds no
API URL, gives each thread that races to it a server of its own, serves no UI, and outlives a
killed command. So :func:`one_prefect_server` either uses the configured API, or starts one
``prefect server start`` (with its UI) and points this whole process at it, with ephemeral mode
switched off so that nothing can quietly start a second one.

Prefect reads its settings once, at import, into a global settings context that every thread
without a context of its own uses; setting ``PREFECT_API_URL`` in the environment afterwards is
not seen. Hence the environment *and* a refresh of that global context, both undone on exit.

The started server runs in a session (process group) of its own, with its own
``PREFECT_HOME`` (its SQLite database) so nothing of the operator's profile is touched. On exit
— normal, an error, or the ``KeyboardInterrupt``/:class:`Terminated` of Ctrl-C or SIGTERM —
the events this process still holds are sent while the server is up, then the group gets
SIGINT (the shutdown Prefect handles cleanly) and, after a bounded wait, SIGKILL: no process of
the server outlives the command.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import httpx

from recovery.local.process_group import group_alive

__all__ = [
    "PrefectServer",
    "PrefectServerError",
    "Terminated",
    "local_prefect_server",
    "one_prefect_server",
    "sigterm_raises",
]

log = logging.getLogger(__name__)

# Starting means migrating a new SQLite database: 15-25 s on two idle cores, minutes on a busy
# machine. A newcomer's first command must not fail for that.
_STARTUP_TIMEOUT_S = 600.0
_STOP_TIMEOUT_S = 20.0
_DRAIN_TIMEOUT_S = 15.0


class PrefectServerError(RuntimeError):
    """The server did not come up in time; its log says why."""


class Terminated(BaseException):
    """SIGTERM arrived: unwind like Ctrl-C, so every cleanup runs (exit status 143)."""


@dataclass(frozen=True)
class PrefectServer:
    """The one API this process talks to, and where a person finds it in a browser."""

    api_url: str
    ui_url: str
    started_here: bool
    """True for a server this process started (and stops); False for ``PREFECT_API_URL``'s."""

    def flow_run_url(self, flow_run_id: object) -> str:
        """The UI's page of one flow run: where its approval form is (Resume)."""
        return f"{self.ui_url}/runs/flow-run/{flow_run_id}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def local_prefect_server(
    home: Path, *, startup_timeout_s: float = _STARTUP_TIMEOUT_S
) -> Iterator[str]:
    """Start ``prefect server start`` (API and UI) on a free loopback port in a process group
    of its own; yield its API URL (``…/api``); stop the whole group on exit."""
    home.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_UI_API_URL": api_url,
    }
    log_path = home / "server.log"
    with log_path.open("wb") as server_log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
             "--port", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=server_log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + startup_timeout_s
            while True:
                if proc.poll() is not None:
                    raise PrefectServerError(f"prefect server exited; see {log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{api_url}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise PrefectServerError(f"prefect server not up in time; see {log_path}")
                time.sleep(0.5)
            log.info("prefect server up at %s (pid %d)", api_url, proc.pid)
            yield api_url
        finally:
            _stop_group(proc)


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT to the server's process group, SIGKILL to what is left after a bounded wait."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning(
            "prefect server %d not gone %.0f s after SIGINT: SIGKILL", proc.pid, _STOP_TIMEOUT_S
        )
    # The leader may be gone while a child it started lives on: the group is what is killed.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # SIGKILL is delivered, not yet acted on, when killpg returns: the command ends only once no
    # member of the group is left, so nothing of the server is seen running after it.
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    while group_alive(proc.pid):
        if time.monotonic() > deadline:
            log.error("prefect server group %d still has members after SIGKILL", proc.pid)
            break
        time.sleep(0.02)


@contextlib.contextmanager
def one_prefect_server(home: Path) -> Iterator[PrefectServer]:
    """The API at ``PREFECT_API_URL`` (environment or profile) if one is set, else a server
    started under ``home``; for the block, this whole process — every thread — uses it."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url:
        api_url = settings.api.url.rstrip("/")
        ui_url = (settings.ui_url or api_url.removesuffix("/api")).rstrip("/")
        yield PrefectServer(api_url=api_url, ui_url=ui_url, started_here=False)
        return
    with (
        local_prefect_server(home) as api_url,
        _process_settings(PREFECT_API_URL=api_url, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE="false"),
    ):
        try:
            yield PrefectServer(
                api_url=api_url, ui_url=api_url.removesuffix("/api"), started_here=True
            )
        finally:
            _drain_prefect_workers()


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """Set environment variables for the block; the previous values (or their absence) are
    restored after it, whatever ends it."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@contextlib.contextmanager
def _process_settings(**values: str) -> Iterator[None]:
    """Set Prefect settings for the whole process (environment and global context)."""
    from prefect.context import refresh_global_settings_context

    try:
        with environ(**values):
            refresh_global_settings_context()
            yield
    finally:
        refresh_global_settings_context()


def _drain_prefect_workers() -> None:
    """Send the events and logs Prefect's per-process workers still hold, while the server
    is up: drained at interpreter exit instead, they would wait on a server that is gone."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (EventsWorker, APILogWorker):
        try:
            worker.drain_all(timeout=_DRAIN_TIMEOUT_S, at_exit=False)
        except Exception:  # the server is stopped next either way; say what was not sent
            log.warning("could not send what %s held", worker.__name__, exc_info=True)


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    # Once: a second SIGTERM must not interrupt the unwinding that stops the server.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`Terminated` in the main thread, so the
    command unwinds (servers, training processes stopped) as it does on Ctrl-C."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
