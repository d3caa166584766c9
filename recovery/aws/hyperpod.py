"""SageMaker HyperPod node operations: map a Kubernetes node to its instance, reboot, replace.

Replacing hardware is the one step of an incident that cannot be undone, so this adapter is
deliberately conservative:

* it never asks AWS to replace a node that is already being replaced: it describes every node
  first and refuses (:class:`AlreadyReplacing`) when one is ``ShuttingDown`` or when this
  object already issued a replace for it. A re-run flow is idempotent through the ledger; this
  is the second lock on the same door.
* per-node rejections in a batch answer (``Failed``) come back as typed :class:`NodeFailure`
  entries of a :class:`BatchResult`; nothing is dropped. :meth:`BatchResult.raise_for_failures`
  turns them into the error hierarchy of :mod:`recovery.errors`.
* waiting is bounded (``wait_timeout_s``) and ends in :class:`WaitTimeout`, a
  :class:`~recovery.errors.TemporaryError`, naming what was last seen.

Throttling is retried by botocore itself (``standard`` or ``adaptive`` retry mode, see
:func:`sagemaker_client`); only a throttle that outlasts those attempts reaches the caller, as
:class:`~recovery.errors.ThrottledError`.

A replacement node gets a new instance id. Which new instance replaced which old one is known
only where HyperPod says so:

* on a cluster with *continuous provisioning* every node has a ``NodeLogicalId`` that "persists
  throughout its lifecycle" (API reference, ``ClusterNodeDetails``): the logical id names the
  node and survives the replacement of its hardware, so :meth:`HyperPod.wait_replaced` follows
  it (``DescribeClusterNode(NodeLogicalId=…)``) to the instance now behind it;
* otherwise AWS gives no link (neither ``BatchReplaceClusterNodes``' answer nor
  ``ListClusterNodes`` / ``DescribeClusterNode`` name a predecessor). Then the rule is
  *accounting*, never "the first new node": :meth:`HyperPod.replace` records the group's
  members before the call (:attr:`BatchResult.members_before`, for a flow to persist); a new
  member is taken as ours only when every member that left the group since then is one *we*
  replaced. A departure we did not cause (HyperPod's own auto-recovery, another incident, a
  scale-in) or more arrivals than departures (a scale-out) make the match ambiguous, and
  :class:`AmbiguousReplacement` names the candidates for a human instead of guessing.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Final

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
)

from recovery.aws.errors import ServiceCodes, from_botocore
from recovery.aws.hyperpod_nodes import (
    SYSTEM as _SYSTEM,
)
from recovery.aws.hyperpod_nodes import (
    AlreadyReplacing,
    AmbiguousReplacement,
    BatchAction,
    BatchResult,
    ClusterNode,
    MissingBaseline,
    NodeFailure,
    NodeStatus,
    WaitTimeout,
)
from recovery.errors import (
    NotFoundError,
    PermanentError,
    RecoveryError,
)
from recovery.nodes import HYPERPOD_NODE_PREFIX

__all__ = [
    "INSTANCE_ID_LABEL",
    "MAX_BATCH",
    "HyperPod",
    "sagemaker_client",
]

_LOG = logging.getLogger(__name__)

MAX_BATCH: Final = 25
"""BatchReplaceClusterNodes / BatchRebootClusterNodes take 1 to 25 node ids."""

INSTANCE_ID_LABEL: Final = "sdcguard/instance-id"
"""Node label that names the HyperPod instance explicitly.

