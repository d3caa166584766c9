"""HyperPod remediation: replace the instance through ``BatchReplaceClusterNodes`` (or reboot
it through ``BatchRebootClusterNodes``), as :class:`recovery.remediation.Remediation`.

A replacement's plan (instance, its logical id where the cluster has one, group, members
before) is read before the call, because after the replacement the node is gone; a repeat
looks at the instance's status before asking HyperPod again, and an ``InstanceIdInUse`` on a
repeat means "already replacing" — it converges on the one replacement. The new node is the
one HyperPod reports under the old node's logical id, or, on a cluster without logical ids,
the one the accounting rule of :mod:`recovery.aws.hyperpod` proves ours; never merely "the
first new node". The wait — HyperPod bringing the instance up, then the node joining the
cluster — is one bound, the caller's ``timeout_s``.

This is the only replacement channel used: the node-health label (``NodeOps.mark_for_…``)
starts the same HyperPod process and is never set alongside.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from typing import Any

from recovery.aws.hyperpod import INSTANCE_ID_LABEL, HyperPod
from recovery.aws.hyperpod_nodes import AlreadyReplacing, NodeFailureCode, NodeStatus
from recovery.errors import NotFoundError
from recovery.nodes import NodeDirectory, NodeOps
from recovery.remediation import (
    RemediationKind,
    RemediationOutcome,
    RemediationVerb,
    remedy,
)

__all__ = ["HyperPodRemediation"]

log = logging.getLogger(__name__)


class HyperPodRemediation:
    """:class:`~recovery.remediation.Remediation` through SageMaker HyperPod."""

    kind = RemediationKind.HYPERPOD
    releases_on_resolve = False

    def __init__(self, hyperpod: HyperPod, nodes: NodeOps, directory: NodeDirectory) -> None:
        self._hyperpod = hyperpod
        self._nodes = nodes
        self._directory = directory

    def describe(self, verb: RemediationVerb) -> str:
        if verb is RemediationVerb.REBOOT:
            return (
                "SageMaker HyperPod reboots the instance in place (BatchRebootClusterNodes); "
                "our cordon is lifted and training resumes on the same nodes"
            )
        return (
            "SageMaker HyperPod replaces the instance (BatchReplaceClusterNodes); training "
            "resumes on the new node set"
        )

    def plan(self, node: str, incident_id: str, verb: RemediationVerb) -> dict[str, Any]:
        """Which instance backs ``node`` and who its group's members are, before any call."""
        info = self._nodes.get(node)
        labels = dict(info.labels)
        if info.instance_id:
            labels.setdefault(INSTANCE_ID_LABEL, info.instance_id)
        instance_id = self._hyperpod.instance_for(node, labels)
        described = self._hyperpod.describe(instance_id)
        group = described.group
        members = sorted(n.instance_id for n in self._hyperpod.list_nodes(group) if n.instance_id)
        return {
            "backend": self.kind.value,
            "verb": verb.value,
            "node": node,
            "instance_id": instance_id,
            "logical_id": described.logical_id,
            "group": group,
            "members_before": members,
        }

    def start(self, plan: Mapping[str, Any], *, first: bool) -> None:
        if plan.get("verb") == RemediationVerb.REBOOT.value:
            self._start_reboot(plan, first)
        else:
            self._start_replace(plan, first)

    def wait(
        self, plan: Mapping[str, Any], *, timeout_s: float, taken: Collection[str]
    ) -> dict[str, Any]:
        node, instance_id = str(plan["node"]), str(plan["instance_id"])
        if plan.get("verb") == RemediationVerb.REBOOT.value:
            self._hyperpod.wait_running(instance_id)
            return remedy(
                node, RemediationOutcome.RESTORED, node, instance_id=instance_id, rebooted=True
            )
        deadline = time.monotonic() + timeout_s  # one bound: the instance up, the node joined
        new_instance = self._hyperpod.wait_replaced(
            instance_id,
            str(plan["group"]),
            known_ids=frozenset(plan["members_before"]),
            logical_id=plan.get("logical_id"),
            taken=set(taken),
            timeout_s=timeout_s,
        )
        new_node = self._directory.joined(
            node, new_instance, timeout_s=max(deadline - time.monotonic(), 0.0)
        )
        return remedy(
            node,
            RemediationOutcome.REPLACED,
            new_node,
            instance_id=instance_id,
            new_instance_id=new_instance,
        )

    def release(self, result: Mapping[str, Any], incident_id: str) -> bool:
        return False  # HyperPod leaves nothing of ours behind

    # -- internals ---------------------------------------------------------------------

    def _status(self, instance_id: str) -> str:
        try:
            return self._hyperpod.describe(instance_id).status
        except NotFoundError:
            return NodeStatus.NOT_FOUND.value

    def _start_replace(self, plan: Mapping[str, Any], first: bool) -> None:
        """Replace once, converging after a crash: on a later attempt HyperPod may already be
        replacing the instance while still reporting it ``Running``; its ``InstanceIdInUse``
        then means "already replacing" — we wait for that replacement instead of failing."""
        node, instance_id = plan["node"], str(plan["instance_id"])
        leaving = (NodeStatus.SHUTTING_DOWN.value, NodeStatus.NOT_FOUND.value)
        extra = {"node": node, "instance_id": instance_id}
        if not first and self._status(instance_id) in leaving:
            return
        try:
            result = self._hyperpod.replace(instance_id)
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

    def _start_reboot(self, plan: Mapping[str, Any], first: bool) -> None:
        # A stale claim with the node Running cannot tell "rebooted" from "never asked": reboot
        # again — a second reboot costs minutes, a skipped one leaves a bad node in service.
        instance_id = str(plan["instance_id"])
        if first or self._status(instance_id) != NodeStatus.PENDING.value:
            self._hyperpod.reboot(instance_id).raise_for_failures()
