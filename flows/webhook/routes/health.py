"""``GET /healthz`` (the ledger answers; incidents whose flow is not started yet) and
``GET /metrics``."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Response

from flows.webhook.metrics import install_metrics, ledger_ping
from flows.webhook.service import Service

__all__ = ["add_health_routes"]

logger = logging.getLogger(__name__)


def add_health_routes(app: FastAPI, service: Service) -> None:
    install_metrics(app, service.ledger, service.dispatcher.backlog)

    @app.get("/healthz", summary="The ledger answers; and incidents whose flow is not started yet.")
    async def healthz(response: Response) -> dict[str, Any]:
        backlog = service.dispatcher.backlog()
        try:
            await service.threads.write(ledger_ping, service.ledger)
        except Exception as err:  # any failure to reach the ledger means "not healthy"
            response.status_code = 503
            logger.error(
                "healthz: ledger unreachable: %s", err, extra={"error": type(err).__name__}
            )
            return {"status": "ledger-unavailable", "error": type(err).__name__}
        return {
            "status": "ok",
            "trigger_backlog": [
                {"incident_id": p.incident_id, "attempts": p.attempts, "last_error": p.last_error}
                for p in backlog
            ],
        }
