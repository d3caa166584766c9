"""Alarm-storm benchmark of the webhook: ``python benchmarks/webhook.py``.

Scenario (the one that matters in production): every rank of a 4,096-rank job sees the same
corrupted step and reports it at once. 64 concurrent clients POST the 4,096 alarms, each signed
over its canonical request with a fresh nonce (DESIGN "Webhook signing"), to ``sdcguard serve``
(its own process, ``--trigger none``) backed by a throwaway PostgreSQL database and by a fresh
SQLite file (``--backend``). Every nonce goes through the replay store (on PostgreSQL, the
``request_nonces`` table). The "+ read flood" row repeats the burst while 8 readers loop over
``GET /v1/incidents`` without pause (bounded: one request in flight per reader): reads have
their own threads and pool, so the burst time should stay within 1.5x of the burst alone.
Measured: time until every alarm is recorded (every 202 is a committed transaction), alarms/s,
request latency, and a check that the ledger holds 4,096 alarms in one incident. Beside the wall
time, the CPU seconds the burst cost: of the server process, of its PostgreSQL backends, and of
the client. On a shared machine the wall time follows the load; the CPU seconds much less so,
and the server's are its floor (one process, one event loop).

For contrast, the same load is run spread over 64 jobs (one per client), where alarms do not
contend for one incident; smaller bursts show how the cost grows with the incident's size; and
a "webhook alone" row runs the same app and client with a ledger stand-in that records nothing,
which is the ceiling of the HTTP, signature and schema layers on this machine.

The client is a minimal keep-alive HTTP/1.1 client on asyncio (one connection per client): on a
two-core machine the client shares the CPU with the server and PostgreSQL, and a heavier client
would be measured as server time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import httpx
import sqlalchemy as sa
import uvicorn
from sqlalchemy.engine import make_url

from db import AlarmOutcome, Ledger, upgrade
from detection.transport.signing import signed_headers
from flows.webhook import create_app
from flows.webhook.trigger import NoTrigger

ROOT = Path(__file__).resolve().parent.parent
ADMIN_URL = os.environ.get(
    "SDCGUARD_BENCH_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
TARGET_S = 5.0


@dataclass(frozen=True)
class Result:
    name: str
    alarms: int
    clients: int
    wall_s: float
    latencies_s: list[float]
    incidents: int | None
    recorded: int | None
    cpu: _Cpu

    @property
    def rate(self) -> float:
        return self.alarms / self.wall_s

    def row(self) -> str:
        lat = sorted(self.latencies_s)
        p50 = statistics.median(lat) * 1000
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000
        return (
            f"{self.name:<58} {self.alarms:>6} {self.clients:>7} {self.wall_s:>9.2f} "
            f"{self.rate:>9.0f} {p50:>8.1f} {p99:>8.1f} "
            f"{_shown(self.recorded):>8} {_shown(self.incidents):>9} "
            f"{self.cpu.server_s:>7.2f} {_shown_s(self.cpu.db_s):>7} {self.cpu.client_s:>7.2f}"
        )


@dataclass(frozen=True)
class _Cpu:
    """CPU seconds (user + system) one burst cost, per process group."""

    server_s: float
    db_s: float | None
    client_s: float


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (all its threads); 0 for one that is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _shown_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _shown(value: int | None) -> str:
    return "-" if value is None else str(value)


HEADER = (
    f"{'scenario':<58} {'alarms':>6} {'clients':>7} {'wall s':>9} {'alarms/s':>9} "
    f"{'p50 ms':>8} {'p99 ms':>8} {'recorded':>8} {'incidents':>9} "
    f"{'srv cpu':>7} {'db cpu':>7} {'cli cpu':>7}"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Database:
    """A throwaway PostgreSQL database, migrated; dropped on exit."""

    def __init__(self) -> None:
        self.admin = make_url(ADMIN_URL)
        self.name = f"sdcguard_bench_{secrets.token_hex(4)}"
        self.url = self.admin.set(database=self.name).render_as_string(hide_password=False)

    def _exec(self, sql: str) -> None:
        engine = sa.create_engine(self.admin, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.exec_driver_sql(sql)
        finally:
            engine.dispose()

    def __enter__(self) -> _Database:
        self._exec(f'CREATE DATABASE "{self.name}"')
        upgrade(self.url)
        return self

    def __exit__(self, *exc: object) -> None:
        self._exec(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')

    def counts(self) -> tuple[int, int]:
        engine = sa.create_engine(self.url)
        try:
            with engine.connect() as conn:
                alarms = conn.exec_driver_sql("SELECT count(*) FROM alarms").scalar_one()
                incidents = conn.exec_driver_sql("SELECT count(*) FROM incidents").scalar_one()
        finally:
            engine.dispose()
        return int(alarms), int(incidents)

    def backend_pids(self) -> set[int]:
        """The server processes of this database's connections (the webhook's pool)."""
        engine = sa.create_engine(self.admin)
        try:
            with engine.connect() as conn:
                rows = conn.execute(
                    sa.text(
                        "SELECT pid FROM pg_stat_activity "
                        "WHERE datname = :name AND pid <> pg_backend_pid()"
                    ),
                    {"name": self.name},
                )
                return {int(pid) for (pid,) in rows}
        finally:
            engine.dispose()

    def truncate(self) -> None:
        engine = sa.create_engine(self.url)
        try:
            with engine.begin() as conn:
                # The ledger refuses TRUNCATE (a trigger); the benchmark's superuser skips it.
                conn.exec_driver_sql("SET LOCAL session_replication_role = replica")
                tables = "jobs, ranks, incidents, incident_events, alarms, checkpoints, audits, "
                conn.exec_driver_sql(
                    f"TRUNCATE {tables} actions, action_events, request_nonces RESTART IDENTITY"
                )
        finally:
            engine.dispose()


class _SqliteFile:
    """A fresh SQLite ledger file (``sdcguard serve`` migrates it itself); removed on exit."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="sdcguard-bench-sqlite-"))
        self.url = f"sqlite:///{self.dir / 'ledger.db'}"

    def __enter__(self) -> _SqliteFile:
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def counts(self) -> tuple[int, int]:
        engine = sa.create_engine(self.url)
        try:
            with engine.connect() as conn:
                alarms = conn.exec_driver_sql("SELECT count(*) FROM alarms").scalar_one()
                incidents = conn.exec_driver_sql("SELECT count(*) FROM incidents").scalar_one()
        finally:
            engine.dispose()
        return int(alarms), int(incidents)

    def truncate(self) -> None:
        """Nothing to do: every SQLite row of the table runs on a file of its own."""

    def backend_pids(self) -> set[int]:
        """None: SQLite runs inside the server process."""
        return set()


