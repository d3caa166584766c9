"""``/v1/incidents``: the incidents read a page at a time or one by one, and an operator's
actions on one — fire its trigger again, retry it."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import FastAPI, Path, Query, Request

from db import IncidentState, UnknownIncident
from flows.webhook.models import (
    LEDGER_ERRORS,
    READ_ERRORS,
    IncidentId,
    JobId,
    TriggerQueued,
)
from flows.webhook.reads import Reader, covered_jobs, decode_cursor, encode_cursor
from flows.webhook.routes.retry import retry_router
from flows.webhook.service import Service, signed_post
from flows.webhook.signed import Refused, admit, printable

__all__ = ["add_incident_routes"]

logger = logging.getLogger(__name__)


def add_incident_routes(app: FastAPI, service: Service) -> None:
    @signed_post(
        app,
        service.guard,
        "/v1/incidents/{incident_id}/trigger",
        status_code=202,
        response_model=TriggerQueued,
        responses=LEDGER_ERRORS,
        summary="Fire the trigger of a recorded incident again (after a failed start).",
    )
    async def post_trigger(
        incident_id: Annotated[IncidentId, Path()], request: Request
    ) -> TriggerQueued:
        incident = await service.threads.write(service.ledger.get_incident, incident_id)
        await admit(request, incident.job_id, service.nonces)
        queued = service.dispatcher.submit(incident.id, incident.job_id)
        return TriggerQueued(incident_id=incident.id, queued=queued)

    app.include_router(retry_router(service.ledger, service.trigger, service.guard))

    @app.get(
        "/v1/incidents",
        responses={**READ_ERRORS, **LEDGER_ERRORS},
        summary="Incident summaries, newest first, a page at a time; filter by job and state.",
    )
    async def get_incidents(
        principal: Reader,
        job_id: Annotated[JobId | None, Query()] = None,
        state: Annotated[IncidentState | None, Query()] = None,
        limit: Annotated[int, Query(ge=1, le=200)] = 50,
        cursor: Annotated[str | None, Query(max_length=512, pattern=r"^[A-Za-z0-9_-]+$")] = None,
    ) -> dict[str, Any]:
        jobs: frozenset[str] | None = None
        if job_id is not None and not principal.covers(job_id):
            raise Refused(403, f"{printable(principal.name)} may not read job {job_id}")
        if not principal.all_jobs and job_id is None:
            jobs = await service.threads.read(covered_jobs, service.reads, principal)
        after = None if cursor is None else decode_cursor(cursor)

        def page() -> Any:
            return service.reads.list_incidents_page(
                job_id, state, limit=limit, after=after, jobs=jobs
            )

        found = await service.threads.read(page)
        return {
            "incidents": found.incidents,
            "next_cursor": encode_cursor(found.next_after),
        }

    @app.get(
        "/v1/incidents/{incident_id}",
        responses={**READ_ERRORS, **LEDGER_ERRORS},
        summary="One incident with its alarms, suspect range, actions and history.",
    )
    async def get_incident(
        principal: Reader, incident_id: Annotated[IncidentId, Path()]
    ) -> dict[str, Any]:
        incident = await service.threads.read(service.reads.get_incident, incident_id)
        if not principal.covers(incident.job_id):
            raise UnknownIncident(incident_id)  # not 403: do not confirm that it exists
        return incident.to_dict()
