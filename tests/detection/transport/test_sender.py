"""AlarmSender against a real HTTP server on 127.0.0.1 that verifies every signature.

The server is stopped and started again on the same port to play a webhook outage; tests wait
on events and ``flush`` rather than on sleeps.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from detection.transport.sender import (
    AlarmSender,
    InvalidMessageError,
    SenderClosedError,
    SpoolBusyError,
    SpoolError,
    drain_spool,
)
from detection.transport.signing import SignatureError, verify

SECRET = "test-secret-\u00e9"  # non-ASCII on purpose: the key is its UTF-8 bytes
JOB = "job-7"
ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.timeout(60)


@dataclass
class Attempt:
    path: str
    body: dict[str, Any]
    timestamp: int
    status: int


Responder = Callable[[str, dict[str, Any]], tuple[int, dict[str, Any], dict[str, str]]]


def accept(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
    return 202, {"incident_id": "inc-1", "duplicate": False}, {}


@dataclass
class Webhook:
    """A webhook stand-in: verifies signatures, records attempts, answers via ``responder``."""

    port: int
    responder: Responder = accept
    attempts: list[Attempt] = field(default_factory=list)
    forged: list[str] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)
    server: ThreadingHTTPServer | None = None

    def start(self) -> None:
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                try:
                    ts = verify(
                        {"default": SECRET.encode()}.get,
                        self.headers,
                        "POST",
                        self.path,
                        raw,
                    ).timestamp
                except SignatureError as err:
                    with hook.changed:
                        hook.forged.append(err.reason)
                        hook.changed.notify_all()
                    self._answer(401, {"detail": err.reason}, {})
                    return
                body = json.loads(raw)
                status, answer, headers = hook.responder(self.path, body)
                with hook.changed:
                    hook.attempts.append(Attempt(self.path, body, ts, status))
                    hook.changed.notify_all()
                self._answer(status, answer, headers)

            def _answer(self, status: int, answer: dict[str, Any], headers: dict[str, str]) -> None:
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        ).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def delivered(self, path: str = "/v1/alarms") -> list[dict[str, Any]]:
        with self.changed:
            return [a.body for a in self.attempts if a.path == path and 200 <= a.status < 300]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    hook = Webhook(free_port())  # not started: each test decides when the webhook is up
    yield hook
    hook.stop()


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    return tmp_path / "spool"


def make_sender(url: str, spool: Path, **kwargs: Any) -> AlarmSender:
    options: dict[str, Any] = {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, "timeout_s": 5.0}
    options.update(kwargs)
    return AlarmSender(url, SECRET, JOB, spool, **options)


def alarm(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "rank": 0,
        "node": "node-0",
        "layer": "fingerprint",
        "phase": "weights",
        "suspect_ranks": [2],
        "suspect_nodes": ["node-2"],
        "detail": {"votes": [1, 1, 2]},
    }


def test_alarms_spooled_during_outages_all_arrive_in_order_exactly_once(
    webhook: Webhook, spool: Path
) -> None:
    sender = make_sender(webhook.url, spool)
    try:
        ids = [sender.send_alarm(alarm(step)) for step in range(10)]
        assert sender.pending() == 10  # nothing listens yet
        webhook.start()
        assert sender.flush(20)
        webhook.stop()
        ids += [sender.send_alarm(alarm(step)) for step in range(10, 20)]
        assert sender.pending() == 10
        webhook.start()
        assert sender.flush(20)
    finally:
        sender.close()
    got = webhook.delivered()
    assert [a["alarm_id"] for a in got] == ids
    assert len(set(ids)) == 20
    assert [a["step"] for a in got] == list(range(20))
    assert all(a["job_id"] == JOB and a["sent_at"].endswith("Z") for a in got)
    assert webhook.forged == []
    assert list(spool.glob("*.json")) == []
    assert list((spool / "dead").iterdir()) == []


def test_server_errors_are_retried_until_the_webhook_recovers(
    webhook: Webhook, spool: Path
) -> None:
    answers = iter([503, 500, 502, 429, 408])

    def flaky(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        status = next(answers, 202)
        return status, {"detail": "try later"}, {"Retry-After": "0"} if status == 429 else {}

    webhook.responder = flaky
    webhook.start()
    with make_sender(webhook.url, spool) as sender:
        ids = [sender.send_alarm(alarm(step)) for step in range(4)]
        assert sender.flush(20)
    assert [a["alarm_id"] for a in webhook.delivered()] == ids
    statuses = [a.status for a in webhook.attempts]
    assert statuses == [503, 500, 502, 429, 408, 202, 202, 202, 202]
    assert {a.body["alarm_id"] for a in webhook.attempts[:6]} == {ids[0]}  # only the head retried


def test_a_permanent_4xx_goes_to_dead_and_later_messages_still_arrive(
    webhook: Webhook, spool: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def picky(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        if body["step"] == 2:
            return 422, {"detail": "step: must be >= 3"}, {}
        return accept(path, body)

    webhook.responder = picky
    webhook.start()
    with (
        caplog.at_level(logging.ERROR, logger="detection.transport.sender"),
        make_sender(webhook.url, spool) as sender,
    ):
        ids = [sender.send_alarm(alarm(step)) for step in range(5)]
        assert sender.flush(20)
        assert sender.pending() == 0
    assert [a["step"] for a in webhook.delivered()] == [0, 1, 3, 4]
    assert [a.body["step"] for a in webhook.attempts].count(2) == 1  # never retried
    (dead,) = (spool / "dead").iterdir()
    record = json.loads(dead.read_text())
    assert record["status"] == 422
    assert "step: must be >= 3" in record["reason"]
    assert json.loads(record["message"]["body"])["alarm_id"] == ids[2]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert getattr(errors[0], "http_status", None) == 422
    assert getattr(errors[0], "job", None) == JOB


def test_a_new_sender_resends_what_a_dead_process_left(webhook: Webhook, spool: Path) -> None:
    script = textwrap.dedent(
        f"""
        import json, os, sys
        from detection.transport.sender import AlarmSender
        sender = AlarmSender({webhook.url!r}, {SECRET!r}, {JOB!r}, {str(spool)!r},
                             backoff_initial_s=0.01, backoff_max_s=0.05)
        ids = [sender.send_alarm({{"step": s, "rank": 0}}) for s in range(3)]
        sender.register_ranks([{{"rank": 0, "local_rank": 0, "node": "node-0",
                                 "instance_id": None, "gpu_uuid": None}}])
        print(json.dumps(ids), flush=True)
        os._exit(0)  # dies without close(): nothing flushed, no clean-up
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    ids = json.loads(done.stdout)
    assert len(list(spool.glob("*.json"))) == 4

    webhook.start()
    with make_sender(webhook.url, spool) as sender:
        ids.append(sender.send_alarm({"step": 3, "rank": 0}))
        assert sender.flush(20)
    order = [(a.path, a.body.get("alarm_id")) for a in webhook.attempts]
    assert order == [
        ("/v1/alarms", ids[0]),
        ("/v1/alarms", ids[1]),
        ("/v1/alarms", ids[2]),
        (f"/v1/jobs/{JOB}/ranks", None),
        ("/v1/alarms", ids[3]),
    ]


