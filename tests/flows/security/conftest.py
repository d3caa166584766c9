"""A webhook with scoped credentials: a key per job, a second key for rotation, readers.

``job-a`` has two valid keys (``job-a-2025`` and ``job-a-2026``: a rotation in progress) and
a checkpoint prefix; ``job-b`` has its own key; ``ops`` reads with a bearer token, ``team-a``
reads only ``job-a*`` jobs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from db import Ledger
from detection.transport.signing import signed_headers
from flows.webhook import create_app
from flows.webhook.auth import Credentials
from flows.webhook.serve import run_in_thread
from flows.webhook.trigger import RecordingTrigger

KEY_A = ("job-a-2025", "secret-of-job-a-2025-0123456789")
KEY_A_NEW = ("job-a-2026", "secret-of-job-a-2026-0123456789")
KEY_B = ("job-b-2025", "secret-of-job-b-2025-0123456789")
OPS_TOKEN = "ops-reader-token-0123456789abcdef"
TEAM_A_TOKEN = "team-a-reader-token-0123456789ab"
PREFIX_A = "s3://ckpts/job-a/"


def credentials_document() -> dict[str, Any]:
    def digest(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    return {
        "keys": [
            {"id": KEY_A[0], "secret": KEY_A[1], "jobs": ["job-a"], "checkpoint_prefix": PREFIX_A},
            {
                "id": KEY_A_NEW[0],
                "secret": KEY_A_NEW[1],
                "jobs": ["job-a"],
                "checkpoint_prefix": "s3://ckpts/{job_id}/",
            },
            {"id": KEY_B[0], "secret": KEY_B[1], "jobs": ["job-b"]},
        ],
        "readers": [
            {"id": "ops", "token_sha256": digest(OPS_TOKEN), "jobs": ["*"]},
            {"id": "team-a", "token_sha256": digest(TEAM_A_TOKEN), "jobs": ["job-a*"]},
        ],
    }


@dataclass(frozen=True)
class Scoped:
    """The running app, its ledger, and helpers to call it as one key or another."""

    url: str
    ledger: Ledger
    trigger: RecordingTrigger

    def post(
        self, path: str, payload: Any, key: tuple[str, str] = KEY_A, **extra: str
    ) -> httpx.Response:
        body = json.dumps(payload).encode()
        headers = {**signed_headers(*key, "POST", path, body), **extra}
        return self.send(path, body, headers)

    def send(self, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
        headers = {"Content-Type": "application/json", **headers}
        return httpx.post(self.url + path, content=body, headers=headers, timeout=30)

    def read(self, path: str, token: str | None = OPS_TOKEN, **params: Any) -> httpx.Response:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        return httpx.get(self.url + path, params=params, headers=headers, timeout=30)


@pytest.fixture
def scoped(ledger: Ledger) -> Iterator[Scoped]:
    trigger = RecordingTrigger()
    credentials = Credentials.from_mapping(credentials_document())
    app = create_app(ledger, trigger, credentials, max_body_bytes=4 << 20, reads_per_s=1e6)
    with run_in_thread(app) as url:
        yield Scoped(url, ledger, trigger)
