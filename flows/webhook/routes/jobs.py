"""``POST /v1/jobs/{job_id}/…``: what a training job reports besides alarms — its ranks, its
checkpoints, its audits."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import FastAPI, Path, Request

from db import RankIn
from flows.webhook.models import (
    LEDGER_ERRORS,
    AuditBody,
    AuditRecorded,
    CheckpointBody,
    JobId,
    RanksBody,
    RanksRegistered,
)
from flows.webhook.service import Service, signed_post
from flows.webhook.signed import admit

__all__ = ["add_job_routes"]

logger = logging.getLogger(__name__)


def add_job_routes(app: FastAPI, service: Service) -> None:
    @signed_post(
        app,
        service.guard,
        "/v1/jobs/{job_id}/ranks",
        response_model=RanksRegistered,
        responses=LEDGER_ERRORS,
        summary="Register (or move) the ranks of a job; creates the job.",
    )
    async def post_ranks(
        job_id: Annotated[JobId, Path()], body: RanksBody, request: Request
    ) -> RanksRegistered:
        await admit(request, job_id, service.nonces)
        ranks = [
            RankIn(
                rank=r.rank,
                local_rank=r.local_rank,
                node=r.node,
                instance_id=r.instance_id,
                gpu_uuid=r.gpu_uuid,
            )
            for r in body.ranks
        ]

        def register() -> None:
            service.ledger.ensure_job(job_id)
            service.ledger.register_ranks(job_id, ranks, generation=body.generation)

        await service.threads.write(register)
        logger.info("registered %d ranks", len(ranks), extra={"job": job_id})
        return RanksRegistered(job_id=job_id, registered=len(ranks))

    @signed_post(
        app,
        service.guard,
        "/v1/jobs/{job_id}/checkpoints",
        status_code=201,
        responses=LEDGER_ERRORS,
        summary="Record a checkpoint as pending; a later passed audit verifies it.",
    )
    async def post_checkpoint(
        job_id: Annotated[JobId, Path()], body: CheckpointBody, request: Request
    ) -> dict[str, Any]:
        await admit(request, job_id, service.nonces, checkpoint_uri=body.uri)

        def record() -> dict[str, Any]:
            view = service.ledger.record_checkpoint(
                job_id, body.step, body.uri, body.sha256, body.fingerprint, list(body.nodes)
            )
            if body.status == "quarantined":
                service.ledger.quarantine_range(job_id, body.step, body.step)
                view = next(
                    v
                    for v in service.ledger.list_checkpoints(job_id)
                    if v.step == body.step and v.uri == body.uri and v.sha256 == body.sha256
                )
            return view.to_dict()

        return await service.threads.write(record)

    @signed_post(
        app,
        service.guard,
        "/v1/jobs/{job_id}/audits",
        response_model=AuditRecorded,
        responses=LEDGER_ERRORS,
        summary="Record an audit; a passed one verifies earlier pending checkpoints.",
    )
    async def post_audit(
        job_id: Annotated[JobId, Path()], body: AuditBody, request: Request
    ) -> AuditRecorded:
        await admit(request, job_id, service.nonces)
        verified = await service.threads.write(
            service.ledger.record_audit, job_id, body.step, body.kind, list(body.ranks), body.passed
        )
        return AuditRecorded(job_id=job_id, step=body.step, verified_steps=list(verified))
