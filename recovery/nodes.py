"""Node operations: cordon, taint, uncordon, HyperPod health labels, pod eviction.

Ownership is the invariant of this module: sdcguard only undoes what sdcguard did. A cordon we
place is recorded on the node itself (annotation ``sdcguard.io/cordoned-by=<incident>``, label
``sdcguard.io/incident=<incident>``, plus the reason and time), so :meth:`NodeOps.uncordon` can
tell our cordon from an operator's or another controller's — a node somebody else cordoned stays
cordoned whatever our incident decides. The record lives on the node (not only in the ledger)
so that a human running ``kubectl describe node`` sees who cordoned it and why.

Both backends share the decisions: each operation is planned once, as a pure function of the
node's current state (:class:`_NodeChange`), and then applied by :class:`KubeNodeOps` as a
conditional patch (``metadata.resourceVersion`` precondition; a 409 re-reads and re-plans) or by
:class:`LocalNodeOps` under the local cluster's file lock. The two backends therefore cannot
drift apart in semantics.

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
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3HTTPError

from recovery import kube
from recovery.cluster import LocalCluster, NodeInfo, NodeRecord, Taint

__all__ = [
    "ANNOTATION_CORDONED_AT",
    "ANNOTATION_CORDONED_BY",
    "ANNOTATION_CORDON_REASON",
    "ANNOTATION_HEALTH_REQUESTED_BY",
    "HEALTH_LABEL",
    "LABEL_INCIDENT",
    "TAINT_EFFECT",
    "TAINT_KEY",
    "BlockedPod",
    "EvictionResult",
    "KubeNodeOps",
    "LocalNodeOps",
    "NodeHealth",
    "NodeInfo",
    "NodeOps",
    "Taint",
]

log = logging.getLogger(__name__)

ANNOTATION_CORDONED_BY = "sdcguard.io/cordoned-by"
"""Names the incident whose cordon this is; absent when somebody else cordoned the node."""
ANNOTATION_CORDON_REASON = "sdcguard.io/cordon-reason"
ANNOTATION_CORDONED_AT = "sdcguard.io/cordoned-at"
ANNOTATION_HEALTH_REQUESTED_BY = "sdcguard.io/node-health-requested-by"
LABEL_INCIDENT = "sdcguard.io/incident"
TAINT_KEY = "sdcguard.io/suspect"
TAINT_EFFECT = "NoSchedule"
HEALTH_LABEL = "sagemaker.amazonaws.com/node-health-status"

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
    (:meth:`mark_for_replacement`) and ``BatchReplaceClusterNodes`` (``recovery.hyperpod``).
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

    def evict_pods(self, node: str, label_selector: str | None = None) -> EvictionResult: ...


# -- shared decisions --------------------------------------------------------------------


@dataclass
class _NodeChange:
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
) -> tuple[_NodeChange, bool]:
    if info.unschedulable:
        # Already cordoned — by this incident (a retry), by another incident, or by somebody
        # else. In every case taking ownership now would let our uncordon undo a cordon that
        # is not ours.
        return _NodeChange(), False
    change = _NodeChange(
        unschedulable=True,
        labels={LABEL_INCIDENT: incident_id},
        annotations={
            ANNOTATION_CORDONED_BY: incident_id,
            ANNOTATION_CORDON_REASON: reason,
            ANNOTATION_CORDONED_AT: now,
        },
    )
    return change, True


def _plan_taint(info: NodeInfo, incident_id: str) -> tuple[_NodeChange, bool]:
    # Kubernetes keeps one taint per (key, effect); a suspect taint of another incident already
    # keeps new pods away, so it is left as it is.
    if any(t.key == TAINT_KEY and t.effect == TAINT_EFFECT for t in info.taints):
        return _NodeChange(), False
    taint = Taint(key=TAINT_KEY, value=incident_id, effect=TAINT_EFFECT)
    return _NodeChange(taints=(*info.taints, taint)), True


def _plan_uncordon(info: NodeInfo, incident_id: str) -> tuple[_NodeChange, bool]:
    change = _NodeChange()
    ours = info.annotations.get(ANNOTATION_CORDONED_BY) == incident_id
    if ours:
        change.annotations = {
            ANNOTATION_CORDONED_BY: None,
            ANNOTATION_CORDON_REASON: None,
            ANNOTATION_CORDONED_AT: None,
        }
    if info.labels.get(LABEL_INCIDENT) == incident_id:
        change.labels[LABEL_INCIDENT] = None
    kept = tuple(t for t in info.taints if not (t.key == TAINT_KEY and t.value == incident_id))
    if len(kept) != len(info.taints):
        change.taints = kept
    uncordoned = ours and info.unschedulable
    if uncordoned:
        change.unschedulable = False
    return change, uncordoned


def _plan_health(info: NodeInfo, incident_id: str, wanted: NodeHealth) -> tuple[_NodeChange, bool]:
    current = info.labels.get(HEALTH_LABEL)
    if current == wanted.value:
        return _NodeChange(), False
    if wanted is NodeHealth.PENDING_REBOOT and current == NodeHealth.PENDING_REPLACEMENT.value:
        # A replacement is already under way: a reboot request would at best be ignored and at
        # worst cancel it.
        return _NodeChange(), False
    change = _NodeChange(
        labels={HEALTH_LABEL: wanted.value},
        annotations={ANNOTATION_HEALTH_REQUESTED_BY: incident_id},
    )
    return change, True


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


# -- Kubernetes backend ------------------------------------------------------------------


class _PlannedNodeOps(abc.ABC):
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
        plan: Callable[[NodeInfo], tuple[_NodeChange, bool]],
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
        plan: Callable[[NodeInfo], tuple[_NodeChange, bool]],
    ) -> bool:
        """Apply ``plan`` to the node's current state; return what the plan says was done."""


