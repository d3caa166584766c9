"""The fix stage: replace the faulty node through HyperPod, or reboot it, as the policy says.

A replacement's plan (instance, its logical id where the cluster has one, group, members
before) is stored with the claim before the call, because after the replacement the node is
gone; a repeat looks at the instance's status before asking HyperPod again, and an
``InstanceIdInUse`` on a repeat means "already replacing" — it converges on the one
replacement. The new node is the one HyperPod reports under the old node's logical id, or, on a
cluster without logical ids, the one the accounting rule of :mod:`recovery.aws.hyperpod` proves
ours; never merely "the first new node". The wait — HyperPod bringing the instance up, then
the node joining the cluster — is bounded by the policy's ``replacement_timeout_s``.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from db import IncidentState, action_key
from flows.incident.policy import IncidentPolicy, NodeAction
from flows.incident.stages._common import Action, Stage, StageOutcome, perform, stage
from flows.incident.stages._incident import advance, approved_nodes, implicated_nodes
from flows.incident.stages.containment import uncordon
from flows.incident.wiring import Backends, current_backends
from recovery.aws.hyperpod import INSTANCE_ID_LABEL
from recovery.aws.hyperpod_nodes import AlreadyReplacing, NodeFailureCode, NodeStatus
from recovery.errors import NotFoundError

__all__ = ["fix_nodes"]

log = logging.getLogger(__name__)


def _replacement_plan(b: Backends, incident_id: str, node: str) -> dict[str, Any]:
    """Which instance backs ``node`` and who its group's members are, before any replace.

    Kept with the claim, because after the replacement the node is gone and the new instance
    is recognised only as "a member that was not there before".
    """
    key = action_key(incident_id, Action.REPLACE.value, node)
    prior = next((a for a in b.ledger.actions(incident_id) if a.key == key), None)
    if prior is not None and prior.detail and prior.detail.get("instance_id"):
        return dict(prior.detail)
    info = b.nodes.get(node)
    labels = dict(info.labels)
    if info.instance_id:
        labels.setdefault(INSTANCE_ID_LABEL, info.instance_id)
    instance_id = b.hyperpod.instance_for(node, labels)
    described = b.hyperpod.describe(instance_id)
    group = described.group
    members = sorted(n.instance_id for n in b.hyperpod.list_nodes(group) if n.instance_id)
    return {
        "node": node,
        "instance_id": instance_id,
        "logical_id": described.logical_id,
        "group": group,
        "members_before": members,
    }


def _taken(b: Backends, incident_id: str) -> set[str]:
    """New instances this incident's finished replacements already took (never twice)."""
    return {
        str(a.detail["new_instance_id"])
        for a in b.ledger.actions(incident_id)
        if a.kind == Action.REPLACE.value and a.detail and a.detail.get("new_instance_id")
    }


def _status(b: Backends, instance_id: str) -> str:
    try:
        return b.hyperpod.describe(instance_id).status
    except NotFoundError:
        return NodeStatus.NOT_FOUND.value


def _replace(
    b: Backends, plan: dict[str, Any], timeout_s: float, taken: set[str], first: bool
) -> dict[str, Any]:
    """Replace once, converging after a crash: on a later attempt HyperPod may already be
    replacing the instance while still reporting it ``Running``; its ``InstanceIdInUse`` then
    means "already replacing" — we wait for that replacement instead of failing."""
    node, instance_id, group = plan["node"], plan["instance_id"], plan["group"]
    deadline = time.monotonic() + timeout_s  # one bound: the instance up, and the node joined
    leaving = (NodeStatus.SHUTTING_DOWN.value, NodeStatus.NOT_FOUND.value)
    extra = {"node": node, "instance_id": instance_id}
    if first or _status(b, instance_id) not in leaving:
        try:
            result = b.hyperpod.replace(instance_id)
            in_use = [f for f in result.failed if f.code == NodeFailureCode.INSTANCE_ID_IN_USE]
            if in_use and not first:
                log.warning(
                    "%s: HyperPod says an operation is in progress (%s); an earlier attempt's "
                    "replacement, waiting for it",
                    node,
                    in_use[0].message,
                    extra=extra,
                )
            else:
                result.raise_for_failures()
        except AlreadyReplacing:
            log.warning("%s is already being replaced; waiting for it", node, extra=extra)
    new_instance = b.hyperpod.wait_replaced(
        instance_id,
        group,
        known_ids=frozenset(plan["members_before"]),
        logical_id=plan.get("logical_id"),
        taken=taken,
        timeout_s=timeout_s,
    )
    new_node = b.directory.joined(
        node, new_instance, timeout_s=max(deadline - time.monotonic(), 0.0)
    )
    return {"new_instance_id": new_instance, "new_node": new_node}


def _reboot(b: Backends, node: str, instance_id: str, first: bool) -> dict[str, Any]:
    # A stale claim with the node Running cannot tell "rebooted" from "never asked": reboot
    # again — a second reboot costs minutes, a skipped one leaves a bad node in service.
    if first or _status(b, instance_id) != NodeStatus.PENDING.value:
        b.hyperpod.reboot(instance_id).raise_for_failures()
    b.hyperpod.wait_running(instance_id)
    return {"rebooted": True}


@stage(Stage.REPLACE)
def fix_nodes(incident_id: str, policy: IncidentPolicy) -> StageOutcome:
    """Replace the faulty node through HyperPod (or reboot it), as the policy says."""
    b = current_backends()
    incident = advance(
        b, incident_id, IncidentState.REPLACING, reason=f"{policy.action.value} approved"
    )
    replaced: list[dict[str, Any]] = []
    rebooted: list[dict[str, Any]] = []
    approved = approved_nodes(incident)
    for node in approved:
        plan = _replacement_plan(b, incident_id, node)
        if policy.action is NodeAction.REPLACE:
            done = perform(
                incident_id,
                Action.REPLACE,
                node,
                functools.partial(
                    _replace,
                    b,
                    plan,
                    float(policy.replacement_timeout_s),
                    _taken(b, incident_id),
                ),
                detail=plan,
            )
            replaced.append(
                {
                    "node": node,
                    "instance_id": plan["instance_id"],
                    "new_instance_id": done["new_instance_id"],
                    "new_node": done["new_node"],
                }
            )
        else:
            perform(
                incident_id,
                Action.REBOOT,
                node,
                functools.partial(_reboot, b, node, plan["instance_id"]),
                detail={"node": node, "instance_id": plan["instance_id"]},
            )
            perform(
                incident_id,
                Action.UNCORDON,
                node,
                functools.partial(uncordon, b, incident_id, node),
            )
            rebooted.append({"node": node, "instance_id": plan["instance_id"]})
    # Suspects the rerun cleared (a hardware verdict named another node) go back to work:
    # the job resumes on them, and a cordoned node cannot take its pods.
    cleared = [n for n in implicated_nodes(incident) if n not in approved]
    for node in cleared:
        perform(
            incident_id, Action.UNCORDON, node, functools.partial(uncordon, b, incident_id, node)
        )
    parts = [f"{r['node']} → {r['new_node']} ({r['new_instance_id']})" for r in replaced]
    parts += [f"{r['node']} rebooted" for r in rebooted]
    parts += [f"{n} cleared by the rerun and uncordoned" for n in cleared]
    return {
        "outcome": "; ".join(parts),
        "replaced": replaced,
        "rebooted": rebooted,
        "cleared": cleared,
    }
