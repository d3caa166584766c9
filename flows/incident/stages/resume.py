"""Resume: quarantine the suspect checkpoints, choose an intact one, restart the job from it.

The invariant: training resumes only from a ``verified`` checkpoint strictly before the suspect
range whose bytes in storage still match its sha256; any newer one that does not is marked
corrupt on the way.
"""

from __future__ import annotations

import logging
from typing import Any

from db import ActionStatus, CheckpointStatus, CheckpointView, IncidentState, IncidentView
from flows.incident.policy import IncidentPolicy
from flows.incident.stages._common import Action, Stage, StageOutcome, perform, stage
from flows.incident.stages._incident import advance
from flows.incident.wiring import Backends, current_backends
from recovery.errors import NotFoundError, PermanentError

__all__ = ["choose_checkpoint", "quarantine_suspect_checkpoints", "resume_training"]

log = logging.getLogger(__name__)


def choose_checkpoint(
    backends: Backends, incident: IncidentView
) -> tuple[CheckpointView | None, list[dict[str, Any]]]:
    """The newest verified checkpoint strictly before the suspect range whose bytes in storage
    still match its sha256; every newer one that does not is marked corrupt on the way."""
    corrupt: list[dict[str, Any]] = []
    for candidate in backends.ledger.resume_candidates(incident.job_id, incident.suspect_start):
        try:
            intact = backends.checkpoints.verify(candidate.uri, candidate.sha256)
            why = "sha256 in storage does not match the ledger"
        except NotFoundError as err:
            intact, why = False, f"missing in storage ({err})"
        if intact:
            return candidate, corrupt
        reason = f"{why}; found by incident {incident.id}"
        backends.ledger.mark_checkpoint_corrupt(
            incident.job_id, candidate.step, reason, uri=candidate.uri
        )
        log.warning(
            "checkpoint at step %d is corrupt: %s",
            candidate.step,
            why,
            extra={"incident": incident.id, "job": incident.job_id, "step": candidate.step},
        )
        corrupt.append({"step": candidate.step, "uri": candidate.uri, "reason": why})
    return None, corrupt


@stage(Stage.QUARANTINE)
def quarantine_suspect_checkpoints(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """Quarantine every checkpoint from the suspect range on, including any recorded late."""
    b = current_backends()
    incident = b.ledger.get_incident(incident_id)
    b.ledger.quarantine_range(incident.job_id, incident.suspect_start, None)
    held = [
        c.step
        for c in b.ledger.list_checkpoints(incident.job_id)
        if c.status is CheckpointStatus.QUARANTINED and c.step >= incident.suspect_start
    ]
    return {
        "outcome": f"quarantined steps {held or 'none'} (from step {incident.suspect_start} on)",
        "quarantined": held,
    }


def _resume_nodes(b: Backends, incident: IncidentView) -> list[str] | None:
    """One node per rank, the replaced nodes swapped for their replacements."""
    ranks = b.ledger.rank_map(incident.job_id)
    if not ranks:
        return None
    swap: dict[str, str] = {}
    for action in incident.actions:
        if action.kind == Action.REPLACE.value and action.status is ActionStatus.SUCCEEDED:
            detail = action.detail or {}
            swap[str(detail["node"])] = str(detail["new_node"])
    return [swap.get(ranks[r].node, ranks[r].node) for r in sorted(ranks)]


@stage(Stage.RESUME)
def resume_training(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """Resume from the newest verified checkpoint strictly before the suspect range.

    Never a pending, quarantined or corrupt one: only ``verified`` rows are candidates, and
    each is re-read from storage against its sha256 first. The resumed job checks the weight
    fingerprint after load against the one recorded with the checkpoint.
    """
    b = current_backends()
    incident = advance(
        b, incident_id, IncidentState.RESUMING, reason="resuming from a verified checkpoint"
    )
    checkpoint, corrupt = choose_checkpoint(b, incident)
    if checkpoint is None:
        raise PermanentError(
            "checkpoints",
            "choose",
            f"job/{incident.job_id}",
            f"no verified checkpoint before step {incident.suspect_start} is intact in storage",
        )
    nodes = _resume_nodes(b, b.ledger.get_incident(incident_id))
    job = b.catalog.ref(incident.job_id)

    def act(first: bool) -> dict[str, Any]:
        result = b.jobs.resume(job, checkpoint.uri, checkpoint.step, nodes)
        return {"resume": result.outcome.value, "pid": result.pid}

    done = perform(
        incident_id,
        Action.RESUME,
        incident.job_id,
        act,
        detail={
            "checkpoint_uri": checkpoint.uri,
            "checkpoint_step": checkpoint.step,
            "fingerprint": checkpoint.fingerprint,
            "nodes": nodes,
        },
    )
    step = int(done.get("checkpoint_step", checkpoint.step))
    return {
        "outcome": f"{done.get('resume')} from the checkpoint at step {step}"
        + (f" on {', '.join(nodes)}" if nodes else "")
        + f": steps {step + 1}..{incident.suspect_end} are recomputed",
        "checkpoint_step": step,
        "checkpoint_uri": done.get("checkpoint_uri", checkpoint.uri),
        "fingerprint": done.get("fingerprint", checkpoint.fingerprint),
        "nodes": done.get("nodes", nodes),
        "corrupt": corrupt,
    }
