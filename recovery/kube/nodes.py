"""Node operations on a real cluster: :class:`KubeNodeOps` through the official Kubernetes client,
and :class:`KubeNodeDirectory` (spares, and the node a HyperPod replacement joins as).

The decisions are :mod:`recovery.nodes`'s plans; this module only reads a node and writes a
conditional patch.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3HTTPError

from recovery.errors import NotFoundError, TemporaryError
from recovery.kube import client as kube
from recovery.nodes import (
    DEFAULT_CORDON_REASON,
    HYPERPOD_NODE_PREFIX,
    BlockedPod,
    EvictionResult,
    NodeChange,
    NodeInfo,
    NodeOps,
    PlannedNodeOps,
    Taint,
)

__all__ = ["KubeNodeDirectory", "KubeNodeOps", "node_instance_id"]

log = logging.getLogger(__name__)

_HYPERPOD_NODE_NAME = re.compile(rf"^{HYPERPOD_NODE_PREFIX}(i-[0-9a-f]+)$")


class KubeNodeOps(PlannedNodeOps):
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
        plan: Callable[[NodeInfo], tuple[NodeChange, bool]],
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


def _patch_body(change: NodeChange, resource_version: str | None) -> dict[str, Any]:
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


def node_instance_id(raw: Any) -> str | None:
    """The EC2 instance behind a node object as the API returns it (None if it names none)."""
    return _instance_id(raw.metadata.name, raw.spec.provider_id if raw.spec else None)


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


class KubeNodeDirectory:
    """Spares from a fixed list; a replacement is ready once ``hyperpod-<id>`` is Ready.

    The join wait has no limit of its own: the caller passes what is left of the policy's
    ``replacement_timeout_s`` (one bound for "HyperPod brought the instance up" and "it joined").
    """

    def __init__(self, nodes: NodeOps, spare_nodes: Sequence[str], *, poll_s: float = 10.0) -> None:
        self._nodes = nodes
        self._spares = list(spare_nodes)
        self._poll_s = poll_s

    def spares(self, exclude: Collection[str]) -> list[str]:
        ready = []
        for name in self._spares:
            if name in exclude:
                continue
            try:
                info = self._nodes.get(name)
            except NotFoundError:
                continue
            if info.ready and not info.unschedulable:
                ready.append(name)
        return ready

    def joined(self, old_node: str, new_instance_id: str, *, timeout_s: float) -> str:
        """Poll until the new node is Ready; looked at at least once, even with no time left."""
        name = f"{HYPERPOD_NODE_PREFIX}{new_instance_id}"
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(NotFoundError):
                if self._nodes.get(name).ready:
                    return name
            left = deadline - time.monotonic()
            if left <= 0:
                raise TemporaryError(
                    "kubernetes", "wait for node", name, f"not Ready after {timeout_s:g} s"
                )
            time.sleep(min(self._poll_s, left))
