"""Node operations on the simulated cluster: :class:`LocalNodeOps` (the decisions of
:mod:`recovery.nodes`, applied under the cluster's file lock) and :class:`LocalNodeDirectory`."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from recovery.local.cluster import LocalCluster, NodeRecord
from recovery.nodes import (
    DEFAULT_CORDON_REASON,
    EvictionResult,
    NodeChange,
    NodeInfo,
    PlannedNodeOps,
)

__all__ = ["LocalNodeDirectory", "LocalNodeOps"]


class LocalNodeOps(PlannedNodeOps):
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
        plan: Callable[[NodeInfo], tuple[NodeChange, bool]],
    ) -> bool:
        def apply(record: NodeRecord) -> bool:
            change, result = plan(record.info())
            _apply(record, change)
            return result

        return self._cluster.update(node, apply, verb=verb)


def _apply(record: NodeRecord, change: NodeChange) -> None:
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


class LocalNodeDirectory:
    """Spares and joins on the simulated cluster: a join *is* the cluster state change."""

    def __init__(self, cluster: LocalCluster) -> None:
        self._cluster = cluster

    def spares(self, exclude: Collection[str]) -> list[str]:
        return self._cluster.spares(exclude)

    def joined(self, old_node: str, new_instance_id: str, *, timeout_s: float) -> str:
        # Immediate: nothing to wait for. Idempotent in the cluster: a repeated join returns the
        # node already joined.
        return self._cluster.replace_instance(old_node, new_instance_id)