HyperPod documents health labels under ``sagemaker.amazonaws.com/`` but no instance-id label,
so an explicit mapping (local clusters, renamed nodes) uses this label of ours.
"""

_HYPERPOD_NODE_NAME = re.compile(r"hyperpod-(i-[0-9a-f]{8}(?:[0-9a-f]{9})?)")

_THROTTLING_CODES: Final = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestLimitExceeded",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
    }
)
_NOT_FOUND_CODES: Final = frozenset({"ResourceNotFound", "ResourceNotFoundException"})
_FORBIDDEN_CODES: Final = frozenset(
    {"AccessDenied", "AccessDeniedException", "UnauthorizedOperation", "NotAuthorized"}
)
_CONFLICT_CODES: Final = frozenset({"ConflictException", "ResourceInUse"})
_RETRY_MODES: Final = ("standard", "adaptive")


def sagemaker_client(
    region: str,
    endpoint_url: str | None = None,
    *,
    max_attempts: int = 8,
    retry_mode: str = "standard",
    session: boto3.session.Session | None = None,
    connect_timeout_s: float = 10.0,
    read_timeout_s: float = 60.0,
) -> Any:
    """A SageMaker client whose throttling and transient errors botocore retries with backoff.

    ``max_attempts`` counts every attempt, the first one included (botocore's
    ``total_max_attempts``). ``adaptive`` adds client-side rate limiting on top of
    ``standard``'s exponential backoff with jitter.
    """
    if retry_mode not in _RETRY_MODES:
        raise ValueError(f"retry_mode must be one of {_RETRY_MODES}, got {retry_mode!r}")
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    config = Config(
        region_name=region,
        retries={"mode": retry_mode, "total_max_attempts": max_attempts},
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
    )
    source = session if session is not None else boto3.session.Session()
    return source.client("sagemaker", endpoint_url=endpoint_url, config=config)


_CODES: Final = ServiceCodes(
    throttling=_THROTTLING_CODES,
    not_found=_NOT_FOUND_CODES,
    forbidden=_FORBIDDEN_CODES,
    conflict=_CONFLICT_CODES,
)


def _error_from_aws(err: Exception, verb: str, target: str) -> RecoveryError:
    """Map a botocore error to the temporary/permanent split flows retry on."""
    return from_botocore(err, system=_SYSTEM, verb=verb, target=target, codes=_CODES)


class HyperPod:
    """Node operations on one HyperPod cluster through a boto3 ``sagemaker`` client.

    ``clock`` (monotonic seconds) and ``sleep`` bound and pace the waits; tests pass fakes.
    One object may be shared by threads: its bookkeeping is locked.
    """

    def __init__(
        self,
        sagemaker_client: Any,
        cluster_name: str,
        *,
        poll_interval_s: float = 10.0,
        wait_timeout_s: float = 1800.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        instance_id_labels: Iterable[str] = (INSTANCE_ID_LABEL,),
    ) -> None:
        if poll_interval_s < 0 or wait_timeout_s < 0:
            raise ValueError("poll_interval_s and wait_timeout_s must be >= 0")
        self._client = sagemaker_client
        self._cluster = cluster_name
        self._poll_interval_s = poll_interval_s
        self._wait_timeout_s = wait_timeout_s
        self._clock = clock
        self._sleep = sleep
        self._instance_id_labels = tuple(instance_id_labels)
        self._lock = threading.Lock()
        # old instance id -> its group's members before the replace we issued
        self._baselines: dict[str, frozenset[str]] = {}
        # old instance id -> its NodeLogicalId (continuous provisioning)
        self._logical: dict[str, str] = {}
        # every instance this object asked HyperPod to replace (departures that are ours)
        self._replaced: set[str] = set()
        # new instance ids already handed out by wait_replaced
        self._claimed: set[str] = set()

    @classmethod
    def from_settings(
        cls,
        cluster_name: str,
        region: str,
        endpoint_url: str | None = None,
        *,
        max_attempts: int = 8,
        retry_mode: str = "standard",
        session: boto3.session.Session | None = None,
        poll_interval_s: float = 10.0,
        wait_timeout_s: float = 1800.0,
    ) -> HyperPod:
        """Build the client (botocore retry config) and the adapter in one go."""
        client = sagemaker_client(
            region,
            endpoint_url,
            max_attempts=max_attempts,
            retry_mode=retry_mode,
            session=session,
        )
        return cls(
            client,
            cluster_name,
            poll_interval_s=poll_interval_s,
            wait_timeout_s=wait_timeout_s,
        )

    @property
    def cluster_name(self) -> str:
        return self._cluster

    # --- reads ------------------------------------------------------------------------------

    def _call(self, verb: str, target: str, operation: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return operation(**kwargs)
        except (ClientError, BotoCoreError) as err:
            raise _error_from_aws(err, verb, f"{self._cluster}/{target}") from err

    def describe(self, instance_id: str) -> ClusterNode:
        """The node's current state; :class:`NotFoundError` if the cluster has no such node."""
        response = self._call(
            "describe",
            instance_id,
            self._client.describe_cluster_node,
            ClusterName=self._cluster,
            NodeId=instance_id,
        )
        return ClusterNode.from_api(response["NodeDetails"])

    def describe_logical(self, logical_id: str) -> ClusterNode:
        """The node a ``NodeLogicalId`` names now (continuous provisioning)."""
        response = self._call(
            "describe",
            logical_id,
            self._client.describe_cluster_node,
            ClusterName=self._cluster,
            NodeLogicalId=logical_id,
        )
        return ClusterNode.from_api(response["NodeDetails"])

    def list_nodes(self, group: str | None = None) -> list[ClusterNode]:
        """All nodes of the cluster (or of one instance group), in the API's creation order,
        with their logical ids where the cluster has them."""
        kwargs: dict[str, Any] = {"ClusterName": self._cluster, "IncludeNodeLogicalIds": True}
        if group is not None:
            kwargs["InstanceGroupNameContains"] = group
        nodes: list[ClusterNode] = []
        token: str | None = None
        while True:
            if token:
                kwargs["NextToken"] = token
            page = self._call("list nodes", group or "*", self._client.list_cluster_nodes, **kwargs)
            nodes.extend(ClusterNode.from_api(item) for item in page["ClusterNodeSummaries"])
            token = page.get("NextToken")
            if not token:
                break
        # The filter is "contains": keep the exact group only.
        return [n for n in nodes if group is None or n.group == group]

    def instance_for(self, node_name: str, labels: Mapping[str, str] | None = None) -> str:
        """The HyperPod instance id behind a Kubernetes node.

        In order: an explicit instance-id label; the ``hyperpod-<instance id>`` name HyperPod
        gives EKS nodes; a cluster node whose id or private DNS hostname is the node's name.
        Labels and names are checked against the cluster, so a stale mapping fails here, as
        :class:`NotFoundError`, not at replacement time.
        """
        for key in self._instance_id_labels:
            value = (labels or {}).get(key)
            if value:
                self.describe(value)
                return value
        match = _HYPERPOD_NODE_NAME.fullmatch(node_name)
        if match:
            self.describe(match.group(1))
            return match.group(1)
        short_name = node_name.split(".", 1)[0]
        found = {
            n.instance_id
            for n in self.list_nodes()
            if node_name in (n.instance_id, f"{HYPERPOD_NODE_PREFIX}{n.instance_id}")
            or (
                n.private_dns_hostname is not None
                and short_name == n.private_dns_hostname.split(".", 1)[0]
            )
        }
        if len(found) > 1:
            raise PermanentError(
                _SYSTEM,
                "map node",
                f"{self._cluster}/{node_name}",
                f"ambiguous: matches instances {sorted(found)}",
            )
        if not found:
            raise NotFoundError(
                _SYSTEM,
                "map node",
                f"{self._cluster}/{node_name}",
                "no instance-id label, not a hyperpod-<instance id> name, "
                "and no cluster node with that id or hostname",
            )
        return found.pop()

    # --- actions ----------------------------------------------------------------------------

    def _batch_ids(self, instance_ids: str | Iterable[str], verb: str) -> list[str]:
        raw = [instance_ids] if isinstance(instance_ids, str) else list(instance_ids)
        ids = list(dict.fromkeys(raw))
        if not 1 <= len(ids) <= MAX_BATCH:
            raise PermanentError(
                _SYSTEM,
                verb,
                self._cluster,
                f"a batch takes 1 to {MAX_BATCH} instance ids, got {len(ids)}",
            )
        return ids

    def reboot(self, instance_ids: str | Iterable[str]) -> BatchResult:
        """Soft-reboot nodes (same instances, same ids)."""
        ids = self._batch_ids(instance_ids, "reboot")
        response = self._call(
            "reboot",
            ",".join(ids),
            self._client.batch_reboot_cluster_nodes,
            ClusterName=self._cluster,
            NodeIds=ids,
        )
        return self._result(BatchAction.REBOOT, response, {})

    def replace(self, instance_ids: str | Iterable[str]) -> BatchResult:
        """Ask HyperPod for new hardware in place of these nodes; never twice for one node.

        Raises :class:`AlreadyReplacing` before any call when a node is ``ShuttingDown`` or
        this object already replaced it, and :class:`NotFoundError` for an unknown node.
        """
        ids = self._batch_ids(instance_ids, "replace")
        with self._lock:
            ours = [i for i in ids if i in self._baselines]
        if ours:
            raise AlreadyReplacing(self._cluster, ours, "replacement already requested")
        nodes = [self.describe(i) for i in ids]
        leaving = [n.instance_id for n in nodes if n.status == NodeStatus.SHUTTING_DOWN]
        if leaving:
            raise AlreadyReplacing(
                self._cluster, leaving, f"{NodeStatus.SHUTTING_DOWN}: already being replaced"
            )
        members = {
            g: frozenset(n.instance_id for n in self.list_nodes(g))
            for g in {n.group for n in nodes}
        }
        group_of = {n.instance_id: n.group for n in nodes}
        response = self._call(
            "replace",
            ",".join(ids),
            self._client.batch_replace_cluster_nodes,
            ClusterName=self._cluster,
            NodeIds=ids,
        )
        logical = {n.instance_id: n.logical_id for n in nodes if n.logical_id}
        result = self._result(BatchAction.REPLACE, response, members, logical)
        with self._lock:
            for instance_id in result.successful:
                self._replaced.add(instance_id)
                self._baselines[instance_id] = members[group_of[instance_id]]
                if instance_id in logical:
                    self._logical[instance_id] = logical[instance_id]
        return result

    def _result(
        self,
        action: BatchAction,
        response: Mapping[str, Any],
        members: Mapping[str, frozenset[str]],
        logical_ids: Mapping[str, str] | None = None,
    ) -> BatchResult:
        result = BatchResult(
            action=action,
            cluster_name=self._cluster,
            successful=tuple(response.get("Successful") or ()),
            failed=tuple(
                NodeFailure(
                    instance_id=str(item["NodeId"]),
                    code=str(item["ErrorCode"]),
                    message=str(item.get("Message", "")),
                )
                for item in response.get("Failed") or ()
            ),
            members_before=members,
            logical_ids=dict(logical_ids or {}),
        )
        for instance_id in result.successful:
            _LOG.info(
                "hyperpod %s started for %s",
                action,
                instance_id,
                extra={"cluster": self._cluster, "instance_id": instance_id},
            )
        for failure in result.failed:
            _LOG.warning(
                "hyperpod %s rejected for %s: %s: %s",
                action,
                failure.instance_id,
                failure.code,
                failure.message,
                extra={"cluster": self._cluster, "instance_id": failure.instance_id},
            )
        return result

    # --- waits ------------------------------------------------------------------------------

    def _pause(self, deadline: float) -> bool:
        """Sleep one poll interval (never past the deadline); False once the deadline passed."""
        remaining = deadline - self._clock()
        if remaining <= 0:
            return False
        self._sleep(min(self._poll_interval_s, remaining))
        return True

    def wait_replaced(
        self,
        instance_id: str,
        group: str,
        *,
        known_ids: Collection[str] | None = None,
        logical_id: str | None = None,
        replacing: Collection[str] = (),
        taken: Collection[str] = (),
        timeout_s: float | None = None,
    ) -> str:
        """Wait until ``instance_id`` was replaced and its successor is ``Running``; return it.

        With a ``logical_id`` (given, or recorded by this object's replace) the successor is
        the instance HyperPod now reports under that logical id. Without one, the accounting
        rule of the module docstring: ``known_ids`` are the group's members before the replace
        (default: those this object saw; else the first poll's, provided the old node is still
        there, otherwise :class:`MissingBaseline`); ``replacing`` are other instances the
        caller replaced too (a batch, an incident's other nodes), ``taken`` successors already
        handed out for them. A departure from the group that is not ours, or more arrivals than
        our departures, raises :class:`AmbiguousReplacement`. Two waits of one object never
        return the same instance. ``timeout_s`` (the incident policy's
        ``replacement_timeout_s``) overrides the adapter's default.
        """
        with self._lock:
            recorded = self._baselines.get(instance_id)
            logical = logical_id or self._logical.get(instance_id)
            ours = {instance_id, *replacing, *self._replaced}
        limit_s = self._wait_timeout_s if timeout_s is None else timeout_s
        deadline = self._clock() + limit_s
        if logical:
            new_id = self._follow_logical_id(instance_id, logical, group, deadline, limit_s)
        else:
            baseline = frozenset(known_ids) if known_ids is not None else recorded
            new_id = self._account(
                instance_id, group, baseline, frozenset(ours), frozenset(taken), deadline, limit_s
            )
        with self._lock:
            self._claimed.add(new_id)
            self._baselines.pop(instance_id, None)
            self._logical.pop(instance_id, None)
        _LOG.info(
            "hyperpod replaced %s by %s",
            instance_id,
            new_id,
            extra={"cluster": self._cluster, "instance_id": new_id, "logical_id": logical},
        )
        return new_id

    def _follow_logical_id(
        self, old_id: str, logical_id: str, group: str, deadline: float, limit_s: float
    ) -> str:
        """The instance HyperPod reports under ``logical_id`` once it is new and ``Running``."""
        target = f"{self._cluster}/{old_id} (logical id {logical_id})"
        while True:
            node = self.describe_logical(logical_id)
            if node.group != group:
                raise PermanentError(
                    _SYSTEM,
                    "wait for replacement of",
                    target,
                    f"the logical id is now in group {node.group}, not {group}",
                )
            if node.instance_id and node.instance_id != old_id and node.running:
                return node.instance_id
            if node.instance_id == old_id:
                seen = f"old instance still {node.status}"
            else:
                seen = f"new instance {node.instance_id or '(not assigned yet)'} {node.status}"
            if not self._pause(deadline):
                raise WaitTimeout(
                    _SYSTEM,
                    "wait for replacement of",
                    target,
                    f"not done after {limit_s:g} s: {seen}",
                )

    def _account(
        self,
        old_id: str,
        group: str,
        baseline: frozenset[str] | None,
        ours: frozenset[str],
        taken: frozenset[str],
        deadline: float,
        limit_s: float,
    ) -> str:
        """The accounting rule: a new member is ours only if every departure was ours."""
        target = f"{self._cluster}/{old_id}"
        while True:
            nodes = self.list_nodes(group)
            current = {n.instance_id: n for n in nodes if n.instance_id}
            old = current.get(old_id)
            if baseline is None:
                if old is None:
                    raise MissingBaseline(
                        _SYSTEM,
                        "wait for replacement of",
                        target,
                        "the old instance is already gone and no members of "
                        f"group {group} from before the replace are known; pass known_ids",
                    )
                baseline = frozenset(current)
            with self._lock:
                handed_out = taken | self._claimed
            departed = baseline - set(current)
            arrived = [n for i, n in current.items() if i not in baseline]
            free = [n for n in arrived if n.instance_id not in handed_out]
            foreign = sorted(departed - ours)
            if old is not None and old.status != NodeStatus.NOT_FOUND:
                seen = f"old instance still {old.status}"
            elif foreign or len(arrived) > len(departed):
                raise AmbiguousReplacement(
                    _SYSTEM,
                    "identify the replacement of",
                    target,
                    f"group {group} changed beyond our replacements (also gone: "
                    f"{foreign or 'none'}; new: {sorted(n.instance_id for n in arrived)}) and "
                    "HyperPod links no new instance to an old one on a cluster without "
                    "logical ids; map the new node by hand",
                )
            else:
                running = [n for n in free if n.running]
                if running:
                    return running[0].instance_id
                seen = "old instance gone; new nodes not Running yet: " + (
                    ", ".join(f"{n.instance_id} {n.status}" for n in free) or "none"
                )
            if not self._pause(deadline):
                raise WaitTimeout(
                    _SYSTEM,
                    "wait for replacement of",
                    target,
                    f"not done after {limit_s:g} s in group {group}: {seen}",
                )

    def wait_running(self, instance_id: str) -> ClusterNode:
        """Wait until the node is ``Running`` again (after a reboot); bounded like every wait.

        A node in ``Failure`` will not recover by waiting: that is a :class:`PermanentError`.
        """
        target = f"{self._cluster}/{instance_id}"
        deadline = self._clock() + self._wait_timeout_s
        while True:
            node = self.describe(instance_id)
            if node.running:
                return node
            if node.status == NodeStatus.FAILURE:
                raise PermanentError(
                    _SYSTEM, "wait until running", target, f"node failed: {node.message or ''}"
                )
            if not self._pause(deadline):
                raise WaitTimeout(
                    _SYSTEM,
                    "wait until running",
                    target,
                    f"still {node.status} after {self._wait_timeout_s:g} s",
                )
