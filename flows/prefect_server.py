"""A local ``prefect server start`` with its UI, for the demo's approval in the UI and its test.

Prefect's in-process (ephemeral) API serves no UI, so approving by hand needs a real server.
The server gets its own ``PREFECT_HOME`` (its SQLite database) so nothing of the operator's
profile is touched, and is stopped with SIGINT — the shutdown Prefect handles cleanly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

__all__ = ["PrefectServerError", "local_prefect_server"]


class PrefectServerError(RuntimeError):
    """The server did not come up in time; its log says why."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def local_prefect_server(home: Path, *, startup_timeout_s: float = 120.0) -> Iterator[str]:
    """Start the server on a free loopback port; yield its API URL (``…/api``)."""
    home.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_UI_API_URL": api_url,
    }
    env.pop("PREFECT_API_URL", None)
    log_path = home / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
             "--port", str(port)],
            stdout=log,
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
            yield api_url
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
