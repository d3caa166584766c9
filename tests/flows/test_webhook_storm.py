"""An alarm storm: every rank of a 4,096-rank job reports the same step at once.

The webhook must record every alarm exactly once, attach all of them to one incident and start
exactly one flow — the property that keeps a fleet-wide fault from starting 4,096 recoveries.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from db import Ledger
from detection.signing import signed_headers
from flows.serve import run_in_thread
from flows.trigger import RecordingTrigger
from flows.webhook import create_app, dispatcher_of
from tests.flows.conftest import Webhook, alarm_payload, ranks_payload

WORLD_SIZE = 4096
CLIENTS = 64
STEP = 1234


# Minutes, not seconds, on two cores: every alarm re-reads all of its incident's alarms in the
# ledger (see benchmarks/webhook.py), so the default 300 s per-test limit is too tight here.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_storm_records_every_alarm_once_opens_one_incident_fires_once(
    ledger: Ledger, webhook_secret: str
) -> None:
    trigger = RecordingTrigger()
    app = create_app(ledger, trigger, webhook_secret)  # default 1 MiB: the rank map is ~0.5 MiB
    with run_in_thread(app) as url:
        _storm(Webhook(url, app, ledger, trigger, webhook_secret))


def _storm(webhook: Webhook) -> None:
    registered = webhook.post("/v1/jobs/storm-job/ranks", ranks_payload(WORLD_SIZE, 8))
    assert registered.status_code == 200, registered.text
    bodies = [
        json.dumps(
            alarm_payload(job_id="storm-job", step=STEP, rank=rank, node=f"node-{rank // 8}")
        ).encode()
        for rank in range(WORLD_SIZE)
    ]

    def client(index: int) -> list[httpx.Response]:
        with httpx.Client(base_url=webhook.url, timeout=60) as http:
            return [
                http.post(
                    "/v1/alarms",
                    content=body,
                    headers={
                        **signed_headers(webhook.secret, body),
                        "Content-Type": "application/json",
                    },
                )
                for body in bodies[index::CLIENTS]
            ]

    with ThreadPoolExecutor(CLIENTS) as pool:
        responses = [r for batch in pool.map(client, range(CLIENTS)) for r in batch]

    assert len(responses) == WORLD_SIZE
    assert {r.status_code for r in responses} == {202}, {
        r.status_code: r.text for r in responses if r.status_code != 202
    }
    incidents = {r.json()["incident_id"] for r in responses}
    assert len(incidents) == 1
    assert not any(r.json()["duplicate"] for r in responses)

    (incident_id,) = incidents
    incident = webhook.ledger.get_incident(incident_id)
    assert len(incident.alarms) == WORLD_SIZE
    assert sorted(alarm.rank for alarm in incident.alarms) == list(range(WORLD_SIZE))
    assert len(webhook.ledger.list_incidents("storm-job")) == 1
    assert dispatcher_of(webhook.app).wait_idle(30)
    assert webhook.trigger.calls == [(incident_id, "storm-job")]
