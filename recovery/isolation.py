"""Isolation: keep an approved node out of service, untouched, for investigation.

The ``isolate`` remediation (as AWS PCS and others offer it) replaces nothing: the node stays
cordoned and tainted with our marks, labelled ``sdcguard.io/isolated=<incident>`` and annotated
with why, so a human investigating it finds it exactly as the fault left it — no reboot, no
drain, no deletion. Training is not resumed automatically: the incident is handed to a human
(the flow's hand-over stage). It works on any :class:`recovery.nodes.NodeOps`, so the
Kubernetes and the simulated cluster share it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from recovery.nodes import NodeOps
from recovery.remediation import (
    RemediationKind,
    RemediationOutcome,
    RemediationVerb,
    remedy,
)

__all__ = ["IsolateRemediation"]


class IsolateRemediation:
    """:class:`~recovery.remediation.Remediation` that isolates and hands over to a human."""

    kind = RemediationKind.ISOLATE
    releases_on_resolve = False

    def __init__(self, nodes: NodeOps) -> None:
        self._nodes = nodes

    def describe(self, verb: RemediationVerb) -> str:
        return (
            "nothing is replaced or rebooted: the node stays cordoned and tainted, labelled "
            "`sdcguard.io/isolated` for investigation; training stays stopped and a human "
            "takes the incident over"
        )

    def plan(self, node: str, incident_id: str, verb: RemediationVerb) -> dict[str, Any]:
        # Whatever the verb, isolation only keeps the node out of service; the approval form
        # says so, so nobody approves a reboot expecting one.
        self._nodes.get(node)  # a node that is gone cannot be isolated: NotFoundError now
        return {
            "backend": self.kind.value,
            "verb": verb.value,
            "node": node,
            "incident_id": incident_id,
        }

    def start(self, plan: Mapping[str, Any], *, first: bool) -> None:
        note = (
            f"isolated by incident {plan['incident_id']} for investigation of silent data "
            "corruption; do not return to service before a human has looked"
        )
        self._nodes.isolate(str(plan["node"]), str(plan["incident_id"]), note)

    def wait(
        self, plan: Mapping[str, Any], *, timeout_s: float, taken: Collection[str]
    ) -> dict[str, Any]:
        return remedy(str(plan["node"]), RemediationOutcome.ISOLATED, None)

    def release(self, result: Mapping[str, Any], incident_id: str) -> bool:
        return False  # the isolation is the human's to lift