class _Server:
    """``sdcguard serve`` in its own process: what ships, not an in-process shortcut."""

    def __init__(self, database_url: str, secret: str, *, without_ledger: bool = False) -> None:
        self.without_ledger = without_ledger
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "SDCGUARD_WEBHOOK_SECRET": secret,
            "SDCGUARD_DATABASE_URL": database_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
        }
        self.proc: subprocess.Popen[bytes] | None = None
        # A file, not a pipe: an unread pipe fills up and blocks the server mid-benchmark.
        self.log = Path(tempfile.mkdtemp(prefix="sdcguard-bench-")) / "serve.log"

    def __enter__(self) -> _Server:
        if self.without_ledger:
            command = [sys.executable, __file__, "--serve-without-ledger", str(self.port)]
        else:
            command = [sys.executable, "-m", "flows.cli", "serve", "--host", "127.0.0.1"]
            command += ["--port", str(self.port), "--trigger", "none"]
        with self.log.open("wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sdcguard serve exited:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError(f"sdcguard serve did not come up within 60 s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.log.parent, ignore_errors=True)


async def _client(
    port: int, secret: str, bodies: list[bytes], latencies: list[float], statuses: list[int]
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for body in bodies:
            headers = signed_headers("default", secret, "POST", "/v1/alarms", body)
            request = (
                b"POST /v1/alarms HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                + "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode()
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            started = time.perf_counter()
            writer.write(request)
            status_line = await reader.readline()
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - started)
            statuses.append(int(status_line.split()[1]))
    finally:
        writer.close()


def _alarm(job_id: str, step: int, rank: int) -> bytes:
    node = f"node-{rank // 8}"
    return json.dumps(
        {
            "alarm_id": str(uuid.uuid4()),
            "job_id": job_id,
            "step": step,
            "rank": rank,
            "node": node,
            "layer": "audit",
            "phase": "gradient",
            "suspect_ranks": [rank],
            "suspect_nodes": [node],
            "detail": {"max_abs_diff": 3.4e38, "partner": (rank + 8) % 4096},
            "sent_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        }
    ).encode()


def _register(server: _Server, secret: str, job_id: str, world_size: int) -> None:
    body = json.dumps(
        {
            "ranks": [
                {"rank": r, "local_rank": r % 8, "node": f"node-{r // 8}"}
                for r in range(world_size)
            ]
        }
    ).encode()
    response = httpx.post(
        f"{server.url}/v1/jobs/{job_id}/ranks",
        content=body,
        headers={
            **signed_headers("default", secret, "POST", f"/v1/jobs/{job_id}/ranks", body),
            "Content-Type": "application/json",
        },
        timeout=60,
    )
    response.raise_for_status()


async def _reader(port: int, secret: str, done: asyncio.Event, reads: list[int]) -> None:
    """One reader: signed GET /v1/incidents, one at a time, until the burst is over."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    target = "/v1/incidents?limit=50"
    try:
        while not done.is_set():
            headers = signed_headers("default", secret, "GET", target)
            writer.write(
                f"GET {target} HTTP/1.1\r\nHost: bench\r\n".encode()
                + "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode()
                + b"\r\n"
            )
            status_line = await reader.readline()
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            await reader.readexactly(length)
            status = int(status_line.split()[1])
            if status == 429:  # over the read budget: a client waits as Retry-After says
                await asyncio.sleep(1.0)
                continue
            reads.append(status)
    finally:
        writer.close()


def run_burst(
    name: str,
    server: _Server,
    database: _Database | _SqliteFile | None,
    secret: str,
    alarms: int,
    clients: int,
    jobs: int,
    *,
    readers: int = 0,
) -> Result:
    if database is not None:
        database.truncate()
    job_ids = [f"bench-job-{j}" for j in range(jobs)]
    for job_id in job_ids:
        _register(server, secret, job_id, alarms // jobs)
    # Client c sends alarms of job c % jobs: with one job, every client hits the same incident.
    per_client = [
        [_alarm(job_ids[c % jobs], 1234, rank) for rank in range(c, alarms, clients)]
        for c in range(clients)
    ]
    latencies: list[float] = []
    statuses: list[int] = []

    reads: list[int] = []
    wall = 0.0
    assert server.proc is not None
    db_before = {} if database is None else _cpu_of(database.backend_pids())
    server_before = _process_cpu_s(server.proc.pid)
    client_before = time.process_time()

    async def burst() -> None:
        nonlocal wall
        done = asyncio.Event()
        flood = [
            asyncio.create_task(_reader(server.port, secret, done, reads)) for _ in range(readers)
        ]
        if readers:
            while len(reads) < readers:  # the flood is running before the first alarm
                await asyncio.sleep(0.01)
        started = time.perf_counter()
        await asyncio.gather(
            *(_client(server.port, secret, bodies, latencies, statuses) for bodies in per_client)
        )
        wall = time.perf_counter() - started
        done.set()
        await asyncio.gather(*flood)

    asyncio.run(burst())
    client_s = time.process_time() - client_before
    server_s = _process_cpu_s(server.proc.pid) - server_before
    db_s: float | None = None
    if isinstance(database, _Database):
        db_after = _cpu_of(database.backend_pids() | set(db_before))
        db_s = sum(db_after[pid] - db_before.get(pid, 0.0) for pid in db_after)
    cpu = _Cpu(server_s, db_s, client_s)
    bad = [s for s in statuses if s != 202]
    if bad:
        raise RuntimeError(f"{len(bad)} alarms refused, statuses {sorted(set(bad))}")
    if readers:
        name = f"{name} ({len(reads)} reads)"
        if any(r != 200 for r in reads):
            raise RuntimeError(f"reads refused, statuses {sorted(set(reads))}")
    if database is None:
        return Result(name, alarms, clients, wall, latencies, None, None, cpu)
    recorded, incidents = database.counts()
    return Result(name, alarms, clients, wall, latencies, incidents, recorded, cpu)


def _cpu_of(pids: set[int]) -> dict[int, float]:
    return {pid: _process_cpu_s(pid) for pid in pids}


class _NoLedger:
    """Stands in for the ledger in the "webhook alone" row: accepts everything, stores nothing.

    Only the calls the alarm path makes exist; one incident id for every alarm, opened once.
    """

    class _Engine:
        """No pool, no database; ``/healthz``'s ``SELECT 1`` always answers."""

        pool = None
        dialect = SimpleNamespace(name="none")

        @contextlib.contextmanager
        def connect(self) -> Iterator[object]:
            yield SimpleNamespace(execute=lambda _query: SimpleNamespace(scalar_one=lambda: 1))

    engine = _Engine()

    def __init__(self) -> None:
        self._opened = False
        self._lock = threading.Lock()

    def ensure_job(self, job_id: str) -> None:
        return None

    def register_ranks(self, job_id: str, ranks: object, *, generation: int = 0) -> None:
        return None

    def list_incidents(self, job_id: object = None, state: object = None) -> list[object]:
        return []

    def record_alarm(self, alarm: object) -> AlarmOutcome:
        with self._lock:
            opened, self._opened = not self._opened, True
        return AlarmOutcome("00000000-0000-0000-0000-000000000000", False, opened)

    def record_alarms(self, alarms: Sequence[object]) -> list[AlarmOutcome]:
        return [self.record_alarm(alarm) for alarm in alarms]

    def record_fresh_alarms(
        self, alarms: Sequence[object], nonces: Sequence[object], *, keep: object, prune: bool
    ) -> list[AlarmOutcome]:
        return self.record_alarms(alarms)

    def claim_nonces(self, claims: Sequence[object], *, keep: object) -> list[bool]:
        return [True for _ in claims]


def _serve_without_ledger(port: int) -> None:
    app = create_app(cast(Ledger, _NoLedger()), NoTrigger(), os.environ["SDCGUARD_WEBHOOK_SECRET"])
    uvicorn.run(app, host="127.0.0.1", port=port, access_log=False, log_level="warning")


def _load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def _backend_rows(backend: str, secret: str, args: argparse.Namespace) -> tuple[Result, Result]:
    """The rows of one backend; returns (burst alone, burst under a read flood)."""
    rows: list[Result] = []
    headline_name = f"{backend}: burst, 1 job, {args.alarms} ranks"

    def one(name: str, alarms: int, clients: int, jobs: int, readers: int = 0) -> Result:
        database: _Database | _SqliteFile = _Database() if backend == "postgres" else _SqliteFile()
        with database, _Server(database.url, secret) as server:
            return run_burst(name, server, database, secret, alarms, clients, jobs, readers=readers)

    if backend == "postgres" and not args.quick:
        for size in (256, 1024):
            rows.append(one(f"{backend}: burst, 1 job, {size} ranks", size, 64, 1))
        rows.append(
            one(f"{backend}: spread, {args.clients} jobs", args.alarms, args.clients, args.clients)
        )
    alone = one(headline_name, args.alarms, args.clients, 1)
    flooded = one(f"{headline_name} + read flood", args.alarms, args.clients, 1, readers=8)
    RESULTS.extend([*rows, alone, flooded])
    return alone, flooded


RESULTS: list[Result] = []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alarms", type=int, default=4096)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--backend", choices=["postgres", "sqlite", "both"], default="both")
    parser.add_argument(
        "--quick", action="store_true", help="only the headline bursts, no contrast rows"
    )
    parser.add_argument("--serve-without-ledger", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_without_ledger:
        _serve_without_ledger(args.serve_without_ledger)
        return 0
    secret = secrets.token_hex(32)
    load_before = _load()
    if not args.quick:
        with _Server("unused", secret, without_ledger=True) as bare:
            RESULTS.append(
                run_burst("webhook alone (no ledger)", bare, None, secret, args.alarms, 64, 1)
            )
    backends = ["postgres", "sqlite"] if args.backend == "both" else [args.backend]
    verdicts: list[str] = []
    ok = True
    for backend in backends:
        alone, flooded = _backend_rows(backend, secret, args)
        consistent = all(r.recorded == args.alarms and r.incidents == 1 for r in (alone, flooded))
        ok = ok and consistent
        ratio = flooded.wall_s / alone.wall_s
        verdicts.append(
            f"{backend}: {args.alarms} alarms in {alone.wall_s:.2f} s (target <= {TARGET_S:.0f} s: "
            f"{'met' if alone.wall_s <= TARGET_S else 'NOT met'}); under a read flood "
            f"{flooded.wall_s:.2f} s = {ratio:.2f}x ({'met' if ratio <= 1.5 else 'NOT met'}: "
            f"<= 1.5x); ledger consistent: {consistent}"
        )
    print(f"\nwebhook alarm storm — {os.cpu_count()} CPUs, canonical-request signing, 64 clients")
    print(f"load before: {load_before}\nload after:  {_load()}")
    print(HEADER)
    print("-" * len(HEADER))
    for result in RESULTS:
        print(result.row())
    print()
    for verdict in verdicts:
        print(verdict)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
