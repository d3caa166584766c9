"""Controllers that answer our remediations on the fake Kubernetes API, as the real ones do.

:class:`FakeAutoscaler` plays Karpenter or a node group: when a Node is deleted, a new node of
the same pool (the old node's pool labels) joins under a new name, Ready. :class:`FakeNVSentinel`
plays NVSentinel's ``ExternalFault`` reconciler: it records each fault created and, when asked
(at once with ``auto_complete``), reports it done the way ADR-049 describes —
``FaultCleared=True`` and ``status.completionTime``. Both react through
:meth:`FakeKube.watch`, before the client hears the answer.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tests.recovery.fake_kube import FakeKube

__all__ = ["EXTERNAL_FAULT_PREFIX", "FakeAutoscaler", "FakeNVSentinel", "register_external_fault"]

EXTERNAL_FAULT_PREFIX = "/apis/nvsentinel.dgxc.nvidia.com/v1"


def register_external_fault(fake: FakeKube) -> None:
    """Serve the ``ExternalFault`` custom resource (cluster-scoped), as its CRD would."""
    fake.register(
        EXTERNAL_FAULT_PREFIX, "externalfaults", "ExternalFault", namespaced=False, custom=True
    )


class FakeAutoscaler:
    """A deleted node is replaced by a new node of its pool (``<pool>-new-<n>``)."""

    def __init__(self, fake: FakeKube, pool_labels: Sequence[str] = ("karpenter.sh/nodepool",)):
        self.fake = fake
        self.pool_labels = tuple(pool_labels)
        self.joined: list[str] = []
        self._numbers = itertools.count(1)
        fake.watch(self._on_change)

    def _on_change(self, verb: str, plural: str, old: Any, new: Any) -> None:
        if plural != "nodes" or verb != "delete" or old is None:
            return
        labels = old["metadata"].get("labels") or {}
        pool = {k: labels[k] for k in self.pool_labels if k in labels}
        number = next(self._numbers)
        name = f"{next(iter(pool.values()), 'node')}-new-{number}"
        self.fake.add_node(name, labels=pool, instance_id=f"i-{number:017x}")
        self.joined.append(name)


class FakeNVSentinel:
    """Records every ExternalFault created; completes it at once or on :meth:`complete`."""

    def __init__(self, fake: FakeKube, *, auto_complete: bool = True) -> None:
        self.fake = fake
        self.auto_complete = auto_complete
        self.created: list[str] = []
        register_external_fault(fake)
        fake.watch(self._on_change)

    def _on_change(self, verb: str, plural: str, old: Any, new: Any) -> None:
        if plural == "externalfaults" and verb == "create" and new is not None:
            self.created.append(new["metadata"]["name"])
            if self.auto_complete:
                self.complete(new["metadata"]["name"])

    def complete(self, name: str) -> None:
        """The child maintenance resource finished: the fault is cleared, the EF complete."""

        def done(obj: dict[str, Any]) -> None:
            obj["status"] = {
                "conditions": [
                    {"type": "FaultReported", "status": "True", "reason": "HealthEventEmitted"},
                    {"type": "FaultCleared", "status": "True", "reason": "FaultCleared"},
                ],
                "completionTime": "2026-12-07T08:00:00Z",
            }

        self.fake.mutate(EXTERNAL_FAULT_PREFIX, "externalfaults", name, done)
