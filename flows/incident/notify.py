"""Telling a human that an incident needs one, through Prefect's own mechanisms.

When an incident needs a person — an approval, a culprit nobody can name, a failure, an
expiry — the flow emits the Prefect event ``sdcguard.incident.needs-human`` (the incident as its
resource, the job related, what is needed and why in the payload). Who is told is configured in
Prefect, not here: with ``SDCGUARD_FLOW_NOTIFICATION_BLOCK`` naming a notification block
(``slack-webhook/oncall``, ``email/sre`` ... created in the UI or with ``prefect block create``),
the automation ``sdcguard-needs-human`` is created by this code — on that event, send the
message through that block — so the deployment ships its paging as code. Without the setting
the event is still in Prefect's event feed, for automations of the operator's own.

Invariant: a notification never changes the incident; failing to create the automation is
logged and does not stop the flow (the event is emitted regardless).
"""

from __future__ import annotations

import logging
from enum import StrEnum

from flows.settings import NotifySettings

__all__ = [
    "AUTOMATION_NAME",
    "NEEDS_HUMAN_EVENT",
    "NeedsHuman",
    "ensure_notification_automation",
    "needs_human",
]

log = logging.getLogger(__name__)

NEEDS_HUMAN_EVENT = "sdcguard.incident.needs-human"
AUTOMATION_NAME = "sdcguard-needs-human"


class NeedsHuman(StrEnum):
    """Why a person is needed."""

    APPROVAL = "approval"
    CULPRIT_UNKNOWN = "culprit-unknown"
    FAILED = "failed"
    EXPIRED = "expired"
    ISOLATED = "isolated"


def ensure_notification_automation(settings: NotifySettings | None = None) -> bool:
    """Create the automation for the configured block if it is not there; True if it exists."""
    s = settings or NotifySettings()
    if not s.notification_block:
        return False
    from prefect.automations import Automation, EventTrigger, Posture, SendNotification
    from prefect.blocks.core import Block

    try:
        Automation.read(name=AUTOMATION_NAME, _sync=True)  # type: ignore[call-overload]
        return True
    except ValueError:
        pass  # not there yet
    block: Block = Block.load(s.notification_block, _sync=True)  # type: ignore[call-arg,assignment]
    block_id = block._block_document_id
    if block_id is None:
        raise ValueError(f"notification block {s.notification_block!r} has no document id")
    Automation(
        name=AUTOMATION_NAME,
        description="sdcguard: an incident needs a human (created by flows/notify.py)",
        trigger=EventTrigger(expect={NEEDS_HUMAN_EVENT}, posture=Posture.Reactive, threshold=1),
        actions=[
            SendNotification(
                block_document_id=block_id,
                subject="sdcguard: incident {{ event.payload.incident_id }} needs a human "
                "({{ event.payload.why }})",
                body="{{ event.payload.message }}",
            )
        ],
    ).create(_sync=True)  # type: ignore[call-arg]
    log.info("automation %s created", AUTOMATION_NAME, extra={"block": s.notification_block})
    return True


def needs_human(incident_id: str, job_id: str, why: NeedsHuman, message: str) -> None:
    """Emit the needs-a-human event (and make sure the configured automation exists)."""
    from prefect.events import emit_event

    extra = {"incident": incident_id, "job": job_id, "why": why.value}
    try:
        ensure_notification_automation()
    except Exception as err:  # paging misconfigured: say so loudly, keep the incident moving
        log.error("could not set up the notification automation: %s", err, extra=extra)
    emit_event(
        event=NEEDS_HUMAN_EVENT,
        resource={
            "prefect.resource.id": f"sdcguard.incident.{incident_id}",
            "prefect.resource.name": incident_id,
        },
        related=[
            {
                "prefect.resource.id": f"sdcguard.job.{job_id}",
                "prefect.resource.role": "job",
                "prefect.resource.name": job_id,
            }
        ],
        payload={
            "incident_id": incident_id,
            "job_id": job_id,
            "why": why.value,
            "message": message,
        },
    )
    log.warning("incident needs a human (%s): %s", why.value, message, extra=extra)
