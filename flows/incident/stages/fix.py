"""The fix stage: the approved nodes go to the wired remediation, once each.

Which system acts is the wiring's choice (:meth:`flows.incident.wiring.Backends.remediator`:
HyperPod, the cluster's own replacement, NVSentinel, or isolation); this stage only keeps the
rules that hold for every backend:

- **never twice** — each node's remediation is one ledger action (``replace``, ``reboot`` or
  ``isolate``) whose plan is stored with the claim before the first call; a later attempt gets
  ``first=False`` and the same plan, and the backend looks before it asks again. A node
  another remediation of this incident already took as its replacement is never taken again;
- **never an unaccused node** — only the nodes the recorded decision approved are remediated;
  suspects the rerun cleared are uncordoned (our marks only), nothing else is touched;
- the wait is bounded by the policy's ``replacement_timeout_s``.

A node restored in place (rebooted, or remediated by NVSentinel) gets our cordon lifted so the
job can resume on it; a replaced node is gone; an isolated node stays as it is.
:func:`release_remediations` runs once training resumed and removes what a backend left for the
incident (the ``ExternalFault``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from db import ActionStatus, IncidentState, action_key
from flows.incident.policy import IncidentPolicy
from flows.incident.stages._common import Action, Stage, StageOutcome, perform, stage
from flows.incident.stages._incident import advance, approved_nodes, implicated_nodes
from flows.incident.stages.containment import uncordon
from flows.incident.wiring import Backends, current_backends
from recovery.remediation import (
    Remediation,
    RemediationKind,
    RemediationOutcome,
    RemediationVerb,
)

__all__ = ["fix_nodes", "release_remediations"]

log = logging.getLogger(__name__)

_REMEDIATIONS = (Action.REPLACE.value, Action.REBOOT.value, Action.ISOLATE.value)


def _action(remediation: Remediation, verb: RemediationVerb) -> Action:
    if remediation.kind is RemediationKind.ISOLATE:
        return Action.ISOLATE
    return Action.REBOOT if verb is RemediationVerb.REBOOT else Action.REPLACE


def _plan(
    b: Backends,
    remediation: Remediation,
    incident_id: str,
    kind: Action,
    node: str,
    verb: RemediationVerb,
) -> dict[str, Any]:
    """The plan an earlier attempt stored with its claim, or a fresh one read now.

    Kept with the claim, because after a replacement the node is gone and its successor is
    recognised only against what was there before.
    """
    key = action_key(incident_id, kind.value, node)
    prior = next((a for a in b.ledger.actions(incident_id) if a.key == key), None)
    if (
        prior is not None
        and prior.detail
        and (prior.detail.get("backend") or prior.detail.get("instance_id"))
    ):
        return dict(prior.detail)
    return remediation.plan(node, incident_id, verb)


def _taken(b: Backends, incident_id: str) -> set[str]:
    """Nodes and instances this incident's finished replacements already took (never twice)."""
    taken: set[str] = set()
    for a in b.ledger.actions(incident_id):
        if a.kind == Action.REPLACE.value and a.detail:
            taken.update(
                str(a.detail[k]) for k in ("new_node", "new_instance_id") if a.detail.get(k)
            )
    return taken


def _remediate(
    remediation: Remediation,
    plan: dict[str, Any],
    timeout_s: float,
    taken: set[str],
    first: bool,
) -> dict[str, Any]:
    remediation.start(plan, first=first)
    return remediation.wait(plan, timeout_s=timeout_s, taken=taken)


@stage(Stage.REPLACE)
def fix_nodes(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """Hand every approved node to the wired remediation, once; uncordon what the rerun cleared."""
    b = current_backends()
    remediation = b.remediator()
    verb = RemediationVerb(policy.action.value)
    incident = advance(
        b,
        incident_id,
        IncidentState.REPLACING,
        reason=f"{verb.value} approved ({remediation.kind.value} remediation)",
    )
    replaced: list[dict[str, Any]] = []
    rebooted: list[dict[str, Any]] = []
    restored: list[str] = []
    isolated: list[str] = []
    approved = approved_nodes(incident)
    for node in approved:
        kind = _action(remediation, verb)
        plan = _plan(b, remediation, incident_id, kind, node, verb)
        done = perform(
            incident_id,
            kind,
            node,
            functools.partial(
                _remediate,
                remediation,
                plan,
                float(policy.replacement_timeout_s),
                _taken(b, incident_id),
            ),
            detail=plan,
        )
        outcome = RemediationOutcome(done["outcome"])
        if outcome is RemediationOutcome.REPLACED:
            replaced.append(
                {
                    "node": node,
                    "instance_id": done.get("instance_id"),
                    "new_instance_id": done.get("new_instance_id"),
                    "new_node": done["new_node"],
                }
            )
        elif outcome is RemediationOutcome.RESTORED:
            # back in service under its name: lift our cordon so the job can resume on it
            perform(
                incident_id,
                Action.UNCORDON,
                node,
                functools.partial(uncordon, b, incident_id, node),
            )
            if verb is RemediationVerb.REBOOT:
                rebooted.append({"node": node, "instance_id": done.get("instance_id")})
            else:
                restored.append(node)
        else:
            isolated.append(node)
    # Suspects the rerun cleared (a hardware verdict named another node) go back to work:
    # the job resumes on them, and a cordoned node cannot take its pods.
    cleared = [n for n in implicated_nodes(incident) if n not in approved]
    for node in cleared:
        perform(
            incident_id, Action.UNCORDON, node, functools.partial(uncordon, b, incident_id, node)
        )
    parts = [f"{r['node']} → {r['new_node']} ({r['new_instance_id']})" for r in replaced]
    parts += [f"{r['node']} rebooted" for r in rebooted]
    parts += [f"{n} remediated in place" for n in restored]
    parts += [f"{n} isolated for investigation" for n in isolated]
    parts += [f"{n} cleared by the rerun and uncordoned" for n in cleared]
    return {
        "outcome": "; ".join(parts),
        "remediation": remediation.kind.value,
        "replaced": replaced,
        "rebooted": rebooted,
        "restored": restored,
        "isolated": isolated,
        "cleared": cleared,
    }


def _release(
    remediation: Remediation, record: dict[str, Any], incident_id: str, first: bool
) -> dict[str, Any]:
    return {"released": remediation.release(record, incident_id)}


@stage(Stage.CLEAR)
def release_remediations(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """Once training resumed: remove what the remediations left for this incident, once each."""
    b = current_backends()
    remediation = b.remediator()
    released: list[str] = []
    for action in b.ledger.actions(incident_id):
        if action.kind not in _REMEDIATIONS or action.status is not ActionStatus.SUCCEEDED:
            continue
        record = dict(action.detail or {})
        if record.get("backend", RemediationKind.HYPERPOD.value) != remediation.kind.value:
            continue  # done by another backend (settings changed since): not ours to undo
        node = str(record["node"])
        done = perform(
            incident_id,
            Action.CLEAR,
            node,
            functools.partial(_release, remediation, record, incident_id),
        )
        if done.get("released"):
            released.append(node)
    return {
        "outcome": f"released {', '.join(released)}" if released else "nothing to release",
        "released": released,
    }
