"""Node operations: cordon, taint, uncordon, HyperPod health labels, pod eviction.

Ownership is the invariant of this module: sdcguard only undoes what sdcguard did. A cordon we
place is recorded on the node itself (annotation ``sdcguard.io/cordoned-by=<incident>``, label
``sdcguard.io/incident=<incident>``, plus the reason and time), so :meth:`NodeOps.uncordon` can
tell our cordon from an operator's or another controller's — a node somebody else cordoned stays
cordoned whatever our incident decides. The record lives on the node (not only in the ledger)
so that a human running ``kubectl describe node`` sees who cordoned it and why.

Both backends share the decisions: each operation is planned once, as a pure function of the
node's current state (:class:`NodeChange`), and then applied by
:class:`~recovery.kube.nodes.KubeNodeOps` as a conditional patch (``metadata.resourceVersion``
precondition; a 409 re-reads and re-plans) or by :class:`~recovery.local.nodes.LocalNodeOps` under
the local cluster's file lock. The two backends therefore cannot drift apart in semantics.

HyperPod (EKS) node recovery: labelling a node ``sagemaker.amazonaws.com/node-health-status`` with
``UnschedulablePendingReplacement`` or ``UnschedulablePendingReboot`` asks HyperPod to replace or
reboot it. Label names and values are those of the AWS documentation
https://docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-hyperpod-eks-resiliency-node-labels.html
and the manual-recovery page
https://docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-hyperpod-eks-resiliency-manual.html
states that the label and the ``BatchReplaceClusterNodes`` / ``BatchRebootClusterNodes`` APIs
activate the same recovery process.
"""

from __future__ import annotations

import abc
import logging
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "ANNOTATION_CORDONED_AT",
    "ANNOTATION_CORDONED_BY",
    "ANNOTATION_CORDON_REASON",
    "ANNOTATION_HEALTH_REQUESTED_BY",
    "ANNOTATION_ISOLATION_NOTE",
    "DEFAULT_CORDON_REASON",
    "HEALTH_LABEL",
    "HYPERPOD_NODE_PREFIX",
    "LABEL_INCIDENT",
    "LABEL_ISOLATED",
    "TAINT_EFFECT",
    "TAINT_KEY",
    "BlockedPod",
    "EvictionResult",
    "NodeChange",
    "NodeDirectory",
    "NodeHealth",
    "NodeInfo",
    "NodeOps",
    "PlannedNodeOps",
    "Taint",
]

log = logging.getLogger(__name__)

ANNOTATION_CORDONED_BY = "sdcguard.io/cordoned-by"
"""Names the incident whose cordon this is; absent when somebody else cordoned the node."""
ANNOTATION_CORDON_REASON = "sdcguard.io/cordon-reason"
ANNOTATION_CORDONED_AT = "sdcguard.io/cordoned-at"
ANNOTATION_HEALTH_REQUESTED_BY = "sdcguard.io/node-health-requested-by"
LABEL_INCIDENT = "sdcguard.io/incident"
LABEL_ISOLATED = "sdcguard.io/isolated"
"""Names the incident that keeps the node out of service for investigation (``isolate``)."""
ANNOTATION_ISOLATION_NOTE = "sdcguard.io/isolation-note"
TAINT_KEY = "sdcguard.io/suspect"
TAINT_EFFECT = "NoSchedule"
HEALTH_LABEL = "sagemaker.amazonaws.com/node-health-status"
HYPERPOD_NODE_PREFIX = "hyperpod-"
"""HyperPod names each EKS node ``hyperpod-<instance id>``."""

DEFAULT_CORDON_REASON = "suspected silent data corruption"

# A label value: at most 63 characters, alphanumeric at both ends, [-_.] inside.
_LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")
_HYPERPOD_NODE_NAME = re.compile(r"^hyperpod-(i-[0-9a-f]+)$")


class NodeHealth(StrEnum):
    """Values of HyperPod's ``sagemaker.amazonaws.com/node-health-status`` node label."""

    SCHEDULABLE = "Schedulable"
    UNSCHEDULABLE = "Unschedulable"
    PENDING_REPLACEMENT = "UnschedulablePendingReplacement"
    PENDING_REBOOT = "UnschedulablePendingReboot"


@dataclass(frozen=True)
class Taint:
    """A Kubernetes node taint (``key=value:effect``)."""

    key: str
    value: str
    effect: str

    def to_dict(self) -> dict[str, str]:
        return {"key": self.key, "value": self.value, "effect": self.effect}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Taint:
        return cls(
            key=str(raw["key"]), value=str(raw.get("value") or ""), effect=str(raw["effect"])
        )

    def __str__(self) -> str:
        return f"{self.key}={self.value}:{self.effect}"


@dataclass(frozen=True)
class NodeInfo:
    """A read-only view of one node, the same for the Kubernetes and the local backend.

    ``instance_id`` is None only when a Kubernetes node does not name its EC2 instance.
    """

    name: str
    instance_id: str | None
    unschedulable: bool
    taints: tuple[Taint, ...]
    labels: Mapping[str, str] = field(hash=False)
    annotations: Mapping[str, str] = field(hash=False)
    ready: bool


