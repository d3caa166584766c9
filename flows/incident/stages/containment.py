"""Containment: the storm guard, then stop the job and cordon the suspects; release undoes it.

Triage decides how far containment goes (no cordon during an alarm storm unless the policy
says so). Every cordon, taint and uncordon is its own ledger action, and each one looks at the
node before acting again, so a re-run never cordons twice nor lifts anyone else's cordon.
"""

from __future__ import annotations

import functools
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from db import IncidentState, IncidentView
from flows.incident.policy import IncidentPolicy, StormCheck, storm_guard
from flows.incident.stages._common import Action, Stage, StageOutcome, log_extra, perform, stage
from flows.incident.stages._incident import advance, alarm_suspects, implicated_nodes, with_evidence
from flows.incident.wiring import Backends, current_backends
from recovery.errors import NotFoundError
from recovery.nodes import ANNOTATION_CORDONED_BY, TAINT_KEY

__all__ = [
    "cordon_suspects",
    "evaluate_storm",
    "recheck_storm",
    "release_nodes",
    "stop_training",
    "triage",
    "uncordon",
]

log = logging.getLogger(__name__)


def evaluate_storm(b: Backends, incident: IncidentView, policy: IncidentPolicy) -> StormCheck:
    """The storm guard over the alarms the ledger holds now, this incident's and recent ones."""
    now = datetime.now(UTC)
    since = now - timedelta(seconds=policy.storm_window_s)
    recent = [
        (node, alarm.received_at)
        for other in b.ledger.list_incidents()
        if other.updated_at >= since
        for alarm in other.alarms
        for node in alarm_suspects(alarm)
    ]
    return storm_guard(
        implicated=implicated_nodes(incident),
        job_nodes={r.node for r in b.ledger.rank_map(incident.job_id).values()},
        recent=recent,
        now=now,
        policy=policy,
    )


def recheck_storm(b: Backends, incident_id: str, policy: IncidentPolicy) -> bool:
    """Run the storm guard again with the alarms known now; return whether it trips.

    A storm is sticky: once recorded (at triage or by an earlier recheck) it stays, so a re-run
    reaches the same verdict. A newly tripped storm is recorded with its reason and evidence.
    """
    incident = b.ledger.get_incident(incident_id)
    if incident.storm:
        return True
    check = evaluate_storm(b, incident, policy)
    if check.tripped:
        log.warning("%s (re-evaluated)", check.reason, extra=log_extra(incident_id, "storm"))
        b.ledger.transition(
            incident_id,
            incident.state,
            storm=True,
            reason=check.reason,
            evidence=with_evidence(incident, storm=check.to_dict()),
        )
    return check.tripped


