"""``POST /v1/incidents/{incident_id}/retry``: move a ``failed`` or ``expired`` incident forward.

The API side of :func:`flows.webhook.retry.retry_incident` (the CLI and the Prefect UI have theirs):
signed like every POST, and answered 409 by the app's ledger error handler for an incident that
is not ``failed``/``expired`` or whose job has another live incident. The new flow run is started
before the answer, so a 202 means a run exists (or, for a non-Prefect trigger, was handed over).
"""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import APIRouter, HTTPException, Path
from pydantic import BaseModel, Field

from db import Ledger
from db.ledger.incidents import retry_count
from flows.webhook.models import LEDGER_ERRORS, SIGNED_ERRORS, IncidentId
from flows.webhook.retry import retry_incident
from flows.webhook.signed import Guard, signed_route_class
from flows.webhook.trigger import IncidentTrigger, TriggerError

__all__ = ["RetryBody", "RetryStarted", "retry_router"]


class RetryBody(BaseModel):
    by: str = Field(min_length=1, max_length=255, description="Who retries (name or e-mail).")
    reason: str = Field(min_length=1, max_length=2000, description="Why; kept in the history.")


class RetryStarted(BaseModel):
    incident_id: str
    state: str = Field(description="The live state the incident was reopened in.")
    retry: int = Field(description="This incident's retry number, from 1.")


def retry_router(ledger: Ledger, trigger: IncidentTrigger, guard: Guard) -> APIRouter:
    """The operator's incident actions, on the signed route class of the app."""
    router = APIRouter(route_class=signed_route_class(guard), responses=SIGNED_ERRORS)

    @router.post(
        "/v1/incidents/{incident_id}/retry",
        status_code=202,
        response_model=RetryStarted,
        responses=LEDGER_ERRORS,
        summary="Retry a failed or expired incident: reopen it and start a new flow run.",
    )
    async def post_retry(
        incident_id: Annotated[IncidentId, Path()], body: RetryBody
    ) -> RetryStarted:
        try:
            reopened = await anyio.to_thread.run_sync(
                lambda: retry_incident(ledger, trigger, incident_id, by=body.by, reason=body.reason)
            )
        except TriggerError as err:
            # reopened in the ledger, run not started: the same request starts it later
            raise HTTPException(503, f"reopened, but no flow run started: {err}") from err
        return RetryStarted(
            incident_id=reopened.id, state=reopened.state.value, retry=retry_count(reopened)
        )

    return router