@dataclass(frozen=True)
class BlockedPod:
    """A pod whose eviction a PodDisruptionBudget still refused after our bounded retries."""

    pod: str
    reason: str
    attempts: int


@dataclass(frozen=True)
class EvictionResult:
    """What :meth:`NodeOps.evict_pods` did; ``complete`` only if no pod is left blocked.

    Pods are named ``namespace/name``. ``skipped`` pods are not evictable by design (DaemonSet
    pods come back on every node; mirror pods belong to the kubelet).
    """

    node: str
    evicted: tuple[str, ...] = ()
    blocked: tuple[BlockedPod, ...] = ()
    skipped: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        return not self.blocked


@runtime_checkable
class NodeOps(Protocol):
    """Side effects on cluster nodes, each idempotent and owned by one incident.

    Replacement has two channels that start the *same* HyperPod process: the node-health label
    (:meth:`mark_for_replacement`) and ``BatchReplaceClusterNodes`` (``recovery.aws.hyperpod``).
    A caller must pick one channel per node and never use both, or one failure may be answered
    by two replacements.
    """

    def get(self, node: str) -> NodeInfo: ...

    def cordon(self, node: str, incident_id: str) -> bool:
        """Mark the node unschedulable and record that ``incident_id`` did it.

        True only if this call cordoned it; False if it already was (by us or anyone else),
        in which case nothing is recorded as ours.
        """
        ...

    def taint(self, node: str, incident_id: str) -> bool:
        """Add ``sdcguard.io/suspect=<incident>:NoSchedule``; True if this call added it."""
        ...

    def uncordon(self, node: str, incident_id: str) -> bool:
        """Undo what ``incident_id`` did: our taint and labels always, the cordon only if our
        ownership annotation names this incident. True if the node became schedulable."""
        ...

    def mark_for_replacement(self, node: str, incident_id: str) -> bool:
        """Label the node ``UnschedulablePendingReplacement``; True if this call set it."""
        ...

    def mark_for_reboot(self, node: str, incident_id: str) -> bool:
        """Label the node ``UnschedulablePendingReboot``; True if this call set it. A pending
        replacement is never downgraded to a reboot."""
        ...

    def isolate(self, node: str, incident_id: str, note: str) -> bool:
        """Keep the node out of service for investigation: our cordon and taint where absent,
        plus the label ``sdcguard.io/isolated=<incident>`` and ``note``; True if newly set.
        :meth:`uncordon` of the same incident takes all of it off again."""
        ...

    def evict_pods(self, node: str, label_selector: str | None = None) -> EvictionResult: ...


class NodeDirectory(Protocol):
    """Which nodes exist for the flow's purposes: spares to rerun on, and replacement joins.

    A replaced instance comes back as a *new* node (EKS names it after the new instance; the
    local cluster gives it the next free ``node-N``); the flow needs that name to resume the
    job on it.
    """

    def spares(self, exclude: Collection[str]) -> list[str]:
        """Healthy, schedulable spare nodes, none of ``exclude``."""
        ...

    def joined(self, old_node: str, new_instance_id: str, *, timeout_s: float) -> str:
        """The node name under which ``new_instance_id`` (replacing ``old_node``) is ready,
        waiting at most ``timeout_s`` (what is left of the policy's replacement timeout)."""
        ...


# -- shared decisions --------------------------------------------------------------------


@dataclass
class NodeChange:
    """A change to one node: None / absent means "leave as is"; a None map value removes."""

    unschedulable: bool | None = None
    labels: dict[str, str | None] = field(default_factory=dict)
    annotations: dict[str, str | None] = field(default_factory=dict)
    taints: tuple[Taint, ...] | None = None

    def is_empty(self) -> bool:
        return (
            self.unschedulable is None
            and not self.labels
            and not self.annotations
            and self.taints is None
        )


def _check_incident(incident_id: str) -> None:
    # The incident id becomes a label value and a taint value: Kubernetes would refuse anything
    # else with a 422 after we had already started changing the node.
    if not _LABEL_VALUE.match(incident_id):
        raise ValueError(
            f"incident id {incident_id!r} is not a valid Kubernetes label value "
            "(at most 63 characters, alphanumeric at both ends, '-', '_' or '.' inside)"
        )


def _plan_cordon(
    info: NodeInfo, incident_id: str, reason: str, now: str
) -> tuple[NodeChange, bool]:
    if info.unschedulable:
        # Already cordoned — by this incident (a retry), by another incident, or by somebody
        # else. In every case taking ownership now would let our uncordon undo a cordon that
        # is not ours.
        return NodeChange(), False
    change = NodeChange(
        unschedulable=True,
        labels={LABEL_INCIDENT: incident_id},
        annotations={
            ANNOTATION_CORDONED_BY: incident_id,
            ANNOTATION_CORDON_REASON: reason,
            ANNOTATION_CORDONED_AT: now,
        },
    )
    return change, True