@stage(Stage.TRIAGE)
def triage(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """Storm guard: alarms on too many nodes at once look like software, not one bad GPU.

    The verdict is re-evaluated as alarms arrive (:func:`recheck_storm`, before an automatic
    approval and again before the destructive stages)."""
    b = current_backends()
    incident = b.ledger.get_incident(incident_id)
    check = evaluate_storm(b, incident, policy)
    evidence = with_evidence(incident, storm=check.to_dict())
    if check.tripped:
        log.warning("%s", check.reason, extra=log_extra(incident_id, Stage.TRIAGE))
        b.ledger.transition(
            incident_id, incident.state, storm=True, reason=check.reason, evidence=evidence
        )
    else:
        b.ledger.transition(incident_id, incident.state, evidence=evidence)
    return {"outcome": check.reason, "storm": check.tripped}


@stage(Stage.STOP)
def stop_training(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """Stop the job, and with it checkpoint publication; quarantine what it wrote since the
    suspect range began (and anything still arriving later is quarantined again before resume)."""
    b = current_backends()
    incident = advance(b, incident_id, IncidentState.STOPPING, reason="stopping training")
    job = b.catalog.ref(incident.job_id)

    def act(first: bool) -> dict[str, Any]:
        try:
            result = b.jobs.stop(job)
        except NotFoundError as err:
            # Nothing runs under that name here: the goal — no more training writes — holds.
            return {"stop": "not-found", "detail": str(err)}
        return {"stop": result.outcome.value, "detail": result.detail}

    stopped = perform(incident_id, Action.STOP_JOB, incident.job_id, act)
    quarantined = b.ledger.quarantine_range(incident.job_id, incident.suspect_start, None)
    return {
        "outcome": f"job {incident.job_id}: {stopped['stop']}; checkpoints from step "
        f"{incident.suspect_start} on quarantined: {quarantined or 'none new'}",
        "quarantined": quarantined,
    }


def _cordon(b: Backends, incident_id: str, node: str, first: bool) -> dict[str, Any]:
    if not first and b.nodes.get(node).annotations.get(ANNOTATION_CORDONED_BY) == incident_id:
        return {"cordoned": True, "observed": True}
    return {"cordoned": b.nodes.cordon(node, incident_id)}


def _taint(b: Backends, incident_id: str, node: str, first: bool) -> dict[str, Any]:
    if not first and any(
        t.key == TAINT_KEY and t.value == incident_id for t in b.nodes.get(node).taints
    ):
        return {"tainted": True, "observed": True}
    return {"tainted": b.nodes.taint(node, incident_id)}


@stage(Stage.CORDON)
def cordon_suspects(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """Cordon and taint the suspect nodes, so nothing new lands on them while we diagnose."""
    b = current_backends()
    incident = b.ledger.get_incident(incident_id)
    nodes = implicated_nodes(incident)
    if not nodes:
        reason = (
            "culprit unknown: no alarm names a suspect node, so nothing is cordoned; "
            "a human decides from the evidence"
        )
        log.warning("%s", reason, extra=log_extra(incident_id, Stage.CORDON))
        b.ledger.transition(
            incident_id,
            incident.state,
            evidence=with_evidence(incident, culprit_unknown=True),
        )
        return {"outcome": reason, "cordoned": [], "culprit_unknown": True}
    if incident.storm and not policy.cordon_in_storm:
        return {
            "outcome": f"not cordoned during an alarm storm: {', '.join(nodes)} stay schedulable",
            "cordoned": [],
        }
    outcomes = {}
    for node in nodes:
        cordon = perform(
            incident_id, Action.CORDON, node, functools.partial(_cordon, b, incident_id, node)
        )
        perform(incident_id, Action.TAINT, node, functools.partial(_taint, b, incident_id, node))
        outcomes[node] = "cordoned" if cordon.get("cordoned") else "was already cordoned"
    advance(b, incident_id, IncidentState.CORDONED, reason=f"cordoned {', '.join(nodes)}")
    return {
        "outcome": "; ".join(f"{n} {o}" for n, o in outcomes.items()),
        "cordoned": nodes,
    }


def uncordon(b: Backends, incident_id: str, node: str, first: bool) -> dict[str, Any]:
    """The uncordon side effect (fix and release): undoes this incident's cordon only."""
    return {"uncordoned": b.nodes.uncordon(node, incident_id)}


@stage(Stage.RELEASE)
def release_nodes(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """On reject, when the approver asks: undo our cordon and taint (never anyone else's)."""
    b = current_backends()
    incident = b.ledger.get_incident(incident_id)
    results = {}
    for node in implicated_nodes(incident):
        try:
            done = perform(
                incident_id,
                Action.UNCORDON,
                node,
                functools.partial(uncordon, b, incident_id, node),
            )
            results[node] = "uncordoned" if done.get("uncordoned") else "left as it was"
        except NotFoundError:
            results[node] = "gone"
    return {
        "outcome": "; ".join(f"{n} {r}" for n, r in results.items()),
        "uncordoned": sorted(n for n, r in results.items() if r == "uncordoned"),
    }
