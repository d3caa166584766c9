"""Running the webhook: ``sdcguard serve`` in the foreground, or a server in a thread.

``serve`` is the production entry point: migrate the ledger, build the trigger, run uvicorn in
one process. One process is enough and keeps the trigger dispatcher single: the ledger is the
serialisation point of an alarm storm (every alarm of a storm lands on the same incident row),
so more worker processes add lock contention, not throughput — see ``benchmarks/webhook.py``.

``run_in_thread`` runs the same app on loopback inside the current process, for the tests and
the demo: it binds the socket first (so port 0 gives a free port and no race), and returns only
once uvicorn has finished its start-up, lifespan included.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.types import ASGIApp

from db import Ledger
from db.migrate import upgrade
from flows.settings import (
    DatabaseSettings,
    PrefectTriggerSettings,
    WebhookSettings,
    load_settings,
)
from flows.trigger import (
    IncidentTrigger,
    LocalTrigger,
    NoTrigger,
    PrefectTrigger,
    TriggerMode,
)
from flows.webhook import create_app

__all__ = ["ServerStartError", "make_trigger", "run_in_thread", "serve"]

logger = logging.getLogger(__name__)


class ServerStartError(RuntimeError):
    """uvicorn did not come up (port taken, lifespan start-up failed, timeout)."""


def make_trigger(mode: TriggerMode) -> IncidentTrigger:
    """The trigger for ``--trigger``; ``local`` runs the incident flow in this process."""
    if mode is TriggerMode.PREFECT:
        return PrefectTrigger(load_settings(PrefectTriggerSettings).deployment)
    if mode is TriggerMode.LOCAL:
        # ``respond`` returns the ledger's summary whatever the outcome (an expired pause is a
        # failed Prefect run); the flow records its own failures in the ledger.
        from flows.incident import respond

        return LocalTrigger(respond)
    return NoTrigger()


def serve(
    host: str,
    port: int,
    trigger_mode: TriggerMode | str,
    database_url: str | None = None,
) -> None:
    """Run the webhook until interrupted (``sdcguard serve``).

    The secret and limits come from :class:`WebhookSettings` (``SDCGUARD_WEBHOOK_*``), the ledger
    from ``database_url`` or :class:`DatabaseSettings`. The ledger schema is migrated first, so a
    fresh database works and an old one is brought up to date before any alarm is accepted.
    """
    mode = TriggerMode(trigger_mode)
    webhook = load_settings(WebhookSettings)
    url = database_url or load_settings(DatabaseSettings).url
    upgrade(url)
    ledger = Ledger.from_url(url)
    trigger = make_trigger(mode)
    app = create_app(
        ledger,
        trigger,
        webhook.secret.get_secret_value(),
        max_body_bytes=webhook.max_body_bytes,
        window_s=webhook.window_s,
    )
    logger.info(
        "serving the sdcguard webhook on %s:%d (trigger %s, ledger %s)",
        host,
        port,
        mode.value,
        ledger.engine.url.render_as_string(hide_password=True),
    )
    try:
        # Access logs off: one line per alarm of a 4,096-rank storm costs more than the alarm;
        # refusals, opened incidents and trigger failures are logged by the app itself.
        uvicorn.run(app, host=host, port=port, access_log=False, log_level="info")
    finally:
        if isinstance(trigger, LocalTrigger):
            trigger.close(wait=False)
        ledger.engine.dispose()


class _ThreadServer(uvicorn.Server):
    """A uvicorn server that says when its start-up is over and leaves signals alone.

    ``startup_over`` is set once start-up finished, failed, or the thread died; ``started`` then
    tells which. Signal handling stays with whoever owns the main thread.
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.startup_over = threading.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets=sockets)
        finally:
            self.startup_over.set()

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextmanager
def run_in_thread(
    app: ASGIApp,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    startup_timeout_s: float = 60.0,
) -> Iterator[str]:
    """Serve ``app`` from a daemon thread; yields the base URL (``http://host:port``).

    Leaving the block stops the server gracefully (lifespan shutdown runs, so the trigger
    dispatcher drains) and joins the thread.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ServerStartError(f"cannot bind {host}:{port}: {err}") from err
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=10
    )
    server = _ThreadServer(config)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as err:  # SystemExit from a failed start-up included
            failure.append(err)
        finally:
            server.startup_over.set()

    thread = threading.Thread(target=run, name=f"uvicorn-{bound_port}", daemon=True)
    thread.start()
    try:
        if not server.startup_over.wait(startup_timeout_s):
            raise ServerStartError(f"uvicorn did not start within {startup_timeout_s} s")
        if not server.started:
            raise ServerStartError(
                f"uvicorn failed to start on {host}:{bound_port}"
                + (f": {failure[0]!r}" if failure else "")
            )
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        yield f"http://{shown}:{bound_port}"
    finally:
        server.should_exit = True
        thread.join(30.0)
        sock.close()
        if thread.is_alive():
            logger.error("uvicorn thread did not stop within 30 s")
