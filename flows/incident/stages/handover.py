"""The hand-over: an isolated node's incident goes to a human instead of resuming training.

With the ``isolate`` remediation nothing is replaced, so the flow cannot know which nodes the
job should run on; resuming on a shrunken or guessed node set is a human's decision. This
stage records what the human needs — the isolated nodes and the checkpoint a resume would
take (the newest verified one before the suspect range, intact in storage) — and pages them.
The incident then ends ``resolved``: sdcguard's automation is finished, the node is out of
service, the suspect checkpoints are quarantined. A terminal state matters: a later alarm of
the job (after the human resumed it) opens a new incident instead of joining this one, and
checkpoints recorded after the resolution can be verified again. The ``reason`` and the
``hand_over`` evidence say that training was *not* resumed.
"""

from __future__ import annotations

from db import ActionStatus
from flows.incident.notify import NeedsHuman, needs_human
from flows.incident.policy import IncidentPolicy
from flows.incident.stages._common import Action, Stage, StageOutcome, stage
from flows.incident.stages._incident import with_evidence
from flows.incident.stages.resume import choose_checkpoint
from flows.incident.wiring import current_backends

__all__ = ["HAND_OVER_EVIDENCE", "hand_over"]

HAND_OVER_EVIDENCE = "hand_over"


@stage(Stage.HAND_OVER)
def hand_over(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """Record the isolated nodes and the checkpoint to resume from, and page a human."""
    b = current_backends()
    incident = b.ledger.get_incident(incident_id)
    isolated = sorted(
        a.target
        for a in incident.actions
        if a.kind == Action.ISOLATE.value and a.status is ActionStatus.SUCCEEDED
    )
    checkpoint, corrupt = choose_checkpoint(b, incident)
    resume = (
        f"resume from the verified checkpoint at step {checkpoint.step} ({checkpoint.uri})"
        if checkpoint is not None
        else f"no verified checkpoint before step {incident.suspect_start} is intact"
    )
    message = (
        f"{', '.join(isolated) or 'no node'} isolated for investigation (cordoned, tainted, "
        f"labelled sdcguard.io/isolated); training stays stopped — {resume} on healthy nodes"
    )
    record = {
        "isolated": isolated,
        "resume_from_step": checkpoint.step if checkpoint is not None else None,
        "resume_from_uri": checkpoint.uri if checkpoint is not None else None,
        "corrupt": corrupt,
    }
    b.ledger.transition(
        incident_id,
        incident.state,
        reason=message,
        evidence=with_evidence(incident, **{HAND_OVER_EVIDENCE: record}),
    )
    needs_human(incident_id, incident.job_id, NeedsHuman.ISOLATED, message)
    return {"outcome": message, **record}
