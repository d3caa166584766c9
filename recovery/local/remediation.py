"""The simulated cluster's counterparts of the Kubernetes remediations, for the demo and tests.

:class:`LocalReplaceRemediation` plays ``kubernetes``: the node is marked ``Replacing`` (its
Node deleted) and a new instance joins under the next free ``node-N``, as an autoscaler's node
would. :class:`LocalFaultRemediation` plays ``nvsentinel``: an external-fault record on the node
(annotation), which the simulated remediator completes at once — the node is restored in place
— and which :meth:`LocalFaultRemediation.release` removes. Both converge after a crash as the
real ones do: a node already ``Replacing`` or gone is not deleted again; a fault already
recorded is not recorded twice. ``isolate`` needs no counterpart: it works on
:class:`recovery.local.nodes.LocalNodeOps` as on any ``NodeOps``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from recovery.errors import NotFoundError
from recovery.local.cluster import LocalCluster, NodeRecord, NodeState, default_instance_id
from recovery.remediation import (
    RemediationKind,
    RemediationOutcome,
    RemediationVerb,
    UnsupportedRemediation,
    remedy,
)

__all__ = ["ANNOTATION_EXTERNAL_FAULT", "LocalFaultRemediation", "LocalReplaceRemediation"]

ANNOTATION_EXTERNAL_FAULT = "sdcguard.io/external-fault"
"""The simulated ExternalFault: its name, on the node it is raised for."""


class LocalReplaceRemediation:
    """``kubernetes`` on the simulated cluster: the node leaves, a new one joins."""

    kind = RemediationKind.KUBERNETES
    releases_on_resolve = False

    def __init__(self, cluster: LocalCluster) -> None:
        self._cluster = cluster

    def describe(self, verb: RemediationVerb) -> str:
        return (
            "the simulated node is drained and deleted; a new simulated node joins in its "
            "place and training resumes on it"
        )

    def plan(self, node: str, incident_id: str, verb: RemediationVerb) -> dict[str, Any]:
        if verb is RemediationVerb.REBOOT:
            raise UnsupportedRemediation(
                "local-cluster", "reboot", f"node/{node}", "the kubernetes remediation replaces"
            )
        info = self._cluster.node(node)
        return {
            "backend": self.kind.value,
            "verb": verb.value,
            "node": node,
            "instance_id": info.instance_id,
            # the instance the autoscaler will bring: fixed now, so a repeat joins the same one
            "new_instance_id": default_instance_id(f"{node}/{incident_id}"),
        }

    def start(self, plan: Mapping[str, Any], *, first: bool) -> None:
        node = str(plan["node"])
        try:
            if self._cluster.node(node).ready:
                self._cluster.set_state(node, NodeState.REPLACING)
        except NotFoundError:
            return  # gone already: an earlier attempt deleted it

    def wait(
        self, plan: Mapping[str, Any], *, timeout_s: float, taken: Collection[str]
    ) -> dict[str, Any]:
        node, instance = str(plan["node"]), str(plan["new_instance_id"])
        new_node = self._cluster.replace_instance(node, instance)
        return remedy(node, RemediationOutcome.REPLACED, new_node, new_instance_id=instance)

    def release(self, result: Mapping[str, Any], incident_id: str) -> bool:
        return False


class LocalFaultRemediation:
    """``nvsentinel`` on the simulated cluster: a fault record, remediated in place at once."""

    kind = RemediationKind.NVSENTINEL
    releases_on_resolve = True

    def __init__(self, cluster: LocalCluster) -> None:
        self._cluster = cluster

    def describe(self, verb: RemediationVerb) -> str:
        return (
            "a simulated ExternalFault is raised for the node and remediated in place; "
            "training resumes on it and the fault is removed when the incident resolves"
        )

    def plan(self, node: str, incident_id: str, verb: RemediationVerb) -> dict[str, Any]:
        self._cluster.node(node)
        return {
            "backend": self.kind.value,
            "verb": verb.value,
            "node": node,
            "fault": f"sdcguard-{incident_id}-{node}",
        }

    def start(self, plan: Mapping[str, Any], *, first: bool) -> None:
        fault = str(plan["fault"])

        def raise_fault(record: NodeRecord) -> None:
            record.annotations.setdefault(ANNOTATION_EXTERNAL_FAULT, fault)

        self._cluster.update(str(plan["node"]), raise_fault, verb="external-fault")

    def wait(
        self, plan: Mapping[str, Any], *, timeout_s: float, taken: Collection[str]
    ) -> dict[str, Any]:
        node = str(plan["node"])
        return remedy(node, RemediationOutcome.RESTORED, node, fault=str(plan["fault"]))

    def release(self, result: Mapping[str, Any], incident_id: str) -> bool:
        fault = str(result["fault"])

        def clear(record: NodeRecord) -> bool:
            if record.annotations.get(ANNOTATION_EXTERNAL_FAULT) != fault:
                return False  # not ours (or cleared already): left as it is
            del record.annotations[ANNOTATION_EXTERNAL_FAULT]
            return True

        return self._cluster.update(str(result["node"]), clear, verb="clear-fault")