class KubeNodeOps(_PlannedNodeOps):
    """:class:`NodeOps` on a real cluster through the official Kubernetes client.

    Needs RBAC: ``get``/``patch`` on ``nodes``, ``list`` on ``pods`` (all namespaces) and
    ``create`` on ``pods/eviction``.
    """

    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        conflict_retries: int = 5,
        conflict_backoff_s: float = 0.05,
        eviction_retries: int = 5,
        eviction_backoff_s: float = 1.0,
        eviction_max_backoff_s: float = 30.0,
        sleep: Callable[[float], None] = time.sleep,
        cordon_reason: str = DEFAULT_CORDON_REASON,
    ) -> None:
        self._core = k8s.CoreV1Api(api_client)
        self._conflict_retries = conflict_retries
        self._conflict_backoff_s = conflict_backoff_s
        self._eviction_retries = eviction_retries
        self._eviction_backoff_s = eviction_backoff_s
        self._eviction_max_backoff_s = eviction_max_backoff_s
        self._sleep = sleep
        self._cordon_reason = cordon_reason

    def get(self, node: str) -> NodeInfo:
        raw = kube.call("get", f"node/{node}", lambda: self._core.read_node(node))
        return _node_info(raw)

    def evict_pods(self, node: str, label_selector: str | None = None) -> EvictionResult:
        """Evict every pod on ``node`` through the Eviction API, honouring PodDisruptionBudgets.

        A 429 from a budget is retried in rounds with exponential backoff, at most
        ``eviction_retries`` more times; pods still refused are returned as ``blocked`` (never
        deleted around the budget). A 404 means the pod is already gone, which counts as
        evicted. Any other failure raises: a later call simply evicts what is left.
        """
        target = f"node/{node}"
        pods = kube.call(
            "evict",
            target,
            lambda: self._core.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={node}", label_selector=label_selector
            ),
        )
        pending: list[tuple[str, str]] = []
        skipped: list[str] = []
        for pod in pods.items or []:
            meta = pod.metadata
            if meta is None or not meta.name or not meta.namespace:
                continue  # the API server never returns a pod without name and namespace
            if _not_evictable(meta):
                skipped.append(f"{meta.namespace}/{meta.name}")
            else:
                pending.append((meta.namespace, meta.name))
        evicted: list[str] = []
        refusals: dict[str, str] = {}
        attempts: dict[str, int] = {}
        delay = self._eviction_backoff_s
        for round_number in range(self._eviction_retries + 1):
            still_blocked: list[tuple[str, str]] = []
            for namespace, name in pending:
                ref = f"{namespace}/{name}"
                attempts[ref] = attempts.get(ref, 0) + 1
                refusal = self._evict_one(node, namespace, name)
                if refusal is None:
                    evicted.append(ref)
                else:
                    refusals[ref] = refusal
                    still_blocked.append((namespace, name))
            pending = still_blocked
            if not pending or round_number == self._eviction_retries:
                break
            log.info(
                "%d pod(s) on %s held by a disruption budget; retrying in %.2fs",
                len(pending),
                node,
                delay,
                extra={"node": node},
            )
            self._sleep(delay)
            delay = min(self._eviction_max_backoff_s, delay * 2)
        blocked = tuple(
            BlockedPod(
                pod=f"{ns}/{n}", reason=refusals[f"{ns}/{n}"], attempts=attempts[f"{ns}/{n}"]
            )
            for ns, n in pending
        )
        if blocked:
            log.warning(
                "eviction from %s blocked for %s",
                node,
                ", ".join(b.pod for b in blocked),
                extra={"node": node},
            )
        return EvictionResult(
            node=node, evicted=tuple(evicted), blocked=blocked, skipped=tuple(skipped)
        )

    # -- internals ---------------------------------------------------------------------

    def _evict_one(self, node: str, namespace: str, name: str) -> str | None:
        """Evict one pod; None if it is gone now, else the budget's refusal message."""
        body = k8s.V1Eviction(
            api_version="policy/v1",
            kind="Eviction",
            metadata=k8s.V1ObjectMeta(name=name, namespace=namespace),
        )
        try:
            self._core.create_namespaced_pod_eviction(name, namespace, body)
        except ApiException as err:
            if err.status == 404:
                return None
            if err.status == 429:
                return kube.status_message(err)
            raise kube.translate(err, verb="evict", target=f"pod/{namespace}/{name}") from err
        except (Urllib3HTTPError, OSError) as err:
            raise kube.translate(err, verb="evict", target=f"pod/{namespace}/{name}") from err
        log.info("evicted %s/%s from %s", namespace, name, node, extra={"node": node})
        return None

    def _change(
        self,
        node: str,
        verb: str,
        incident_id: str,
        plan: Callable[[NodeInfo], tuple[_NodeChange, bool]],
    ) -> bool:
        extra = {"node": node, "incident": incident_id}

        def attempt() -> bool:
            raw = self._core.read_node(node)
            change, result = plan(_node_info(raw))
            if change.is_empty():
                return result
            body = _patch_body(change, raw.metadata.resource_version if raw.metadata else None)
            self._core.patch_node(
                node, body, _content_type="application/strategic-merge-patch+json"
            )
            return result

        return kube.retry_on_conflict(
            verb,
            f"node/{node}",
            attempt,
            retries=self._conflict_retries,
            backoff_s=self._conflict_backoff_s,
            sleep=self._sleep,
            extra=extra,
        )


