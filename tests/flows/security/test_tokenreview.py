"""Training pods authenticated by their projected service-account token (TokenReview)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from db import Ledger
from detection.transport.signing import NONCE_HEADER, TIMESTAMP_HEADER
from flows.webhook import create_app
from flows.webhook.auth import Credentials, TokenCache
from flows.webhook.serve import run_in_thread
from flows.webhook.trigger import RecordingTrigger
from recovery.kube.client import api_client_for_host
from recovery.kube.tokenreview import TokenReviewer
from tests.flows.conftest import alarm_payload, row_counts
from tests.recovery.fake_kube import FakeKube

TOKEN = "projected-token-of-team-a-trainer"


@pytest.fixture
def pod_webhook(ledger: Ledger) -> Iterator[tuple[str, FakeKube]]:
    with FakeKube() as fake:
        fake.add_token(TOKEN, "system:serviceaccount:team-a:trainer")
        reviewer = TokenReviewer(api_client_for_host(fake.url, token="webhook-sa"), "sdcguard")
        creds = Credentials.from_mapping(
            {"service_accounts": [{"namespace": "team-a", "name": "trainer", "jobs": ["team-a-*"]}]}
        )
        creds.token_review = TokenCache(reviewer.username)
        app = create_app(ledger, RecordingTrigger(), creds)
        with run_in_thread(app) as url:
            yield url, fake


def _post(url: str, token: str, payload: object, nonce: str | None = None) -> httpx.Response:
    headers = {
        "Authorization": f"Bearer {token}",
        "Content-Type": "application/json",
        TIMESTAMP_HEADER: str(int(time.time())),
        NONCE_HEADER: nonce or uuid.uuid4().hex,
    }
    return httpx.post(url + "/v1/alarms", content=json.dumps(payload), headers=headers, timeout=30)


def test_a_pod_token_writes_for_its_jobs_only(
    pod_webhook: tuple[str, FakeKube], ledger: Ledger
) -> None:
    url, fake = pod_webhook
    assert _post(url, TOKEN, alarm_payload(job_id="team-a-llm")).status_code == 202
    assert _post(url, TOKEN, alarm_payload(job_id="team-a-llm")).status_code == 202
    before = row_counts(ledger)
    assert _post(url, TOKEN, alarm_payload(job_id="team-b-llm")).status_code == 403
    assert (
        _post(url, "stolen-or-made-up-token", alarm_payload(job_id="team-a-llm")).status_code == 401
    )
    assert row_counts(ledger) == before
    # one TokenReview for the pod's token, however many alarms it sends (and one for the bad one)
    assert len(fake.requests_to("POST", r"/apis/authentication\.k8s\.io/v1/tokenreviews")) == 2


def test_a_pod_token_request_is_refused_when_replayed(
    pod_webhook: tuple[str, FakeKube], ledger: Ledger
) -> None:
    url, _fake = pod_webhook
    nonce = uuid.uuid4().hex
    assert _post(url, TOKEN, alarm_payload(job_id="team-a-llm"), nonce).status_code == 202
    before = row_counts(ledger)
    assert _post(url, TOKEN, alarm_payload(job_id="team-a-llm"), nonce).status_code == 401
    assert row_counts(ledger) == before
