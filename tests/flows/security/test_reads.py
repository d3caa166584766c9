"""Reads need a reader; they come a page at a time; a read flood never starves alarm writes."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import httpx

from db import AlarmIn, Ledger
from detection.transport.signing import signed_headers
from flows.webhook import create_app
from flows.webhook.auth import Credentials
from flows.webhook.serve import run_in_thread
from flows.webhook.trigger import RecordingTrigger
from tests.flows.conftest import alarm_payload, row_counts
from tests.flows.security.conftest import (
    KEY_A,
    KEY_B,
    OPS_TOKEN,
    TEAM_A_TOKEN,
    Scoped,
    credentials_document,
)


def _open_incidents(scoped: Scoped, jobs: list[str]) -> dict[str, str]:
    ids = {}
    for job in jobs:
        key = KEY_B if job == "job-b" else KEY_A
        response = scoped.post("/v1/alarms", alarm_payload(job_id=job), key)
        assert response.status_code == 202, response.text
        ids[job] = response.json()["incident_id"]
    return ids


def test_unauthenticated_reads_are_refused(scoped: Scoped) -> None:
    ids = _open_incidents(scoped, ["job-a"])
    before = row_counts(scoped.ledger)
    for path in ("/v1/incidents", f"/v1/incidents/{ids['job-a']}"):
        assert scoped.read(path, token=None).status_code == 401
        assert scoped.read(path, token="not-a-known-token-0123456789").status_code == 401
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert scoped.read(path, token=None).status_code == 404
    assert row_counts(scoped.ledger) == before


def test_a_writer_key_is_not_a_reader(scoped: Scoped) -> None:
    headers = signed_headers(*KEY_A, "GET", "/v1/incidents")
    response = httpx.get(scoped.url + "/v1/incidents", headers=headers, timeout=30)
    assert response.status_code == 403


def test_a_reader_reads_and_a_scoped_reader_sees_only_its_jobs(scoped: Scoped) -> None:
    ids = _open_incidents(scoped, ["job-a", "job-b"])
    every = scoped.read("/v1/incidents").json()["incidents"]
    assert {i["job_id"] for i in every} == {"job-a", "job-b"}
    assert scoped.read(f"/v1/incidents/{ids['job-b']}").status_code == 200

    team = scoped.read("/v1/incidents", token=TEAM_A_TOKEN).json()["incidents"]
    assert [i["job_id"] for i in team] == ["job-a"]
    assert scoped.read("/v1/incidents", token=TEAM_A_TOKEN, job_id="job-b").status_code == 403
    hidden = scoped.read(f"/v1/incidents/{ids['job-b']}", token=TEAM_A_TOKEN)
    assert hidden.status_code == 404


def test_incidents_come_a_page_at_a_time_with_a_cursor(scoped: Scoped) -> None:
    jobs = [f"job-a{i:02d}" for i in range(7)]
    for job in jobs:  # straight into the ledger: the readers' view is what is under test
        scoped.ledger.record_alarm(_alarm_in(job))
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params: dict[str, object] = {"limit": 3}
        if cursor is not None:
            params["cursor"] = cursor
        page = scoped.read("/v1/incidents", OPS_TOKEN, **params).json()
        pages += 1
        seen += [i["job_id"] for i in page["incidents"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert pages == 3
    assert sorted(seen) == jobs
    assert len(seen) == len(set(seen))
    assert scoped.read("/v1/incidents", cursor="bm90LWEtY3Vyc29y").status_code == 422
    assert scoped.read("/v1/incidents", limit=0).status_code == 422
    assert scoped.read("/v1/incidents", limit=201).status_code == 422


def _alarm_in(job: str) -> AlarmIn:
    payload = alarm_payload(job_id=job)
    return AlarmIn(
        alarm_id=payload["alarm_id"],
        job_id=job,
        step=payload["step"],
        rank=payload["rank"],
        node=payload["node"],
        layer="audit",
        phase="gradient",
        suspect_ranks=payload["suspect_ranks"],
        suspect_nodes=payload["suspect_nodes"],
        detail={},
        sent_at=datetime.now(UTC),
    )


def test_a_read_flood_never_starves_an_alarm_burst(scoped: Scoped) -> None:
    """4,096 alarms land while 8 readers (bounded: one request in flight each) loop over the
    incident list. Correctness and starvation, not speed (benchmarks/webhook.py times it):
    every alarm is recorded once, and the flood is served (200) for the whole burst; reads over
    the read budget are refused with 429, never with an error."""
    alarms = [
        json.dumps(alarm_payload(job_id="job-a", rank=r, node=f"node-{r // 8}")).encode()
        for r in range(4096)
    ]
    done = threading.Event()
    reads: list[int] = []
    refused: list[int] = []

    def reader() -> None:
        with httpx.Client(base_url=scoped.url, timeout=60) as http:
            headers = {"Authorization": f"Bearer {OPS_TOKEN}"}
            while not done.is_set():
                status = http.get(
                    "/v1/incidents", params={"limit": 50}, headers=headers
                ).status_code
                if status == 429:  # over the read budget: refused cheaply, before any work
                    refused.append(status)
                    done.wait(0.05)  # what Retry-After asks, cut short when the burst ends
                    continue
                reads.append(status)

    def writer(index: int) -> list[int]:
        with httpx.Client(base_url=scoped.url, timeout=120) as http:
            statuses = []
            for body in alarms[index::32]:
                headers = {
                    **signed_headers(*KEY_A, "POST", "/v1/alarms", body),
                    "Content-Type": "application/json",
                }
                statuses.append(http.post("/v1/alarms", content=body, headers=headers).status_code)
            return statuses

    with ThreadPoolExecutor(8) as readers:
        flood = [readers.submit(reader) for _ in range(8)]
        while len(reads) < 8:
            assert not any(f.done() for f in flood), [f.exception() for f in flood]
            time.sleep(0.01)
        with ThreadPoolExecutor(32) as writers:
            statuses = [s for batch in writers.map(writer, range(32)) for s in batch]
        reads_at_end = len(reads)
        done.set()
        for future in flood:
            future.result(60)

    assert statuses == [202] * 4096
    [incident] = scoped.ledger.list_incidents("job-a")
    assert len(incident.alarms) == 4096
    assert set(reads) == {200}
    assert reads_at_end > 8  # the readers kept being served while the burst landed


def test_reads_over_the_budget_are_429_with_retry_after(ledger: Ledger) -> None:
    # One read per 20 s (a budget of one): the refusals cannot depend on how fast the machine
    # sends the requests — a refill inside the test would need 20 s.
    app = create_app(
        ledger,
        RecordingTrigger(),
        Credentials.from_mapping(credentials_document()),
        reads_per_s=0.05,
    )
    with run_in_thread(app) as url:
        headers = {"Authorization": f"Bearer {OPS_TOKEN}"}
        statuses = [httpx.get(url + "/v1/incidents", headers=headers, timeout=30) for _ in range(3)]
    assert [r.status_code for r in statuses] == [200, 429, 429]
    # Retry-After says when the budget has a read again: 20 s after the first read (less the
    # seconds the requests took), not a fixed second
    assert 10 <= int(statuses[-1].headers["retry-after"]) <= 20
