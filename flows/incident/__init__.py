"""The incident: the runbook as a Prefect flow, and everything it decides with.

- :mod:`~flows.incident.flow` — ``incident_response``, the SDC runbook top to bottom (the
  deployments' entrypoint), and ``respond`` (the same flow called in-process);
- :mod:`~flows.incident.stages` — its Prefect tasks, one module per runbook step;
- :mod:`~flows.incident.policy` — what the flow may do on its own; the storm guard;
- :mod:`~flows.incident.approval` — the approval form and who answered it;
- :mod:`~flows.incident.coordination` — the global concurrency limit around destructive stages;
- :mod:`~flows.incident.notify`, :mod:`~flows.incident.expiry` — a human paged; approvals
  nobody answered closed;
- :mod:`~flows.incident.report` — the incident report, from the ledger alone;
- :mod:`~flows.incident.wiring` — the backends the flow acts through, chosen once.

Nothing is re-exported here: the webhook imports :mod:`~flows.incident.expiry` without loading
the flow and its backends.
"""

__all__: list[str] = []