def test_send_returns_while_the_webhook_hangs(webhook: Webhook, spool: Path) -> None:
    in_flight = threading.Event()
    release = threading.Event()

    def hang_once(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        if body["step"] == 0 and not release.is_set():
            in_flight.set()
            release.wait(30)
        return accept(path, body)

    webhook.responder = hang_once
    webhook.start()
    with make_sender(webhook.url, spool, timeout_s=30.0) as sender:
        ids = [sender.send_alarm(alarm(0))]
        assert in_flight.wait(20)  # the background thread is stuck inside the request
        ids += [sender.send_alarm(alarm(step)) for step in range(1, 6)]
        sender.record_audit({"step": 6, "kind": "loss", "ranks": [0, 1], "passed": True})
        assert not release.is_set()  # every send above returned while the request hung
        assert sender.pending() == 7
        release.set()
        assert sender.flush(20)
    assert [a["alarm_id"] for a in webhook.delivered()] == ids


def test_each_attempt_is_signed_afresh_and_verifies(webhook: Webhook, spool: Path) -> None:
    answers = iter([503])
    webhook.responder = lambda path, body: (next(answers, 202), {}, {})
    webhook.start()
    # Backoff at least 1.1 s, so the retry's whole-second timestamp must be newer.
    with make_sender(webhook.url, spool, backoff_initial_s=2.2, backoff_max_s=2.2) as sender:
        sender.send_alarm(alarm(0))
        with webhook.changed:
            assert webhook.changed.wait_for(lambda: len(webhook.attempts) == 1, timeout=20)
        with webhook.changed:  # no flush: let the backoff run its course
            assert webhook.changed.wait_for(lambda: len(webhook.attempts) == 2, timeout=20)
    first, second = webhook.attempts
    assert (first.status, second.status) == (503, 202)
    assert second.timestamp > first.timestamp
    assert webhook.forged == []  # the server verified both with detection.transport.signing.verify


def test_a_refused_signature_keeps_the_alarm_spooled_until_the_key_is_right(
    webhook: Webhook, spool: Path
) -> None:
    """401 is what a key rotation in progress or clock skew look like: retried with backoff,
    never dead-lettered, and delivered once a sender signs with the right key."""
    webhook.start()
    sender = AlarmSender(
        webhook.url, "not-the-secret", JOB, spool, backoff_initial_s=0.01, backoff_max_s=0.02
    )
    try:
        alarm_id = sender.send_alarm(alarm(0))
        with webhook.changed:
            assert webhook.changed.wait_for(lambda: len(webhook.forged) >= 3, timeout=20)
        assert not sender.flush(0.05)
        assert sender.pending() == 1
    finally:
        sender.close(timeout_s=0.0)
    assert not any((spool / "dead").iterdir())
    assert set(webhook.forged) == {"signature does not match"}
    result = drain_spool(spool, webhook.url, SECRET, timeout_s=20, backoff_initial_s=0.01)
    assert (result.found, result.delivered, result.left, result.dead) == (1, 1, 0, 0)
    assert [a["alarm_id"] for a in webhook.delivered()] == [alarm_id]


def test_a_message_answered_5xx_is_dead_lettered_after_bounded_retries_and_the_queue_goes_on(
    webhook: Webhook, spool: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_on_step_1(
        path: str, body: dict[str, Any]
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        if body["step"] == 1:
            return 500, {"detail": "boom"}, {}
        return accept(path, body)

    webhook.responder = broken_on_step_1
    webhook.start()
    with (
        caplog.at_level(logging.ERROR, logger="detection.transport.sender"),
        make_sender(webhook.url, spool, max_server_errors=3) as sender,
    ):
        ids = [sender.send_alarm(alarm(step)) for step in range(3)]
        assert sender.flush(20)
    assert [a["step"] for a in webhook.delivered()] == [0, 2]
    assert [a.body["step"] for a in webhook.attempts].count(1) == 3
    (dead,) = (spool / "dead").iterdir()
    record = json.loads(dead.read_text())
    assert record["status"] == 500
    assert "3 server errors" in record["reason"]
    assert json.loads(record["message"]["body"])["alarm_id"] == ids[1]
    assert [getattr(r, "http_status", None) for r in caplog.records] == [500]


def test_a_leftover_spool_is_drained_once_and_a_rerun_records_no_event_twice(
    webhook: Webhook, spool: Path
) -> None:
    """A job ends with alarms still spooled (the webhook was down); ``drain_spool`` sends them.
    The job then runs again and re-detects the same events: the same alarm ids, so a ledger
    that records by ``alarm_id`` (this stand-in does, like the real webhook) holds each once."""
    recorded: dict[str, dict[str, Any]] = {}

    def ledger(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        duplicate = body["alarm_id"] in recorded
        recorded.setdefault(body["alarm_id"], body)
        return 202, {"incident_id": "inc-1", "duplicate": duplicate}, {}

    webhook.responder = ledger
    first = make_sender(webhook.url, spool)
    ids = [first.send_alarm({**alarm(step), "job_id": JOB}) for step in range(3)]
    first.close(timeout_s=0.0)  # the job ends: nothing listens
    assert len(list(spool.glob("*.json"))) == 3
    webhook.start()
    result = drain_spool(spool, webhook.url, SECRET, timeout_s=20, backoff_initial_s=0.01)
    assert (result.found, result.delivered, result.left, result.dead) == (3, 3, 0, 0)
    assert drain_spool(spool, webhook.url, SECRET, timeout_s=1).found == 0  # drained once
    with make_sender(webhook.url, spool) as rerun:  # the job's next start: same events again
        again = [rerun.send_alarm({**alarm(step), "job_id": JOB, "rank": 1}) for step in range(3)]
        assert rerun.flush(20)
    assert again == ids
    assert sorted(recorded) == sorted(ids)
    assert [a["alarm_id"] for a in webhook.delivered()] == ids + ids  # sent twice, kept once


def test_draining_a_missing_spool_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(SpoolError, match="no spool"):
        drain_spool(tmp_path / "nowhere", "http://127.0.0.1:9", SECRET)


def test_ledger_records_go_to_the_job_paths(webhook: Webhook, spool: Path) -> None:
    webhook.start()
    job = "team/job 1"
    with AlarmSender(webhook.url + "/", SECRET, job, spool, backoff_initial_s=0.01) as sender:
        rows = [{"rank": 0, "local_rank": 0, "node": "n0", "instance_id": None, "gpu_uuid": None}]
        sender.register_ranks(rows)
        checkpoint = {"step": 30, "uri": "/c/ckpt-000030.pt", "sha256": "ab", "fingerprint": "cd"}
        sender.record_checkpoint(checkpoint)
        sender.record_audit({"step": 30, "kind": "loss", "ranks": [0, 1], "passed": True})
        assert sender.flush(20)
    quoted = "/v1/jobs/team%2Fjob%201"
    assert [(a.path, a.body) for a in webhook.attempts] == [
        (f"{quoted}/ranks", {"ranks": rows}),
        (f"{quoted}/checkpoints", checkpoint),
        (f"{quoted}/audits", {"step": 30, "kind": "loss", "ranks": [0, 1], "passed": True}),
    ]


def test_torn_or_corrupt_spool_files_do_not_wedge_the_queue(webhook: Webhook, spool: Path) -> None:
    first = make_sender(webhook.url, spool)
    ids = [first.send_alarm(alarm(step)) for step in range(3)]
    first.close(timeout_s=0)  # the webhook is down: all three stay spooled
    files = sorted(spool.glob("*.json"))
    assert len(files) == 3
    files[1].write_bytes(files[1].read_bytes()[:25])  # a damaged message
    (spool / ".tmp-0badc0ffee").write_bytes(b'{"v": 1, "seq"')  # a crash mid-write

    webhook.start()
    with make_sender(webhook.url, spool) as sender:
        ids.append(sender.send_alarm(alarm(3)))
        assert sender.flush(20)
    assert [a["alarm_id"] for a in webhook.delivered()] == [ids[0], ids[2], ids[3]]
    dead = {p.name: json.loads(p.read_text()) for p in (spool / "dead").iterdir()}
    assert set(dead) == {files[1].name, "tmp-0badc0ffee.json"}
    assert "corrupt spool file" in dead[files[1].name]["reason"]
    assert dead["tmp-0badc0ffee.json"]["raw"] == '{"v": 1, "seq"'


def test_non_finite_floats_travel_as_strings(webhook: Webhook, spool: Path) -> None:
    webhook.start()
    with make_sender(webhook.url, spool) as sender:
        body = alarm(0) | {"layer": "nonfinite", "detail": {"loss": float("nan"), "g": [-1e999]}}
        sender.send_alarm(body)
        assert sender.flush(20)
    (got,) = webhook.delivered()
    assert got["detail"] == {"loss": "NaN", "g": ["-Infinity"]}


def test_misuse_is_refused_with_typed_errors(webhook: Webhook, spool: Path) -> None:
    sender = make_sender(webhook.url, spool)
    with pytest.raises(SpoolBusyError):
        make_sender(webhook.url, spool)
    with pytest.raises(InvalidMessageError):
        sender.send_alarm({"step": 1, "detail": {"tensor": object()}})
    caller_body = {"step": 1}
    alarm_id = sender.send_alarm(caller_body)
    assert caller_body == {"step": 1}  # the caller's dict is left alone
    assert sender.send_alarm({"step": 2, "alarm_id": "fixed-id"}) == "fixed-id"
    assert alarm_id != "fixed-id"
    sender.close(timeout_s=0)
    with pytest.raises(SenderClosedError):
        sender.send_alarm({"step": 3})
    with pytest.raises(ValueError, match="http"):
        AlarmSender("ftp://example", SECRET, JOB, spool)
    make_sender(webhook.url, spool).close(timeout_s=0)  # the lock was released
