"""PrefectTrigger against a real (temporary, local) Prefect API.

Checked through Prefect's own client: one flow run per incident however often it is fired, with
the incident id as its only parameter, and the ``sdcguard.incident.opened`` event in the feed.
"""

from __future__ import annotations

import time
import uuid
from uuid import UUID

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
from prefect.client.schemas.objects import FlowRun
from prefect.deployments.runner import RunnerDeployment
from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
from prefect.events.schemas.events import ReceivedEvent

from db import Ledger
from flows.webhook import create_app, dispatcher_of
from flows.webhook.serve import run_in_thread
from flows.webhook.trigger import INCIDENT_OPENED_EVENT, PrefectTrigger, incident_event_id
from tests.flows.conftest import alarm_payload, signed_post

DEPLOYMENT = "incident-response/incident"


@flow(name="incident-response")
def incident_response(incident_id: str) -> str:
    """Stands in for the real flow: only its deployment's runs are inspected, never executed."""
    return incident_id


@pytest.fixture(scope="module")
def deployment_id(prefect_api: str) -> UUID:
    deployment = incident_response.to_deployment(name="incident")
    assert isinstance(deployment, RunnerDeployment)  # sync context: not a coroutine
    applied = deployment.apply()
    assert isinstance(applied, UUID)
    return applied


def _runs(deployment_id: UUID) -> list[FlowRun]:
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
        )


def _opened_events(incident_id: str, timeout_s: float = 60) -> list[ReceivedEvent]:
    """Events are persisted asynchronously by the server: poll until one is stored."""
    query = EventFilter(
        event=EventNameFilter(name=[INCIDENT_OPENED_EVENT]),
        resource=EventResourceFilter(id=[f"sdcguard.incident.{incident_id}"]),
    )
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            # The client defaults to limit=100, which this server version refuses (max 50).
            events = client.read_events(filter=query, limit=50).events
            if events or time.monotonic() > deadline:
                return events
            time.sleep(0.5)


def _runs_of(deployment_id: UUID, incident_id: str) -> list[FlowRun]:
    return [r for r in _runs(deployment_id) if r.parameters.get("incident_id") == incident_id]


@pytest.mark.slow
def test_firing_twice_creates_one_flow_run_and_emits_the_event(deployment_id: UUID) -> None:
    incident_id = str(uuid.uuid4())
    trigger = PrefectTrigger(DEPLOYMENT)

    trigger.fire(incident_id, "job-7")
    trigger.fire(incident_id, "job-7")

    runs = _runs_of(deployment_id, incident_id)
    assert len(runs) == 1
    assert runs[0].parameters == {"incident_id": incident_id}
    assert runs[0].idempotency_key == f"incident-{incident_id}"

    events = _opened_events(incident_id)
    assert len(events) == 1, "a re-fire must not duplicate the event"
    event = events[0]
    assert event.id == incident_event_id(incident_id)
    assert event.payload == {"incident_id": incident_id, "job_id": "job-7"}
    # Prefect adds the ambient flow run (if any) to an event's related resources; ours is the job.
    related = {r.id: r.role for r in event.related}
    assert related["sdcguard.job.job-7"] == "job"


@pytest.mark.slow
def test_alarm_storm_through_the_webhook_starts_one_deployment_run(
    deployment_id: UUID, sqlite_ledger: Ledger, webhook_secret: str
) -> None:
    trigger = PrefectTrigger(DEPLOYMENT)
    app = create_app(sqlite_ledger, trigger, webhook_secret)
    with run_in_thread(app) as url:
        responses = [
            signed_post(
                url,
                webhook_secret,
                "/v1/alarms",
                alarm_payload(job_id="job-p", rank=r, node=f"node-{r}"),
            )
            for r in range(8)
        ]
        assert dispatcher_of(app).wait_idle(60)
    incident_ids = {r.json()["incident_id"] for r in responses}
    assert len(incident_ids) == 1
    (incident_id,) = incident_ids

    runs = _runs_of(deployment_id, incident_id)
    assert [run.parameters for run in runs] == [{"incident_id": incident_id}]


@pytest.mark.slow
def test_unknown_deployment_is_a_trigger_error(prefect_api: str) -> None:
    from flows.webhook.trigger import TriggerError

    with pytest.raises(TriggerError, match="no-such-flow/nowhere"):
        PrefectTrigger("no-such-flow/nowhere").fire(str(uuid.uuid4()), "job-1")
