"""Moving a ``failed`` or ``expired`` incident forward again: an operator's retry.

A transient error that outlasts the stage retries, or an approver who answered too late, must
never leave nodes cordoned and a job stopped with no way forward. A retry reopens the incident
in the ledger (:meth:`db.Ledger.retry_incident`: back to the live state it ended from) and starts
a new flow run, which continues from the ledger — succeeded stages are skipped, a failed one is
performed again after looking at the outside systems. The same function serves the CLI
(``sdcguard incident retry ID``) and the API (``POST /v1/incidents/{id}/retry``); in the Prefect
UI an operator runs the incident deployment with ``retry: true``.

Invariant: each retry has its own Prefect idempotency key (``incident-<id>-retry-<n>``), so
exactly one run starts per retry, and a second request for the same retry is refused by the
ledger (the incident is live again) rather than starting a second run.
"""

from __future__ import annotations

import logging

from db import IncidentView, Ledger
from db.ledger.incidents import retry_count
from flows.webhook.trigger import IncidentTrigger, PrefectTrigger

__all__ = ["retry_incident"]

log = logging.getLogger(__name__)


def retry_incident(
    ledger: Ledger, trigger: IncidentTrigger, incident_id: str, *, by: str, reason: str
) -> IncidentView:
    """Reopen the incident and start the flow run that continues it; return it reopened.

    Raises the ledger's :class:`db.IllegalTransition` for an incident that is not ``failed``
    or ``expired``, and :class:`flows.webhook.trigger.TriggerError` when no run could be started
    (the incident is then live in the ledger: ``POST /v1/incidents/{id}/trigger`` or a second
    attempt of the same command starts it).
    """
    current = ledger.get_incident(incident_id)
    if not current.state.terminal and retry_count(current) > 0:
        # reopened by an earlier retry whose run may not have started: start that one (the
        # same idempotency key, so never a second run)
        reopened = current
    else:
        reopened = ledger.retry_incident(incident_id, by=by, reason=reason)
    n = retry_count(reopened)
    extra = {"incident": incident_id, "job": reopened.job_id, "retry": n, "by": by}
    log.info("incident reopened as %s; starting its flow", reopened.state.value, extra=extra)
    if isinstance(trigger, PrefectTrigger):
        trigger.fire_retry(incident_id, reopened.job_id, n)
    else:
        trigger.fire(incident_id, reopened.job_id)
    return reopened