def _plan_taint(info: NodeInfo, incident_id: str) -> tuple[NodeChange, bool]:
    # Kubernetes keeps one taint per (key, effect); a suspect taint of another incident already
    # keeps new pods away, so it is left as it is.
    if any(t.key == TAINT_KEY and t.effect == TAINT_EFFECT for t in info.taints):
        return NodeChange(), False
    taint = Taint(key=TAINT_KEY, value=incident_id, effect=TAINT_EFFECT)
    return NodeChange(taints=(*info.taints, taint)), True


def _plan_uncordon(info: NodeInfo, incident_id: str) -> tuple[NodeChange, bool]:
    change = NodeChange()
    ours = info.annotations.get(ANNOTATION_CORDONED_BY) == incident_id
    if ours:
        change.annotations = {
            ANNOTATION_CORDONED_BY: None,
            ANNOTATION_CORDON_REASON: None,
            ANNOTATION_CORDONED_AT: None,
        }
    for label in (LABEL_INCIDENT, LABEL_ISOLATED):
        if info.labels.get(label) == incident_id:
            change.labels[label] = None
    if info.labels.get(LABEL_ISOLATED) == incident_id:
        change.annotations[ANNOTATION_ISOLATION_NOTE] = None
    kept = tuple(t for t in info.taints if not (t.key == TAINT_KEY and t.value == incident_id))
    if len(kept) != len(info.taints):
        change.taints = kept
    uncordoned = ours and info.unschedulable
    if uncordoned:
        change.unschedulable = False
    return change, uncordoned


def _plan_isolate(
    info: NodeInfo, incident_id: str, note: str, reason: str, now: str
) -> tuple[NodeChange, bool]:
    # Cordon and taint as the cordon stage would (ownership rules included), then the label
    # that tells a human why the node is out of service and who put it there.
    change, _ = _plan_cordon(info, incident_id, reason, now)
    tainted, _ = _plan_taint(info, incident_id)
    change.taints = tainted.taints
    if info.labels.get(LABEL_ISOLATED) == incident_id:
        return change, False
    change.labels[LABEL_ISOLATED] = incident_id
    change.annotations[ANNOTATION_ISOLATION_NOTE] = note
    return change, True


def _plan_health(info: NodeInfo, incident_id: str, wanted: NodeHealth) -> tuple[NodeChange, bool]:
    current = info.labels.get(HEALTH_LABEL)
    if current == wanted.value:
        return NodeChange(), False
    if wanted is NodeHealth.PENDING_REBOOT and current == NodeHealth.PENDING_REPLACEMENT.value:
        # A replacement is already under way: a reboot request would at best be ignored and at
        # worst cancel it.
        return NodeChange(), False
    change = NodeChange(
        labels={HEALTH_LABEL: wanted.value},
        annotations={ANNOTATION_HEALTH_REQUESTED_BY: incident_id},
    )
    return change, True


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


class PlannedNodeOps(abc.ABC):
    """The node changes both backends make, written once: each verb is a pure plan over the
    node's current state (``_plan_*``); a backend only knows how to read and write a node."""

    _cordon_reason: str

    def cordon(self, node: str, incident_id: str) -> bool:
        reason = self._cordon_reason
        return self._do(
            node, "cordon", incident_id, lambda i: _plan_cordon(i, incident_id, reason, _now())
        )

    def taint(self, node: str, incident_id: str) -> bool:
        return self._do(node, "taint", incident_id, lambda i: _plan_taint(i, incident_id))

    def uncordon(self, node: str, incident_id: str) -> bool:
        return self._do(node, "uncordon", incident_id, lambda i: _plan_uncordon(i, incident_id))

    def isolate(self, node: str, incident_id: str, note: str) -> bool:
        reason = self._cordon_reason
        return self._do(
            node,
            "isolate",
            incident_id,
            lambda i: _plan_isolate(i, incident_id, note, reason, _now()),
        )

    def mark_for_replacement(self, node: str, incident_id: str) -> bool:
        return self._do(
            node,
            "mark-for-replacement",
            incident_id,
            lambda i: _plan_health(i, incident_id, NodeHealth.PENDING_REPLACEMENT),
        )

    def mark_for_reboot(self, node: str, incident_id: str) -> bool:
        return self._do(
            node,
            "mark-for-reboot",
            incident_id,
            lambda i: _plan_health(i, incident_id, NodeHealth.PENDING_REBOOT),
        )

    def _do(
        self,
        node: str,
        verb: str,
        incident_id: str,
        plan: Callable[[NodeInfo], tuple[NodeChange, bool]],
    ) -> bool:
        _check_incident(incident_id)
        done = self._change(node, verb, incident_id, plan)
        _log_outcome(verb, node, incident_id, done)
        return done

    @abc.abstractmethod
    def _change(
        self,
        node: str,
        verb: str,
        incident_id: str,
        plan: Callable[[NodeInfo], tuple[NodeChange, bool]],
    ) -> bool:
        """Apply ``plan`` to the node's current state; return what the plan says was done."""


def _log_outcome(verb: str, node: str, incident_id: str, done: bool) -> None:
    log.info(
        "%s %s: %s",
        verb,
        node,
        "done" if done else "nothing to do",
        extra={"node": node, "incident": incident_id},
    )
