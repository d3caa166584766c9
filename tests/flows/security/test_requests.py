"""Requests signed as what they are, for the job they name: each refusal leaves the ledger as
it was (rows counted in every table), on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from detection.transport.signing import NONCE_HEADER, signed_headers
from tests.flows.conftest import alarm_payload, ranks_payload, row_counts
from tests.flows.security.conftest import KEY_A, KEY_A_NEW, KEY_B, PREFIX_A, Scoped

SHA = "ab" * 32
FP = "cd" * 16


def _checkpoint(step: int, uri: str) -> dict[str, object]:
    return {"step": step, "uri": uri, "sha256": SHA, "fingerprint": FP, "nodes": ["node-0"]}


def _seed_two_jobs(scoped: Scoped) -> None:
    assert scoped.post("/v1/jobs/job-a/ranks", ranks_payload(4)).status_code == 200
    assert scoped.post("/v1/jobs/job-b/ranks", ranks_payload(4), KEY_B).status_code == 200
    for job, key, uri in (
        ("job-a", KEY_A, PREFIX_A + "ckpt-10.pt"),
        ("job-b", KEY_B, "s3://ckpts/job-b/ckpt-10.pt"),
    ):
        assert (
            scoped.post(f"/v1/jobs/{job}/checkpoints", _checkpoint(10, uri), key).status_code == 201
        )


def test_a_signed_audit_replayed_to_another_jobs_path_is_refused(scoped: Scoped) -> None:
    """The reproduction of the issue: job A's signed audit, byte for byte, to job B's path."""
    _seed_two_jobs(scoped)
    body = json.dumps({"step": 12, "kind": "loss", "ranks": [0, 1], "passed": True}).encode()
    headers = signed_headers(*KEY_A, "POST", "/v1/jobs/job-a/audits", body)
    before = row_counts(scoped.ledger)

    replayed = scoped.send("/v1/jobs/job-b/audits", body, headers)

    assert replayed.status_code == 401
    assert replayed.json()["detail"] == "signature does not match"
    assert row_counts(scoped.ledger) == before
    assert [c.status.value for c in scoped.ledger.list_checkpoints("job-b")] == ["pending"]
    # the same request where it was signed for is fine
    assert scoped.send("/v1/jobs/job-a/audits", body, headers).status_code == 200
    assert [c.status.value for c in scoped.ledger.list_checkpoints("job-a")] == ["verified"]


@pytest.mark.parametrize(
    ("signed_for", "sent_to"),
    [
        ("/v1/jobs/job-a/checkpoints", "/v1/jobs/job-a/audits"),
        ("/v1/alarms", "/v1/alarms?job=job-b"),
        ("/v1/jobs/job-a/ranks?x=1", "/v1/jobs/job-a/ranks?x=2"),
    ],
)
def test_a_signature_binds_path_and_query(scoped: Scoped, signed_for: str, sent_to: str) -> None:
    body = json.dumps(alarm_payload(job_id="job-a")).encode()
    headers = signed_headers(*KEY_A, "POST", signed_for, body)
    before = row_counts(scoped.ledger)
    assert scoped.send(sent_to, body, headers).status_code == 401
    assert row_counts(scoped.ledger) == before


def test_a_replayed_signed_request_is_refused(scoped: Scoped) -> None:
    body = json.dumps(alarm_payload(job_id="job-a")).encode()
    headers = signed_headers(*KEY_A, "POST", "/v1/alarms", body)
    assert scoped.send("/v1/alarms", body, headers).status_code == 202
    before = row_counts(scoped.ledger)

    again = scoped.send("/v1/alarms", body, headers)

    assert again.status_code == 401
    assert "replayed" in again.json()["detail"]
    assert row_counts(scoped.ledger) == before


@pytest.mark.parametrize("endpoint", ["ranks", "checkpoints", "audits"])
def test_every_signed_post_is_refused_a_second_time(scoped: Scoped, endpoint: str) -> None:
    _seed_two_jobs(scoped)
    payload = {
        "ranks": ranks_payload(4),
        "checkpoints": _checkpoint(20, PREFIX_A + "ckpt-20.pt"),
        "audits": {"step": 5, "kind": "loss", "ranks": [0], "passed": False},
    }[endpoint]
    path = f"/v1/jobs/job-a/{endpoint}"
    body = json.dumps(payload).encode()
    headers = signed_headers(*KEY_A, "POST", path, body)
    assert scoped.send(path, body, headers).status_code in (200, 201)
    before = row_counts(scoped.ledger)
    assert scoped.send(path, body, headers).status_code == 401
    assert row_counts(scoped.ledger) == before


def test_a_key_of_job_a_cannot_write_anything_for_job_b(scoped: Scoped) -> None:
    _seed_two_jobs(scoped)
    before = row_counts(scoped.ledger)
    attempts = {
        "/v1/alarms": alarm_payload(job_id="job-b"),
        "/v1/jobs/job-b/ranks": ranks_payload(2),
        "/v1/jobs/job-b/checkpoints": _checkpoint(30, "s3://ckpts/job-b/ckpt-30.pt"),
        "/v1/jobs/job-b/audits": {"step": 40, "kind": "loss", "ranks": [0], "passed": True},
    }
    for path, payload in attempts.items():
        for key in (KEY_A, KEY_A_NEW):
            response = scoped.post(path, payload, key)
            assert response.status_code == 403, (path, response.text)
            assert "job-b" in response.json()["detail"]
    assert row_counts(scoped.ledger) == before
    assert scoped.trigger.calls == []


def test_the_trigger_of_another_jobs_incident_is_refused(scoped: Scoped) -> None:
    opened = scoped.post("/v1/alarms", alarm_payload(job_id="job-b"), KEY_B).json()
    path = f"/v1/incidents/{opened['incident_id']}/trigger"
    before = row_counts(scoped.ledger)
    body = b""
    headers = signed_headers(*KEY_A, "POST", path, body)
    assert scoped.send(path, body, headers).status_code == 403
    assert row_counts(scoped.ledger) == before


@pytest.mark.parametrize(
    "uri",
    [
        "file:///etc/passwd",
        "s3://any-bucket/ckpt.pt",
        PREFIX_A + "../job-b/ckpt-10.pt",
        PREFIX_A + "%2e%2e/job-b/ckpt-10.pt",
        PREFIX_A + "sub//ckpt.pt",
        PREFIX_A,
        "s3://ckpts/job-a-evil/ckpt.pt",
    ],
)
def test_a_checkpoint_outside_the_jobs_prefix_is_refused(scoped: Scoped, uri: str) -> None:
    _seed_two_jobs(scoped)
    before = row_counts(scoped.ledger)
    response = scoped.post("/v1/jobs/job-a/checkpoints", _checkpoint(20, uri))
    assert response.status_code == 403
    assert PREFIX_A in response.json()["detail"]
    assert row_counts(scoped.ledger) == before


def test_an_unknown_key_id_is_refused_like_a_wrong_signature(scoped: Scoped) -> None:
    before = row_counts(scoped.ledger)
    response = scoped.post("/v1/alarms", alarm_payload(job_id="job-a"), ("nobody", KEY_A[1]))
    assert (response.status_code, response.json()["detail"]) == (401, "signature does not match")
    assert row_counts(scoped.ledger) == before


def test_a_stale_or_malformed_nonce_is_refused(scoped: Scoped) -> None:
    body = json.dumps(alarm_payload(job_id="job-a")).encode()
    stale = signed_headers(*KEY_A, "POST", "/v1/alarms", body, now=time.time() - 400)
    short = signed_headers(*KEY_A, "POST", "/v1/alarms", body, nonce="short")
    before = row_counts(scoped.ledger)
    assert scoped.send("/v1/alarms", body, stale).status_code == 401
    response = scoped.send("/v1/alarms", body, short)
    assert response.status_code == 401
    assert NONCE_HEADER in response.json()["detail"]
    assert row_counts(scoped.ledger) == before


# ---------------------------------------------------------------------- input that makes sense


def test_duplicate_json_keys_are_refused(scoped: Scoped) -> None:
    """``step`` 7 then 2,000,000,000: last-one-wins would widen the suspect range to 0..2e9."""
    alarm = alarm_payload(job_id="job-a", step=7)
    text = json.dumps(alarm)
    body = text.replace('"step": 7', '"step": 7, "step": 2000000000').encode()
    headers = signed_headers(*KEY_A, "POST", "/v1/alarms", body)
    before = row_counts(scoped.ledger)
    response = scoped.send("/v1/alarms", body, headers)
    assert response.status_code == 400
    assert "duplicate key 'step'" in response.json()["detail"]
    assert row_counts(scoped.ledger) == before


def test_a_lone_surrogate_in_a_detail_key_is_422_not_500(scoped: Scoped) -> None:
    body = json.dumps(alarm_payload(job_id="job-a", detail={"\ud800key": 1})).encode()
    headers = signed_headers(*KEY_A, "POST", "/v1/alarms", body)
    before = row_counts(scoped.ledger)
    response = scoped.send("/v1/alarms", body, headers)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "detail", "\\ud800key"]
    assert row_counts(scoped.ledger) == before


def test_the_same_alarm_id_with_other_content_is_409(scoped: Scoped) -> None:
    alarm = alarm_payload(job_id="job-a", step=7)
    assert scoped.post("/v1/alarms", alarm).status_code == 202
    before = row_counts(scoped.ledger)
    changed = scoped.post("/v1/alarms", {**alarm, "step": 2_000_000_000})
    assert changed.status_code == 409
    assert "different step" in changed.json()["detail"]
    assert row_counts(scoped.ledger) == before
    resent = scoped.post("/v1/alarms", alarm)  # the same alarm, a new request: a duplicate
    assert (resent.status_code, resent.json()["duplicate"]) == (202, True)


def test_an_older_registration_never_overwrites_a_newer_one(scoped: Scoped) -> None:
    newer = {**ranks_payload(2), "generation": 2}
    newer["ranks"][1]["node"] = "node-9"
    assert scoped.post("/v1/jobs/job-a/ranks", newer).status_code == 200
    before = row_counts(scoped.ledger)
    older = scoped.post("/v1/jobs/job-a/ranks", {**ranks_payload(2), "generation": 1})
    assert older.status_code == 409
    assert "generation 2" in older.json()["detail"]
    assert row_counts(scoped.ledger) == before
    assert scoped.ledger.rank_map("job-a")[1].node == "node-9"


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/v1/alarms", alarm_payload(job_id="job-a", suspect_nodes=[f"n-{i}" for i in range(257)])),
        ("/v1/alarms", alarm_payload(job_id="job-a", suspect_ranks=list(range(1025)))),
        ("/v1/alarms", alarm_payload(job_id="job-a", detail={f"k{i}": i for i in range(65)})),
        ("/v1/alarms", alarm_payload(job_id="job-a", detail={"pad": "x" * 17_000})),
        ("/v1/jobs/job-a/ranks", ranks_payload(16_385)),
    ],
    ids=["suspect-nodes", "suspect-ranks", "detail-keys", "detail-bytes", "ranks"],
)
def test_sizes_over_the_documented_limits_are_422(
    scoped: Scoped, path: str, payload: object
) -> None:
    before = row_counts(scoped.ledger)
    response = scoped.post(path, payload)
    assert response.status_code == 422, response.text
    assert row_counts(scoped.ledger) == before


def test_a_fresh_alarm_id_per_request_is_not_a_replay(scoped: Scoped) -> None:
    ids = {str(uuid.uuid4()) for _ in range(5)}
    for alarm_id in ids:
        assert (
            scoped.post("/v1/alarms", alarm_payload(job_id="job-a", alarm_id=alarm_id)).status_code
            == 202
        )
    [incident] = scoped.ledger.list_incidents("job-a")
    assert {a.alarm_id for a in incident.alarms} == ids
