"""The webhook over a real uvicorn server on loopback, on SQLite and PostgreSQL.

Every refusal is checked three ways: the status, a reason the sender can act on, and an
unchanged ledger (rows counted in every table).
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from db import Ledger
from detection.transport.signing import SIGNATURE_HEADER, signed_headers
from flows.webhook import create_app, dispatcher_of, signed
from flows.webhook.serve import run_in_thread
from flows.webhook.trigger import RecordingTrigger
from tests.flows.conftest import Webhook, alarm_payload, ranks_payload, row_counts


def _sig(
    secret: str, body: bytes, path: str = "/v1/alarms", now: float | None = None
) -> dict[str, str]:
    """The signature headers of a POST of ``body`` to ``path`` with the default key."""
    return signed_headers("default", secret, "POST", path, body, now=now)


def _detail(response: httpx.Response) -> str:
    return json.dumps(response.json()["detail"])


# ---------------------------------------------------------------------- happy paths


def test_alarm_is_recorded_and_opens_one_incident(webhook: Webhook) -> None:
    assert webhook.post("/v1/jobs/job-1/ranks", ranks_payload(8)).status_code == 200
    first = webhook.post("/v1/alarms", alarm_payload(step=37, rank=2, node="node-0"))
    second = webhook.post("/v1/alarms", alarm_payload(step=38, rank=5, node="node-1"))

    assert first.status_code == 202, first.text
    assert second.status_code == 202, second.text
    incident_id = first.json()["incident_id"]
    assert first.json() == {"incident_id": incident_id, "duplicate": False}
    assert second.json() == {"incident_id": incident_id, "duplicate": False}

    incident = webhook.get(f"/v1/incidents/{incident_id}").json()
    assert incident["job_id"] == "job-1"
    assert incident["state"] == "open"
    assert incident["ranks_missing"] is False
    assert (incident["suspect_start"], incident["suspect_end"]) == (0, 38)
    assert sorted(a["step"] for a in incident["alarms"]) == [37, 38]
    assert incident["actions"] == []
    assert dispatcher_of(webhook.app).wait_idle(10)
    assert webhook.trigger.calls == [(incident_id, "job-1")]


@pytest.mark.parametrize(
    ("layer", "phase"),
    [
        ("gradstats", "pre-allreduce"),
        ("gradstats", "loss"),
        ("allreduce", "post-allreduce"),
        ("optstate", "optimizer-state"),
        ("abft", "forward"),
        ("abft", "backward"),
    ],
)
def test_per_step_layer_alarms_are_recorded_with_their_statistic(
    webhook: Webhook, layer: str, phase: str
) -> None:
    detail = {"test": "temporal", "statistic": "log l2", "deviation": 80.9, "threshold": 2.08}
    response = webhook.post(
        "/v1/alarms", alarm_payload(step=41, layer=layer, phase=phase, detail=detail)
    )
    assert response.status_code == 202, response.text
    incident = webhook.get(f"/v1/incidents/{response.json()['incident_id']}").json()
    [alarm] = incident["alarms"]
    assert (alarm["layer"], alarm["phase"], alarm["step"]) == (layer, phase, 41)
    assert alarm["detail"]["threshold"] == 2.08


def test_resent_alarm_is_recorded_once(webhook: Webhook) -> None:
    payload = alarm_payload()
    first = webhook.post("/v1/alarms", payload)
    again = webhook.post("/v1/alarms", payload)

    assert again.status_code == 202
    assert again.json() == {"incident_id": first.json()["incident_id"], "duplicate": True}
    assert row_counts(webhook.ledger)["alarms"] == 1
    assert dispatcher_of(webhook.app).wait_idle(10)
    assert len(webhook.trigger.calls) == 1


def test_alarm_for_job_without_ranks_is_recorded_and_says_ranks_missing(webhook: Webhook) -> None:
    response = webhook.post("/v1/alarms", alarm_payload(job_id="never-registered"))

    assert response.status_code == 202, response.text
    incident = webhook.get(f"/v1/incidents/{response.json()['incident_id']}").json()
    assert incident["job_id"] == "never-registered"
    assert incident["ranks_missing"] is True
    assert len(incident["alarms"]) == 1
    assert incident["suspect_nodes"] == ["node-2"]


def test_passed_audit_verifies_the_pending_checkpoint(webhook: Webhook) -> None:
    webhook.post("/v1/jobs/job-1/ranks", ranks_payload(4))
    checkpoint = {
        "step": 30,
        "uri": "/ckpt/ckpt-000030.pt",
        "sha256": "ab" * 32,
        "fingerprint": "0123456789abcdef" * 2,
        "nodes": ["node-0"],
    }
    recorded = webhook.post("/v1/jobs/job-1/checkpoints", checkpoint)
    audit = webhook.post(
        "/v1/jobs/job-1/audits", {"step": 40, "kind": "gradient", "ranks": [0, 1], "passed": True}
    )

    assert recorded.status_code == 201, recorded.text
    assert recorded.json()["status"] == "pending"
    assert audit.status_code == 200, audit.text
    assert audit.json() == {"job_id": "job-1", "step": 40, "verified_steps": [30]}
    assert webhook.ledger.list_checkpoints("job-1")[0].status == "verified"


def test_a_checkpoint_the_gate_quarantined_is_quarantined_in_the_ledger(webhook: Webhook) -> None:
    webhook.post("/v1/jobs/job-1/ranks", ranks_payload(4))
    checkpoint = {
        "step": 30,
        "uri": "/ckpt/ckpt-000030.pt",
        "sha256": "ab" * 32,
        "fingerprint": "0123456789abcdef" * 2,
        "nodes": ["node-0"],
    }
    assert webhook.post("/v1/jobs/job-1/checkpoints", checkpoint).json()["status"] == "pending"
    # the gate closed on an alarm: it posts the same checkpoint again, quarantined
    again = webhook.post("/v1/jobs/job-1/checkpoints", {**checkpoint, "status": "quarantined"})
    audit = webhook.post(
        "/v1/jobs/job-1/audits", {"step": 40, "kind": "gradient", "ranks": [0, 1], "passed": True}
    )

    assert again.status_code == 201, again.text
    assert again.json()["status"] == "quarantined"
    assert audit.json()["verified_steps"] == []
    assert [c.status for c in webhook.ledger.list_checkpoints("job-1")] == ["quarantined"]


def test_checkpoint_of_unknown_job_is_404_with_the_reason(webhook: Webhook) -> None:
    before = row_counts(webhook.ledger)
    response = webhook.post(
        "/v1/jobs/nobody/checkpoints",
        {"step": 1, "uri": "/c", "sha256": "00" * 32, "fingerprint": "00" * 16, "nodes": []},
    )

    assert response.status_code == 404
    assert "unknown job 'nobody'" in response.json()["detail"]
    assert row_counts(webhook.ledger) == before


def test_incident_list_filters_by_job_and_state(webhook: Webhook) -> None:
    a = webhook.post("/v1/alarms", alarm_payload(job_id="job-a")).json()["incident_id"]
    b = webhook.post("/v1/alarms", alarm_payload(job_id="job-b")).json()["incident_id"]

    every = webhook.get("/v1/incidents").json()["incidents"]
    only_a = webhook.get("/v1/incidents", job_id="job-a").json()["incidents"]
    resolved = webhook.get("/v1/incidents", state="resolved").json()["incidents"]

    assert {i["id"] for i in every} == {a, b}
    assert [i["id"] for i in only_a] == [a]
    assert resolved == []
    assert webhook.get("/v1/incidents", state="bogus").status_code == 422
    unknown = webhook.get(f"/v1/incidents/{uuid.uuid4()}")
    assert unknown.status_code == 404
    assert "unknown incident" in unknown.json()["detail"]


@pytest.mark.parametrize("path", ["/v1/incidents/%00", "/v1/incidents/a%ed%a0%80b"])
def test_incident_id_the_database_cannot_hold_is_422(webhook: Webhook, path: str) -> None:
    assert httpx.get(webhook.url + path).status_code == 401  # a reader first
    response = webhook.get(path)

    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["path", "incident_id"]


def test_health_and_no_docs_unless_asked(webhook: Webhook) -> None:
    assert webhook.get_unsigned("/healthz").json() == {"status": "ok", "trigger_backlog": []}
    assert webhook.get_unsigned("/openapi.json").status_code == 404
    assert webhook.get_unsigned("/docs").status_code == 404


def test_openapi_when_asked(ledger: Ledger) -> None:
    app = create_app(ledger, RecordingTrigger(), "x" * 32, docs=True)
    with run_in_thread(app) as url:
        assert httpx.get(url + "/docs", timeout=30).status_code == 200
        paths = httpx.get(url + "/openapi.json", timeout=30).json()["paths"]
    assert {
        "/v1/alarms",
        "/v1/jobs/{job_id}/ranks",
        "/v1/jobs/{job_id}/checkpoints",
        "/v1/jobs/{job_id}/audits",
        "/v1/incidents",
        "/v1/incidents/{incident_id}",
        "/healthz",
    } <= set(paths)


# ---------------------------------------------------------------------- refusals: auth


def test_unsigned_request_is_401_and_writes_nothing(webhook: Webhook) -> None:
    before = row_counts(webhook.ledger)
    response = webhook.post_raw("/v1/alarms", json.dumps(alarm_payload()).encode(), {})

    assert response.status_code == 401
    assert response.json()["detail"].startswith("unsigned request")
    assert row_counts(webhook.ledger) == before


def test_forged_signature_is_401_and_writes_nothing(webhook: Webhook) -> None:
    body = json.dumps(alarm_payload()).encode()
    forged = _sig("not-the-secret-but-long-enough", body)
    before = row_counts(webhook.ledger)

    response = webhook.post_raw("/v1/alarms", body, forged)

    assert response.status_code == 401
    assert response.json() == {"detail": "signature does not match"}
    assert row_counts(webhook.ledger) == before
    assert webhook.trigger.calls == []


def test_body_changed_after_signing_is_401(webhook: Webhook) -> None:
    body = json.dumps(alarm_payload(step=37)).encode()
    headers = _sig(webhook.secret, body)
    tampered = body.replace(b'"step": 37', b'"step": 38')
    before = row_counts(webhook.ledger)

    response = webhook.post_raw("/v1/alarms", tampered, headers)

    assert response.status_code == 401
    assert row_counts(webhook.ledger) == before


@pytest.mark.parametrize("skew_s", [-290, 290])
def test_clock_skew_inside_the_window_is_accepted(webhook: Webhook, skew_s: int) -> None:
    body = json.dumps(alarm_payload()).encode()

    response = webhook.post_raw(
        "/v1/alarms", body, _sig(webhook.secret, body, now=time.time() + skew_s)
    )

    assert response.status_code == 202


# Timestamps are whole seconds: 305 s keeps the rounding of "now" from landing inside ±300 s.
@pytest.mark.parametrize("skew_s", [-305, 305])
def test_timestamp_outside_the_window_is_401(webhook: Webhook, skew_s: int) -> None:
    body = json.dumps(alarm_payload()).encode()
    stale = _sig(webhook.secret, body, now=time.time() + skew_s)
    before = row_counts(webhook.ledger)

    response = webhook.post_raw("/v1/alarms", body, stale)

    assert response.status_code == 401
    assert "window" in response.json()["detail"]
    assert row_counts(webhook.ledger) == before


def test_signature_without_prefix_is_401(webhook: Webhook) -> None:
    body = json.dumps(alarm_payload()).encode()
    headers = _sig(webhook.secret, body)
    headers[SIGNATURE_HEADER] = headers[SIGNATURE_HEADER].removeprefix("sha256=")

    response = webhook.post_raw("/v1/alarms", body, headers)

    assert response.status_code == 401
    assert "sha256=" in response.json()["detail"]


# ---------------------------------------------------------------------- refusals: size


def test_oversize_content_length_is_413_before_reading(webhook: Webhook) -> None:
    body = json.dumps(alarm_payload(detail={"pad": "x" * 100_000})).encode()
    before = row_counts(webhook.ledger)

    response = webhook.post("/v1/alarms", json.loads(body))

    assert response.status_code == 413
    assert "limit" in response.json()["detail"]
    assert row_counts(webhook.ledger) == before


def test_oversize_streamed_body_without_length_is_413(webhook: Webhook) -> None:
    """Chunked transfer has no Content-Length: the limit is enforced while reading."""
    chunk = b" " * 16_384
    before = row_counts(webhook.ledger)

    def chunks() -> Iterator[bytes]:
        yield b'{"pad": "'
        for _ in range(8):
            yield chunk
        yield b'"}'

    headers = {**_sig(webhook.secret, b"{}"), "Content-Type": "application/json"}
    try:
        response = httpx.post(
            webhook.url + "/v1/alarms", content=chunks(), headers=headers, timeout=30
        )
    except httpx.WriteError:
        pytest.fail("the server closed the connection without answering 413")
    assert "content-length" not in {k.lower() for k in response.request.headers}
    assert response.status_code == 413
    assert "limit" in response.json()["detail"]
    assert row_counts(webhook.ledger) == before


def _address(webhook: Webhook) -> tuple[str, int]:
    host, port = webhook.url.removeprefix("http://").split(":")
    return host, int(port)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_oversize_body_sent_whole_before_reading_still_gets_its_413(
    webhook: Webhook, framing: str
) -> None:
    """http.client writes the whole body before it reads a byte of the answer, as most clients
    do. Refused unread, a body of some MiB made the server close on unread input: the client
    got a reset (or a broken pipe) instead of the 413 and its reason."""
    body = json.dumps(alarm_payload(detail={"pad": "x" * (8 << 20)})).encode()
    before = row_counts(webhook.ledger)
    connection = http.client.HTTPConnection(*_address(webhook), timeout=30)
    try:
        headers = {"Content-Type": "application/json"}
        if framing == "chunked":
            pieces = (body[i : i + 65536] for i in range(0, len(body), 65536))
            connection.request("POST", "/v1/alarms", pieces, headers, encode_chunked=True)
        else:
            connection.request("POST", "/v1/alarms", body, headers)
        response = connection.getresponse()
        answer = json.loads(response.read())
    finally:
        connection.close()

    assert response.status == 413
    assert "limit" in answer["detail"]
    assert row_counts(webhook.ledger) == before


def _first_line_within(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    return sock.recv(64).split(b"\r\n", 1)[0]


def test_a_declared_body_past_the_drain_bound_is_refused_without_waiting_for_it(
    webhook: Webhook,
) -> None:
    """A gigabyte announced is not read to answer it: the 413 comes before any body byte."""
    with socket.create_connection(_address(webhook)) as sock:
        sock.sendall(
            b"POST /v1/alarms HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1073741824\r\n\r\n"
        )
        assert _first_line_within(sock, 10.0).startswith(b"HTTP/1.1 413")


def test_a_refused_body_that_stalls_is_answered_after_the_drain_time_bound(
    webhook: Webhook, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused body is drained for a bounded time only: a sender that stops mid-body does not
    hold the request open (the default bound is 10 s; here 0.5 s)."""
    monkeypatch.setattr(signed, "_DRAIN_MAX_S", 0.5)
    with socket.create_connection(_address(webhook)) as sock:
        sock.sendall(
            b"POST /v1/alarms HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1048576\r\n\r\n" + b" " * 1000
        )
        started = time.monotonic()
        assert _first_line_within(sock, 10.0).startswith(b"HTTP/1.1 413")
        assert time.monotonic() - started < 5.0


