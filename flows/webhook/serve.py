"""Running the webhook: ``sdcguard serve`` in the foreground, or a server in a thread.

``serve`` is the production entry point: check the ledger schema, build the credentials and
the trigger, run uvicorn (HTTPS with ``--tls-cert/--tls-key``) in one process. On PostgreSQL the
schema must already be at head — migrations are their own step (``sdcguard db upgrade``, under
an advisory lock), and a replica never migrates a database others serve from; the embedded
SQLite ledger still migrates itself, so ``sdcguard demo`` stays one command. One process is
enough and keeps the trigger dispatcher single: the ledger is the
serialisation point of an alarm storm (every alarm of a storm lands on the same incident row),
so more worker processes add lock contention, not throughput — see ``benchmarks/webhook.py``.

``run_in_thread`` runs the same app on loopback inside the current process, for the tests and
the demo: it binds the socket first (so port 0 gives a free port and no race), and returns only
once uvicorn has finished its start-up, lifespan included.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp

from db import Ledger
from db.engine import create_engine_for
from db.migrate import require_head, upgrade
from flows.incident.expiry import ExpirySweeper
from flows.settings import (
    DatabaseSettings,
    ExpirySettings,
    PrefectTriggerSettings,
    TriggerMode,
    WebhookSettings,
    load_settings,
)
from flows.webhook import create_app
from flows.webhook.auth import Credentials, TokenCache
from flows.webhook.trigger import IncidentTrigger, LocalTrigger, NoTrigger, PrefectTrigger

__all__ = [
    "ServerStartError",
    "credentials_from",
    "make_trigger",
    "prepare_ledger",
    "run_in_thread",
    "serve",
]

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
        from flows.incident.flow import respond

        return LocalTrigger(respond)
    return NoTrigger()


def credentials_from(webhook: WebhookSettings) -> Credentials:
    """The server-side credentials the settings name: a credentials file, the one shared secret,
    or both; with ``tokenreview`` on, service-account tokens are checked in-cluster."""
    creds = Credentials()
    if webhook.credentials_file is not None:
        creds = Credentials.from_file(webhook.credentials_file)
    if webhook.secret is not None:
        shared = Credentials.shared(webhook.secret.get_secret_value(), webhook.key_id)
        if webhook.checkpoint_prefix is not None:
            key = shared.keys[webhook.key_id]
            principal = dataclasses.replace(
                key.principal, checkpoint_prefix=webhook.checkpoint_prefix
            )
            shared.keys[webhook.key_id] = dataclasses.replace(key, principal=principal)
        creds = creds.add(shared)
    if webhook.tokenreview:
        from recovery.kube.client import api_client_in_cluster
        from recovery.kube.tokenreview import TokenReviewer

        reviewer = TokenReviewer(api_client_in_cluster(), webhook.token_audience)
        creds.token_review = TokenCache(reviewer.username)
    return creds


def prepare_ledger(url: str) -> None:
    """SQLite: migrate (one machine, one process). PostgreSQL: refuse a schema not at head."""
    if url.startswith("sqlite"):
        upgrade(url)
    else:
        require_head(url)


def serve(
    host: str,
    port: int,
    trigger_mode: TriggerMode | str,
    database_url: str | None = None,
    *,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
) -> None:
    """Run the webhook until interrupted (``sdcguard serve``).

    Credentials and limits come from :class:`WebhookSettings` (``SDCGUARD_WEBHOOK_*``), the
    ledger from ``database_url`` or :class:`DatabaseSettings`. See the module docstring for the
    schema check. Reads get threads and (on PostgreSQL) a connection pool of their own
    (``SDCGUARD_WEBHOOK_READ_THREADS``) and a budget (``SDCGUARD_WEBHOOK_READS_PER_S``), so a
    flood of reads never holds a connection an alarm needs.
    """
    mode = TriggerMode(trigger_mode)
    webhook = load_settings(WebhookSettings)
    cert = tls_cert or webhook.tls_cert
    key = tls_key or webhook.tls_key
    if (cert is None) != (key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    url = database_url or load_settings(DatabaseSettings).url
    prepare_ledger(url)
    credentials = credentials_from(webhook)
    ledger = Ledger.from_url(url)
    read_ledger = (
        None
        if url.startswith("sqlite")
        else Ledger(create_engine_for(url, pool_size=webhook.read_threads, max_overflow=0))
    )
    trigger = make_trigger(mode)
    app = create_app(
        ledger,
        trigger,
        credentials,
        max_body_bytes=webhook.max_body_bytes,
        window_s=webhook.window_s,
        read_ledger=read_ledger,
        read_threads=webhook.read_threads,
        reads_per_s=webhook.reads_per_s,
        docs=webhook.docs,
    )
    logger.info(
        "serving the sdcguard webhook on %s://%s:%d (trigger %s, ledger %s, "
        "%d read threads, %g reads/s)",
        "https" if cert else "http",
        host,
        port,
        mode.value,
        ledger.engine.url.render_as_string(hide_password=True),
        webhook.read_threads,
        webhook.reads_per_s,
    )
    # suspended approvals past their deadline have no run left to close them (flows.incident.expiry)
    sweeper = ExpirySweeper(ledger, load_settings(ExpirySettings)).start()
    try:
        # Access logs off: one line per alarm of a 4,096-rank storm costs more than the alarm;
        # refusals, opened incidents and trigger failures are logged by the app itself.
        uvicorn.run(
            app,
            host=host,
            port=port,
            access_log=False,
            log_level="info",
            http="httptools",  # a dependency: never the pure-Python parser by accident
            ssl_certfile=str(cert) if cert else None,
            ssl_keyfile=str(key) if key else None,
        )
    finally:
        sweeper.stop()
        if isinstance(trigger, LocalTrigger):
            trigger.close(wait=False)
        ledger.engine.dispose()
        if read_ledger is not None:
            read_ledger.engine.dispose()


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
