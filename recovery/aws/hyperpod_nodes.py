"""What SageMaker says about a HyperPod cluster's nodes, what a batch action on them answers,
and the refusals of :class:`~recovery.aws.hyperpod.HyperPod` that name a node."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, Final

from recovery.errors import (
    ConflictError,
    NotFoundError,
    PermanentError,
    RecoveryError,
    TemporaryError,
)

SYSTEM: Final = "hyperpod"
"""The outside system errors of a HyperPod operation name."""

__all__ = [
    "SYSTEM",
    "AlreadyReplacing",
    "AmbiguousReplacement",
    "BatchAction",
    "BatchResult",
    "ClusterNode",
    "MissingBaseline",
    "NodeFailure",
    "NodeFailureCode",
    "NodeStatus",
    "WaitTimeout",
]


class NodeStatus(StrEnum):
    """``ClusterInstanceStatus`` of the SageMaker API (compares equal to the wire string)."""

    RUNNING = "Running"
    FAILURE = "Failure"
    PENDING = "Pending"
    SHUTTING_DOWN = "ShuttingDown"
    SYSTEM_UPDATING = "SystemUpdating"
    DEEP_HEALTH_CHECK_IN_PROGRESS = "DeepHealthCheckInProgress"
    NOT_FOUND = "NotFound"
    DETACH_IN_PROGRESS = "DetachInProgress"
    ATTACH_IN_PROGRESS = "AttachInProgress"


class BatchAction(StrEnum):
    """The two batch node operations this adapter issues."""

    REBOOT = "reboot"
    REPLACE = "replace"


class NodeFailureCode(StrEnum):
    """Per-node ``ErrorCode`` values of a batch answer's ``Failed`` list."""

    INSTANCE_ID_NOT_FOUND = "InstanceIdNotFound"
    INVALID_INSTANCE_STATUS = "InvalidInstanceStatus"
    INSTANCE_ID_IN_USE = "InstanceIdInUse"
    INTERNAL_SERVER_ERROR = "InternalServerError"


class AlreadyReplacing(PermanentError):
    """A replace was asked for a node already being replaced; wait for it instead."""

    def __init__(self, cluster_name: str, instance_ids: Iterable[str], reason: str) -> None:
        self.instance_ids = tuple(instance_ids)
        super().__init__(SYSTEM, "replace", f"{cluster_name}/{','.join(self.instance_ids)}", reason)


class AmbiguousReplacement(PermanentError):
    """New members appeared in the group, but HyperPod's answers cannot say which one is ours."""


class MissingBaseline(PermanentError):
    """``wait_replaced`` cannot tell the new node from the old members of its group."""


class WaitTimeout(TemporaryError):
    """A bounded wait for a node state ran out; the operation may still finish later."""


@dataclass(frozen=True)
class ClusterNode:
    """One HyperPod instance as the SageMaker API describes it."""

    instance_id: str
    """Empty while a continuously provisioned node has no instance yet."""
    group: str
    status: str
    launch_time: datetime | None = None
    instance_type: str | None = None
    message: str | None = None
    private_dns_hostname: str | None = None
    logical_id: str | None = None
    """``NodeLogicalId`` (continuous provisioning): names the node across replacements."""

    @property
    def running(self) -> bool:
        return self.status == NodeStatus.RUNNING

    @classmethod
    def from_api(cls, data: Mapping[str, Any]) -> ClusterNode:
        """From a ``ClusterNodeDetails`` or ``ClusterNodeSummary`` dict."""
        status = data.get("InstanceStatus") or {}
        return cls(
            instance_id=str(data.get("InstanceId") or ""),
            group=str(data["InstanceGroupName"]),
            status=str(status.get("Status", "")),
            launch_time=data.get("LaunchTime"),
            instance_type=data.get("InstanceType"),
            message=status.get("Message"),
            private_dns_hostname=data.get("PrivateDnsHostname"),
            logical_id=data.get("NodeLogicalId"),
        )


@dataclass(frozen=True)
class NodeFailure:
    """A node that a batch call did not act on, with the service's reason."""

    instance_id: str
    code: str
    message: str


@dataclass(frozen=True)
class BatchResult:
    """What a batch reboot/replace did, node by node.

    ``members_before`` (replace only) maps each affected instance group to its instance ids just
    before the call, and ``logical_ids`` each replaced instance to its ``NodeLogicalId`` where
    the cluster has them: what :meth:`HyperPod.wait_replaced` needs to recognise the new node,
    worth persisting when the wait may happen in another process.
    """

    action: BatchAction
    cluster_name: str
    successful: tuple[str, ...]
    failed: tuple[NodeFailure, ...] = ()
    members_before: Mapping[str, frozenset[str]] = field(default_factory=dict)
    logical_ids: Mapping[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed

    def error_for(self, failure: NodeFailure, *, also: str = "") -> RecoveryError:
        """The :mod:`recovery.errors` type a flow should see for one rejected node."""
        target = f"{self.cluster_name}/{failure.instance_id}"
        reason = f"{failure.code}: {failure.message}{also}"
        verb = str(self.action)
        if failure.code == NodeFailureCode.INSTANCE_ID_NOT_FOUND:
            return NotFoundError(SYSTEM, verb, target, reason)
        if failure.code in (
            NodeFailureCode.INSTANCE_ID_IN_USE,
            NodeFailureCode.INVALID_INSTANCE_STATUS,
        ):
            # Another operation holds the node: retry later. If that operation was a
            # replacement, the retried replace() stops at its own guard (AlreadyReplacing).
            return ConflictError(SYSTEM, verb, target, reason)
        if failure.code == NodeFailureCode.INTERNAL_SERVER_ERROR:
            return TemporaryError(SYSTEM, verb, target, reason)
        return PermanentError(SYSTEM, verb, target, reason)

    def raise_for_failures(self) -> None:
        """Raise the error of the first rejected node, naming the others, if any was."""
        if not self.failed:
            return
        first, *others = self.failed
        also = ""
        if others:
            also = (
                " (also rejected: " + "; ".join(f"{f.instance_id} {f.code}" for f in others) + ")"
            )
        raise self.error_for(first, also=also)
