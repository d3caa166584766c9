"""``POST /v1/external-alarms``: an alarm from another SDC detector, into the same ledger and flow.

The alarm is recorded like sdcguard's own — same batcher, same nonce claim in the recording
transaction, same incident opened or widened, same trigger — under its own layer
(:data:`detection.external.EXTERNAL_LAYER`, its ``phase`` the source), so the incident flow, the
storm guard and the approval see it, and the policy knows it for the weaker evidence it is.

Invariants: the alarm names someone. A rank alone is resolved to its node through the job's
rank map, and a rank the map does not hold is refused (422) rather than guessed; a node outside
the job's rank map is kept as evidence and cordons nothing (as for any alarm). A step the
detector did not know is recorded as 0 (``detail.step_known`` false): the suspect range then
starts at the job's first step, so no checkpoint is resumed from without a human.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request

from db import AlarmIn, InvalidValue, Ledger, NonceReused
from detection.external.alarm import EXTERNAL_LAYER
from flows.webhook.models import LEDGER_ERRORS, AlarmAccepted, ExternalAlarmBody
from flows.webhook.service import Service, signed_post
from flows.webhook.signed import REPLAYED, Refused, authorize

__all__ = ["add_external_alarm_routes", "external_alarm_record"]

logger = logging.getLogger(__name__)


def external_alarm_record(body: ExternalAlarmBody, node: str) -> AlarmIn:
    """The ledger's alarm for ``body``, accusing ``node`` (and the rank, when known)."""
    return AlarmIn(
        alarm_id=str(body.alarm_id),
        job_id=body.job_id,
        step=0 if body.step is None else body.step,
        rank=0 if body.rank is None else body.rank,
        node=node,
        layer=EXTERNAL_LAYER,
        phase=body.source,
        suspect_ranks=[] if body.rank is None else [body.rank],
        suspect_nodes=[node],
        detail={
            "source": body.source,
            "kind": body.kind,
            "evidence": dict(body.evidence),
            "step_known": body.step is not None,
            "rank_known": body.rank is not None,
        },
        sent_at=body.sent_at,
    )


def add_external_alarm_routes(app: FastAPI, service: Service) -> None:
    @signed_post(
        app,
        service.guard,
        "/v1/external-alarms",
        status_code=202,
        response_model=AlarmAccepted,
        responses=LEDGER_ERRORS,
        summary="Record an alarm from another SDC detector (Megatron, torchtitan, GPU health).",
    )
    async def post_external_alarm(body: ExternalAlarmBody, request: Request) -> AlarmAccepted:
        caller = authorize(request, body.job_id)  # its nonce is claimed with the alarm's batch
        node = body.node
        if node is None:
            assert body.rank is not None  # the model refuses an alarm naming no one
            ranks = await service.threads.read(service.reads.rank_map, body.job_id)
            placed = ranks.get(body.rank)
            if placed is None:
                raise InvalidValue(
                    f"rank {body.rank} is not in job {body.job_id}'s rank map: send the node"
                )
            node = placed.node
        record = external_alarm_record(body, node)
        Ledger.validate_alarm(record)
        nonce = None if caller.nonce is None else (caller.nonce, caller.key_id)
        outcome = await service.batcher.record(record, nonce)
        if isinstance(outcome, NonceReused):
            raise Refused(401, REPLAYED)
        logger.info(
            "external alarm recorded",
            extra={
                "job": body.job_id,
                "incident": outcome.incident_id,
                "node": node,
                "rank": body.rank,
                "step": body.step,
                "source": body.source,
                "kind": body.kind,
                "duplicate": outcome.duplicate,
            },
        )
        return AlarmAccepted(incident_id=outcome.incident_id, duplicate=outcome.duplicate)
