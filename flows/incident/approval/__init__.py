"""Approval of a replacement by a human: the form in the Prefect UI, and who answered it.

- :mod:`~flows.incident.approval.form` — the typed ``RunInput`` an approver fills in, the
  evidence beside it, and a decision submitted from outside the UI;
- :mod:`~flows.incident.approval.identity` — the identity gate around the Prefect server's app
  that signs the auth proxy's user into the resume, and its check in the flow.

The runbook step that asks is :mod:`flows.incident.stages.approval`.
"""

__all__: list[str] = []
