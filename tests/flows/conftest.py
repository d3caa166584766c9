"""Fixtures of the flows tests: a real webhook on loopback, signed requests, a real Prefect API.

The ledger fixtures (``database_url`` over SQLite and PostgreSQL, a migrated ``ledger``) come
from ``tests/fixtures_db.py``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import func, select

from db import Ledger
from db.models import Base
from detection.transport.signing import DEFAULT_KEY_ID, signed_headers
from flows.incident.wiring import Backends
from flows.webhook import create_app
from flows.webhook.serve import run_in_thread
from flows.webhook.trigger import RecordingTrigger

WEBHOOK_SECRET = "test-webhook-secret-0123456789abcdef"


@dataclass(frozen=True)
class Webhook:
    """A running webhook app and what it writes to."""

    url: str
    app: FastAPI
    ledger: Ledger
    trigger: RecordingTrigger
    secret: str

    def post(self, path: str, payload: Any) -> httpx.Response:
        """POST ``payload`` as JSON, signed the way DESIGN says."""
        return signed_post(self.url, self.secret, path, payload)

    def post_raw(self, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
        all_headers = {"Content-Type": "application/json", **headers}
        return httpx.post(self.url + path, content=body, headers=all_headers, timeout=30)

    def get(self, path: str, **params: Any) -> httpx.Response:
        """GET as a reader: signed with the webhook's key, as DESIGN says."""
        return signed_get(self.url, self.secret, path, **params)

    def get_unsigned(self, path: str, **params: Any) -> httpx.Response:
        return httpx.get(self.url + path, params=params, timeout=30)


def signed_post(
    url: str, secret: str, path: str, payload: Any, *, key_id: str = DEFAULT_KEY_ID
) -> httpx.Response:
    """POST ``payload`` as JSON to ``url + path``, signed the way DESIGN says."""
    body = json.dumps(payload).encode()
    headers = {
        **signed_headers(key_id, secret, "POST", path, body),
        "Content-Type": "application/json",
    }
    return httpx.post(url + path, content=body, headers=headers, timeout=30)


def ledger_only(ledger: Ledger) -> Backends:
    """Backends of which only the ledger exists: for stage bodies that reach nothing else
    (an outside call would fail loudly on ``None``)."""
    none = cast(Any, None)
    return Backends(
        ledger=ledger,
        nodes=none,
        jobs=none,
        telemetry=none,
        rerunner=none,
        hyperpod=none,
        checkpoints=none,
        directory=none,
        catalog=none,
        description="ledger only",
    )


def signed_get(
    url: str, secret: str, path: str, *, key_id: str = DEFAULT_KEY_ID, **params: Any
) -> httpx.Response:
    """GET ``url + path`` with ``params``, signed over the exact query httpx sends."""
    request = httpx.Request("GET", url + path, params=params)
    target = request.url.raw_path.decode("ascii")
    headers = signed_headers(key_id, secret, "GET", target)
    return httpx.get(request.url, headers=headers, timeout=30)


# The replay store records that a signed request was *seen* (so it is refused a second time),
# not anything the request said: it is not ledger content.
_NOT_CONTENT = {"request_nonces"}


def row_counts(ledger: Ledger) -> dict[str, int]:
    """Rows per ledger table: what "nothing was written" is checked against."""
    with ledger.engine.connect() as conn:
        return {
            table.name: int(conn.execute(select(func.count()).select_from(table)).scalar_one())
            for table in Base.metadata.sorted_tables
            if table.name not in _NOT_CONTENT
        }


@pytest.fixture
def webhook_secret() -> str:
    return WEBHOOK_SECRET


@pytest.fixture
def recording_trigger() -> RecordingTrigger:
    return RecordingTrigger()


@pytest.fixture
def webhook(
    ledger: Ledger, recording_trigger: RecordingTrigger, webhook_secret: str
) -> Iterator[Webhook]:
    """The app on a real uvicorn server on loopback, over the parametrized ledger."""
    # No read budget to speak of: these tests are about answers, not about read rates.
    app = create_app(
        ledger, recording_trigger, webhook_secret, max_body_bytes=64 * 1024, reads_per_s=1e6
    )
    with run_in_thread(app) as url:
        yield Webhook(url, app, ledger, recording_trigger, webhook_secret)


def alarm_payload(
    *,
    job_id: Any = "job-1",
    step: Any = 37,
    rank: Any = 2,
    node: Any = "node-2",
    **overrides: Any,
) -> dict[str, Any]:
    """An alarm body as DESIGN writes it, with a fresh alarm id; any field may be overridden
    (with any value: the refusal tests send wrong types on purpose)."""
    payload: dict[str, Any] = {
        "alarm_id": str(uuid.uuid4()),
        "job_id": job_id,
        "step": step,
        "rank": rank,
        "node": node,
        "layer": "audit",
        "phase": "gradient",
        "suspect_ranks": [rank],
        "suspect_nodes": [node],
        "detail": {"max_abs_diff": 3.5e38, "partner": 3},
        "sent_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
    }
    payload.update(overrides)
    return payload


def ranks_payload(world_size: int, ranks_per_node: int = 4) -> dict[str, Any]:
    return {
        "ranks": [
            {
                "rank": r,
                "local_rank": r % ranks_per_node,
                "node": f"node-{r // ranks_per_node}",
                "instance_id": f"i-{r // ranks_per_node:017x}",
                "gpu_uuid": f"GPU-{uuid.UUID(int=r)}",
            }
            for r in range(world_size)
        ]
    }