# ---------------------------------------------------------------------- refusals: body


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"alarm_id": ', "not valid JSON"),
        (b"", "not valid JSON"),
        (b'{"step": NaN}', "NaN is not a JSON number"),
        (b"\xff\xfe{}", "not UTF-8"),
    ],
)
def test_malformed_json_is_400_with_the_reason(webhook: Webhook, body: bytes, reason: str) -> None:
    before = row_counts(webhook.ledger)

    response = webhook.post_raw("/v1/alarms", body, _sig(webhook.secret, body))

    assert response.status_code == 400
    assert reason in response.json()["detail"]
    assert row_counts(webhook.ledger) == before


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("step", "37"),
        ("step", -1),
        ("step", 2**31),
        ("step", 37.0),
        ("rank", True),
        ("layer", "bogus"),
        ("phase", "after-lunch"),
        ("alarm_id", "not-a-uuid"),
        ("sent_at", 1_700_000_000),
        ("sent_at", "2025-01-31T12:00:00"),
        ("sent_at", "9999-12-31T23:59:59-23:59"),
        ("sent_at", "0001-01-01T00:00:00+01:00"),
        ("suspect_ranks", ["2"]),
        ("suspect_nodes", "node-2"),
        ("job_id", ""),
        ("node", "node 2; drop table"),
        ("detail", []),
    ],
)
def test_wrong_type_is_422_naming_the_field(webhook: Webhook, field: str, value: object) -> None:
    before = row_counts(webhook.ledger)

    response = webhook.post("/v1/alarms", alarm_payload(**{field: value}))

    assert response.status_code == 422, response.text
    locations = [error["loc"] for error in response.json()["detail"]]
    assert any(loc[:2] == ["body", field] for loc in locations), locations
    assert row_counts(webhook.ledger) == before


