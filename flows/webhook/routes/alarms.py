"""``POST /v1/alarms``: an alarm into the ledger through the batcher; the alarm that opens an
incident starts its flow."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request

from db import AlarmIn, Ledger, NonceReused
from flows.webhook.models import (
    LEDGER_ERRORS,
    AlarmAccepted,
    AlarmBody,
)
from flows.webhook.service import Service, signed_post
from flows.webhook.signed import REPLAYED, Refused, authorize

__all__ = ["add_alarm_routes"]

logger = logging.getLogger(__name__)


def add_alarm_routes(app: FastAPI, service: Service) -> None:
    @signed_post(
        app,
        service.guard,
        "/v1/alarms",
        status_code=202,
        response_model=AlarmAccepted,
        responses=LEDGER_ERRORS,
        summary="Record an alarm; the alarm that opens an incident starts its flow.",
    )
    async def post_alarm(alarm: AlarmBody, request: Request) -> AlarmAccepted:
        caller = authorize(request, alarm.job_id)  # its nonce is claimed with the alarm's batch
        record = AlarmIn(
            alarm_id=str(alarm.alarm_id),
            job_id=alarm.job_id,
            step=alarm.step,
            rank=alarm.rank,
            node=alarm.node,
            layer=alarm.layer.value,
            phase=alarm.phase.value,
            suspect_ranks=list(alarm.suspect_ranks),
            suspect_nodes=list(alarm.suspect_nodes),
            detail=dict(alarm.detail),
            sent_at=alarm.sent_at,
        )
        Ledger.validate_alarm(record)  # refused here, alone, not as part of someone's batch
        nonce = None if caller.nonce is None else (caller.nonce, caller.key_id)
        # the batcher fires the trigger if the alarm opened an incident
        outcome = await service.batcher.record(record, nonce)
        if isinstance(outcome, NonceReused):
            raise Refused(401, REPLAYED)
        if outcome.duplicate:
            logger.debug(
                "duplicate alarm",
                extra={"job": alarm.job_id, "incident": outcome.incident_id, "rank": alarm.rank},
            )
        return AlarmAccepted(incident_id=outcome.incident_id, duplicate=outcome.duplicate)
