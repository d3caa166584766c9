"""How every stage reads and moves the incident, the same way, so a re-run finds it where an
earlier run left it: who is implicated, what is to be fixed, what was approved, the state."""

from __future__ import annotations

from typing import Any

from db import AlarmView, IncidentState, IncidentView, Verdict, can_transition
from db.evidence import APPROVAL
from flows.incident.wiring import Backends, current_backends

__all__ = [
    "advance",
    "alarm_suspects",
    "approved_nodes",
    "close",
    "culprit_unknown",
    "implicated_nodes",
    "nodes_to_fix",
    "verdict_of",
    "with_evidence",
]


def advance(backends: Backends, incident_id: str, to: IncidentState, **fields: Any) -> IncidentView:
    """Move forward to ``to`` — or stay where a re-run finds the incident already is."""
    current = backends.ledger.get_incident(incident_id)
    target = to if can_transition(current.state, to) else current.state
    given = {k: v for k, v in fields.items() if v is not None}
    if target == current.state and not {k: v for k, v in given.items() if k != "reason"}:
        return current
    return backends.ledger.transition(incident_id, target, **given)


def with_evidence(incident: IncidentView, **items: Any) -> dict[str, Any]:
    return {**(incident.evidence or {}), **items}


def implicated_nodes(incident: IncidentView) -> list[str]:
    """Every node the incident's alarms name as a suspect — never the reporting rank's node.

    An alarm that names no suspect (two replicas that differ cannot say which one is wrong)
    implicates nobody: the ledger records the reporter's node on the incident for context,
    but the reporter is by construction a non-suspect, and cordoning it would take a healthy
    node out. Only an incident opened by hand (no alarms) is taken at its word.
    """
    if not incident.alarms:
        return sorted(set(incident.suspect_nodes))
    names: set[str] = set()
    for alarm in incident.alarms:
        names.update(alarm_suspects(alarm))
    return sorted(names)


def alarm_suspects(alarm: AlarmView) -> list[str]:
    """The nodes an alarm accuses that belong to its job: a node outside the job's rank map is
    evidence for a human (``outside_rank_map``), never a target of automation or of the storm
    guard's count (a forged or confused alarm must not trip it either)."""
    outside = set(alarm.outside_rank_map)
    return [node for node in alarm.suspect_nodes if node not in outside]


def culprit_unknown(incident: IncidentView) -> bool:
    """No alarm names a suspect: nothing is cordoned automatically; a human decides."""
    return not implicated_nodes(incident)


def verdict_of(incident: IncidentView) -> dict[str, Any]:
    return dict((incident.evidence or {}).get("verdict") or {})


def nodes_to_fix(incident: IncidentView) -> list[str]:
    """The node a hardware verdict names; otherwise every suspect (a human approved that)."""
    verdict = verdict_of(incident)
    if verdict.get("verdict") == Verdict.HARDWARE.value and verdict.get("node"):
        return [str(verdict["node"])]
    return implicated_nodes(incident)


def approved_nodes(incident: IncidentView) -> list[str]:
    """Exactly the nodes the recorded decision approved for the fix — never recomputed.

    A decision recorded before approvals named their nodes falls back to :func:`nodes_to_fix`.
    """
    approval = (incident.evidence or {}).get(APPROVAL) or {}
    if "nodes" in approval:
        return [str(n) for n in approval["nodes"] or []]
    return nodes_to_fix(incident)


def close(incident_id: str, to: IncidentState, reason: str) -> IncidentView:
    """End the incident in a terminal state (a no-op when a re-run finds it there already)."""
    b = current_backends()
    current = b.ledger.get_incident(incident_id)
    if current.state == to:
        return current
    return b.ledger.transition(incident_id, to, reason=reason)
