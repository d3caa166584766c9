"""The alarm webhook and ledger API (``sdcguard serve``), as a FastAPI app.

One module per job:

* :mod:`~flows.webhook.app` — ``create_app``: the service put together, its lifespan;
* :mod:`~flows.webhook.routes` — the routes, one module per resource (alarms, jobs,
  incidents, health), and :mod:`~flows.webhook.errors` — how refusals are answered;
* :mod:`~flows.webhook.service` — what the routes share, and the threads the ledger runs in;
* :mod:`~flows.webhook.models` — request and response models (strict types, ledger bounds);
* :mod:`~flows.webhook.signed` — the signed route: size limit, signature, JSON, storable text,
  each checked before the next may look at the body; :mod:`~flows.webhook.auth` — who may;
  :mod:`~flows.webhook.nonces` — each request's nonce used once;
* :mod:`~flows.webhook.batcher` — group commit of concurrent alarms into ledger batches;
* :mod:`~flows.webhook.reads` — the read side: its budget, its reader, its cursor;
* :mod:`~flows.webhook.trigger` — what starts the incident flow, and
  :mod:`~flows.webhook.retry` — an operator's retry of a failed or expired incident;
* :mod:`~flows.webhook.metrics` — ``/metrics``; :mod:`~flows.webhook.serve` — running it.
"""

from __future__ import annotations

from flows.webhook.app import alarm_queue_of, create_app, dispatcher_of
from flows.webhook.batcher import DEFAULT_ALARM_BATCH, AlarmQueue
from flows.webhook.models import (
    AlarmAccepted,
    AlarmBody,
    AuditBody,
    AuditRecorded,
    CheckpointBody,
    ErrorBody,
    RankEntry,
    RanksBody,
    RanksRegistered,
    TriggerQueued,
)

__all__ = [
    "DEFAULT_ALARM_BATCH",
    "AlarmAccepted",
    "AlarmBody",
    "AlarmQueue",
    "AuditBody",
    "AuditRecorded",
    "CheckpointBody",
    "ErrorBody",
    "RankEntry",
    "RanksBody",
    "RanksRegistered",
    "TriggerQueued",
    "alarm_queue_of",
    "create_app",
    "dispatcher_of",
]