def test_missing_field_is_422_naming_it(webhook: Webhook) -> None:
    payload = alarm_payload()
    del payload["sent_at"]

    response = webhook.post("/v1/alarms", payload)

    assert response.status_code == 422
    assert ["body", "sent_at"] in [error["loc"] for error in response.json()["detail"]]


@pytest.mark.parametrize("text", ["nul\u0000byte", "lone \ud800 surrogate"])
def test_text_the_database_cannot_store_is_422(webhook: Webhook, text: str) -> None:
    payload = alarm_payload(detail={"note": text})
    body = json.dumps(payload).encode()  # ASCII-escaped, so the surrogate survives encoding
    before = row_counts(webhook.ledger)

    response = webhook.post_raw("/v1/alarms", body, _sig(webhook.secret, body))

    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "detail", "note"]
    assert row_counts(webhook.ledger) == before


def test_duplicate_rank_in_registration_is_422(webhook: Webhook) -> None:
    payload = ranks_payload(2)
    payload["ranks"][1]["rank"] = 0

    response = webhook.post("/v1/jobs/job-1/ranks", payload)

    assert response.status_code == 422
    assert "rank 0 is listed twice" in _detail(response)
    assert row_counts(webhook.ledger)["ranks"] == 0


def test_non_json_content_type_is_415(webhook: Webhook) -> None:
    body = json.dumps(alarm_payload()).encode()
    headers = {**_sig(webhook.secret, body), "Content-Type": "text/plain"}

    response = httpx.post(webhook.url + "/v1/alarms", content=body, headers=headers)

    assert response.status_code == 415


