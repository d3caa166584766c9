"""Remediation on any Kubernetes cluster: the cluster's own replacement (``kubernetes``).

:class:`KubeReplaceRemediation` drains the node through the Eviction API (PodDisruptionBudgets
honoured — a pod a budget still holds after the bounded retries stops us with a
:class:`TemporaryError`, the node is never deleted around it), deletes the Node object with a
``uid`` precondition, and waits for a new node of the same pool to join: Karpenter's
termination finalizer drains and terminates the instance and its NodePool brings another; a
node group of fixed size does the same once the instance is gone. Never twice: a repeat finds
the node gone, being deleted (``deletionTimestamp``) or replaced by another object of the same
name (another ``uid``) and deletes nothing.

:class:`NodeWatch` (the node's identity, its successor) is shared with NVSentinel's remediation
(:mod:`recovery.kube.nvsentinel`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3HTTPError

from recovery.errors import TemporaryError
from recovery.kube import client as kube
from recovery.kube.nodes import KubeNodeOps, node_instance_id
from recovery.remediation import (
    RemediationKind,
    RemediationOutcome,
    RemediationVerb,
    UnsupportedRemediation,
    remedy,
)

__all__ = ["DEFAULT_POOL_LABELS", "KubeReplaceRemediation", "NodeWatch"]

log = logging.getLogger(__name__)

DEFAULT_POOL_LABELS = (
    "karpenter.sh/nodepool",
    "eks.amazonaws.com/nodegroup",
    "cloud.google.com/gke-nodepool",
    "node.kubernetes.io/instance-type",
)
"""Labels whose values a replacement node must share with the node it replaces."""


class NodeWatch:
    """What the Kubernetes remediations share: the node's identity before any change, and the
    wait for its successor — a Ready, schedulable node that was not in the cluster when the
    plan was made, of the same pool (the values of the old node's pool labels), and not taken
    by another replacement of the incident."""

    def __init__(
        self,
        api_client: k8s.ApiClient,
        pool_labels: Sequence[str],
        poll_s: float,
        sleep: Callable[[float], None],
    ) -> None:
        self._core = k8s.CoreV1Api(api_client)
        self._pool_labels = tuple(pool_labels)
        self._poll_s = poll_s
        self._sleep = sleep

    def identity(self, node: str) -> dict[str, Any]:
        raw: Any = kube.call("get", f"node/{node}", lambda: self._core.read_node(node))
        labels = dict(raw.metadata.labels or {})
        listed: Any = kube.call("list", "nodes", lambda: self._core.list_node())
        return {
            "uid": raw.metadata.uid,
            "pool": {k: labels[k] for k in self._pool_labels if k in labels},
            "nodes_before": sorted(n.metadata.name for n in listed.items or []),
        }

    def current(self, node: str) -> Any | None:
        """The node object now, or None when it is gone."""
        try:
            return self._core.read_node(node)
        except ApiException as err:
            if err.status == 404:
                return None
            raise kube.translate(err, verb="get", target=f"node/{node}") from err
        except (Urllib3HTTPError, OSError) as err:
            raise kube.translate(err, verb="get", target=f"node/{node}") from err

    def new_node(
        self, plan: Mapping[str, Any], taken: Collection[str], deadline: float, timeout_s: float
    ) -> tuple[str, str | None]:
        """Poll until a node not in the plan's ``nodes_before`` of the same pool is Ready and
        schedulable; looked at at least once, even with no time left."""
        before = set(plan["nodes_before"]) | set(taken)
        pool = dict(plan.get("pool") or {})
        old = str(plan["node"])
        while True:
            listed: Any = kube.call("list", "nodes", lambda: self._core.list_node())
            for raw in sorted(listed.items or [], key=lambda n: str(n.metadata.name)):
                name = str(raw.metadata.name)
                if name in before or not _ready(raw) or (raw.spec and raw.spec.unschedulable):
                    continue
                labels = raw.metadata.labels or {}
                if all(labels.get(k) == v for k, v in pool.items()):
                    return name, node_instance_id(raw)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TemporaryError(
                    kube.SYSTEM,
                    "wait for replacement",
                    f"node/{old}",
                    f"no new node of pool {pool or 'any'} Ready after {timeout_s:g} s",
                )
            self._sleep(min(self._poll_s, left))


class KubeReplaceRemediation:
    """``kubernetes``: drain, delete the Node, wait for the cluster's autoscaler's new node.

    Needs RBAC: ``get``/``list``/``delete`` on ``nodes``, ``list`` on ``pods`` and ``create`` on
    ``pods/eviction`` (the drain honours PodDisruptionBudgets server-side, through the Eviction
    API: no read of the budgets is needed).
    """

    kind = RemediationKind.KUBERNETES
    releases_on_resolve = False

    def __init__(
        self,
        api_client: k8s.ApiClient,
        nodes: KubeNodeOps,
        *,
        pool_labels: Sequence[str] = DEFAULT_POOL_LABELS,
        poll_s: float = 10.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._core = k8s.CoreV1Api(api_client)
        self._nodes = nodes
        self._watch = NodeWatch(api_client, pool_labels, poll_s, sleep)

    def describe(self, verb: RemediationVerb) -> str:
        return (
            "the node is drained (PodDisruptionBudgets honoured) and its Node object deleted; "
            "the cluster's autoscaler (Karpenter, or the node group) brings a new node of the "
            "same pool and training resumes on it"
        )

    def plan(self, node: str, incident_id: str, verb: RemediationVerb) -> dict[str, Any]:
        if verb is RemediationVerb.REBOOT:
            raise UnsupportedRemediation(
                kube.SYSTEM,
                "reboot",
                f"node/{node}",
                "the kubernetes remediation replaces nodes; a reboot needs hyperpod or nvsentinel",
            )
        return {
            "backend": self.kind.value,
            "verb": verb.value,
            "node": node,
            **self._watch.identity(node),
        }

    def start(self, plan: Mapping[str, Any], *, first: bool) -> None:
        node, uid = str(plan["node"]), str(plan["uid"])
        extra = {"node": node}
        raw = self._watch.current(node)
        if raw is None or raw.metadata.uid != uid:
            log.info("%s already left the cluster; nothing to delete", node, extra=extra)
            return
        if raw.metadata.deletion_timestamp is not None:
            log.info("%s is already being deleted; waiting", node, extra=extra)
            return
        drained = self._nodes.evict_pods(node)
        if not drained.complete:
            raise TemporaryError(
                kube.SYSTEM,
                "drain",
                f"node/{node}",
                "a PodDisruptionBudget holds "
                + ", ".join(f"{b.pod} ({b.reason})" for b in drained.blocked)
                + "; the node is not deleted before its pods may leave",
            )
        options = k8s.V1DeleteOptions(preconditions=k8s.V1Preconditions(uid=uid))
        try:
            self._core.delete_node(node, body=options)
        except ApiException as err:
            if err.status in (404, 409):  # gone, or another node under the name: not ours
                log.info("%s: already deleted (%s)", node, err.status, extra=extra)
                return
            raise kube.translate(err, verb="delete", target=f"node/{node}") from err
        except (Urllib3HTTPError, OSError) as err:
            raise kube.translate(err, verb="delete", target=f"node/{node}") from err
        log.info("deleted node %s; the autoscaler replaces it", node, extra=extra)

    def wait(
        self, plan: Mapping[str, Any], *, timeout_s: float, taken: Collection[str]
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        new_node, instance = self._watch.new_node(plan, taken, deadline, timeout_s)
        return remedy(
            str(plan["node"]), RemediationOutcome.REPLACED, new_node, new_instance_id=instance
        )

    def release(self, result: Mapping[str, Any], incident_id: str) -> bool:
        return False  # the old node is gone; nothing of ours is left


def _ready(raw: Any) -> bool:
    conditions = (raw.status.conditions if raw.status else None) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)