def _patch_body(change: _NodeChange, resource_version: str | None) -> dict[str, Any]:
    # The resourceVersion turns the patch into a compare-and-swap: if the node changed since we
    # read it, the server answers 409 and we decide again. Taints have no merge key, so the
    # strategic merge replaces the whole list — which is why they need that precondition most.
    metadata: dict[str, Any] = {}
    if resource_version:
        metadata["resourceVersion"] = resource_version
    if change.labels:
        metadata["labels"] = dict(change.labels)
    if change.annotations:
        metadata["annotations"] = dict(change.annotations)
    body: dict[str, Any] = {"metadata": metadata}
    spec: dict[str, Any] = {}
    if change.unschedulable is not None:
        spec["unschedulable"] = change.unschedulable
    if change.taints is not None:
        spec["taints"] = [t.to_dict() for t in change.taints]
    if spec:
        body["spec"] = spec
    return body


def _node_info(raw: Any) -> NodeInfo:
    meta = raw.metadata
    spec = raw.spec
    status = raw.status
    taints = tuple(
        Taint(key=t.key, value=t.value or "", effect=t.effect)
        for t in ((spec.taints if spec else None) or [])
    )
    conditions = (status.conditions if status else None) or []
    ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
    return NodeInfo(
        name=meta.name,
        instance_id=_instance_id(meta.name, spec.provider_id if spec else None),
        unschedulable=bool(spec.unschedulable) if spec else False,
        taints=taints,
        labels=dict(meta.labels or {}),
        annotations=dict(meta.annotations or {}),
        ready=ready,
    )


def _instance_id(name: str, provider_id: str | None) -> str | None:
    # EKS: spec.providerID = aws:///<az>/<instance-id>; HyperPod names nodes hyperpod-<instance>.
    if provider_id:
        last = provider_id.rstrip("/").rsplit("/", 1)[-1]
        if last.startswith("i-"):
            return last
    match = _HYPERPOD_NODE_NAME.match(name)
    return match.group(1) if match else None


def _not_evictable(meta: Any) -> bool:
    if (meta.annotations or {}).get("kubernetes.io/config.mirror"):
        return True
    return any(ref.kind == "DaemonSet" for ref in (meta.owner_references or []))


def _log_outcome(verb: str, node: str, incident_id: str, done: bool) -> None:
    log.info(
        "%s %s: %s",
        verb,
        node,
        "done" if done else "nothing to do",
        extra={"node": node, "incident": incident_id},
    )


# -- local backend -----------------------------------------------------------------------


class LocalNodeOps(_PlannedNodeOps):
    """:class:`NodeOps` on the simulated cluster, with exactly the decisions of
    :class:`KubeNodeOps`. The simulated cluster runs no pods (local training processes are
    controlled by ``recovery.jobs.LocalJobControl``), so eviction finds nothing to evict."""

    def __init__(
        self, cluster: LocalCluster, *, cordon_reason: str = DEFAULT_CORDON_REASON
    ) -> None:
        self._cluster = cluster
        self._cordon_reason = cordon_reason

    def get(self, node: str) -> NodeInfo:
        return self._cluster.node(node)

    def evict_pods(self, node: str, label_selector: str | None = None) -> EvictionResult:
        self._cluster.node(node, verb="evict")  # same NotFoundError as the real backend
        return EvictionResult(node=node)

    def _change(
        self,
        node: str,
        verb: str,
        incident_id: str,
        plan: Callable[[NodeInfo], tuple[_NodeChange, bool]],
    ) -> bool:
        def apply(record: NodeRecord) -> bool:
            change, result = plan(record.info())
            _apply(record, change)
            return result

        return self._cluster.update(node, apply, verb=verb)


def _apply(record: NodeRecord, change: _NodeChange) -> None:
    if change.unschedulable is not None:
        record.unschedulable = change.unschedulable
    _merge(record.labels, change.labels)
    _merge(record.annotations, change.annotations)
    if change.taints is not None:
        record.taints = list(change.taints)


def _merge(target: dict[str, str], changes: Mapping[str, str | None]) -> None:
    for key, value in changes.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value