# ---------------------------------------------------------------------- the secret


def test_secret_never_appears_in_logs(webhook: Webhook, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    body = json.dumps(alarm_payload()).encode()
    webhook.post_raw("/v1/alarms", body, _sig("wrong-secret-0123456789", body))
    webhook.post_raw("/v1/alarms", body, _sig(webhook.secret, body, now=0))
    webhook.post("/v1/alarms", alarm_payload())
    webhook.post("/v1/alarms", alarm_payload(step="x"))
    assert dispatcher_of(webhook.app).wait_idle(10)

    assert caplog.records, "the webhook logged nothing: the check below would prove nothing"
    assert any("refused" in record.getMessage() for record in caplog.records)
    for record in caplog.records:
        assert webhook.secret not in record.getMessage()
        assert webhook.secret not in repr(record.__dict__)
    assert webhook.secret not in caplog.text


# ---------------------------------------------------------------------- the trigger


class FailingOnceTrigger(RecordingTrigger):
    """A trigger whose first fire fails, as an unreachable Prefect API would."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 0

    def fire(self, incident_id: str, job_id: str) -> None:
        if self.failures == 0:
            self.failures += 1
            raise ConnectionError("Prefect API unreachable")
        super().fire(incident_id, job_id)


def test_trigger_failure_keeps_the_alarm_and_is_refired(
    ledger: Ledger, webhook_secret: str, caplog: pytest.LogCaptureFixture
) -> None:
    trigger = FailingOnceTrigger()
    # no automatic retry within the test: the refire below is what starts the flow, however
    # slowly the test gets there
    app = create_app(ledger, trigger, webhook_secret, trigger_retry_delays_s=(3600.0,))
    with run_in_thread(app) as url:
        hook = Webhook(url, app, ledger, trigger, webhook_secret)
        response = hook.post("/v1/alarms", alarm_payload())
        incident_id = response.json()["incident_id"]

        assert response.status_code == 202
        assert row_counts(ledger)["alarms"] == 1
        deadline = time.monotonic() + 10
        while trigger.failures == 0 or not hook.get("/healthz").json()["trigger_backlog"]:
            assert time.monotonic() < deadline, "the failed fire never reached the backlog"
            time.sleep(0.02)
        backlog = hook.get("/healthz").json()["trigger_backlog"]
        assert backlog == [
            {"incident_id": incident_id, "attempts": 1, "last_error": "Prefect API unreachable"}
        ]
        assert any(
            r.levelno == logging.ERROR and getattr(r, "incident", None) == incident_id
            for r in caplog.records
        )

        refire = hook.post(f"/v1/incidents/{incident_id}/trigger", {})
        assert refire.status_code == 202
        assert trigger.wait_for(1, timeout=10)
    assert trigger.calls == [(incident_id, "job-1")]


def test_incident_still_open_at_startup_is_fired_again(ledger: Ledger, webhook_secret: str) -> None:
    """A flow lost with the previous process (crash between record and fire) starts now."""
    first = RecordingTrigger()
    app = create_app(ledger, first, webhook_secret)
    with run_in_thread(app) as url:
        incident_id = (
            Webhook(url, app, ledger, first, webhook_secret)
            .post("/v1/alarms", alarm_payload())
            .json()["incident_id"]
        )

    restarted = RecordingTrigger()
    with run_in_thread(create_app(ledger, restarted, webhook_secret)):
        assert restarted.wait_for(1, timeout=10)
    assert first.calls == [(incident_id, "job-1")]
    assert restarted.calls == [(incident_id, "job-1")]
