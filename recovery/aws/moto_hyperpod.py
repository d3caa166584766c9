"""SageMaker HyperPod node replacement and reboot for moto, so the incident flow runs without AWS.

moto 5.2 fakes ``CreateCluster``, ``ListClusterNodes`` and ``DescribeClusterNode`` but not
``BatchReplaceClusterNodes`` / ``BatchRebootClusterNodes``, the two calls our recovery depends
on. This module adds them the way moto itself is built: methods on ``SageMakerModelBackend``
hold the behaviour, handlers on ``SageMakerResponse`` parse the request and wrap the result in
an ``ActionResult`` that moto serialises with botocore's own output shape. Because both the
in-process mock (``mock_aws``) and ``moto.server.ThreadedMotoServer`` dispatch to those classes,
one :func:`install` serves both.

Behaviour follows the AWS API reference and botocore's service model:

* ``ClusterName`` is required; ``NodeIds`` holds 1 to 25 ids (``ValidationException`` otherwise,
  with AWS's wording). botocore checks the lower bound on the client already; the fake checks
  both bounds so raw HTTP callers and clients with parameter validation off see the same.
* An unknown cluster is ``ResourceNotFound`` (the operation's only modelled error). Per-node
  problems never fail the call: they come back in ``Failed`` as ``{NodeId, ErrorCode, Message}``
  with the service's codes ``InstanceIdNotFound``, ``InstanceIdInUse`` (another operation on
  the node is in flight, e.g. a second replace) and ``InvalidInstanceStatus``.
* The AWS pattern for ids (``i-`` and 17 hex digits) is *not* enforced: moto's own
  ``CreateCluster`` names nodes ``<group>-<n>``, and those must stay addressable. Nodes created
  here by a replacement do get EC2-style ids.
* ``DescribeClusterNode`` answers ``ResourceNotFound`` (its only modelled error) for an unknown
  node or cluster, where plain moto says ``ValidationException``: a replaced node is *gone*.
* Logical ids (HyperPod *continuous provisioning*): a cluster created with
  ``NodeProvisioningMode="Continuous"`` gives every node a ``NodeLogicalId``, reported by
  ``DescribeClusterNode`` and, when ``IncludeNodeLogicalIds`` is true, by ``ListClusterNodes``;
  ``DescribeClusterNode`` and the batch calls accept ``NodeLogicalId(s)`` in its place. The
  reference says a logical id "persists throughout [the node's] lifecycle, from provisioning
  request to termination" and that replacing by logical id works for nodes that have no
  instance yet: the fake reads that as "the logical id names the node, the instance is its
  current hardware", so a replacement's new instance carries the old one's logical id. On a
  cluster without continuous provisioning every logical id comes back in
  ``FailedNodeLogicalIds`` as ``InstanceIdNotFound``.

Lifecycles use moto's state manager (``moto.moto_api.state_manager``), the mechanism moto uses
for every model with asynchronous status, so tests and the server's
``/moto-api/state-manager/set-transition`` endpoint can set how fast they go:

* replace (:data:`REPLACE_MODEL`): the request is accepted while the node is still reported
  ``Running`` (the reference promises no immediate status change: HyperPod replaces
  asynchronously, and ``InstanceIdInUse`` — "another operation is already in progress for this
  node" — is what a second request meets meanwhile); then the old node is ``ShuttingDown``;
  then it is gone and a node with a *new* instance id is ``Pending`` in the same instance group;
  then that node is ``Running``. A node is busy from the request until its replacement runs.
* reboot (:data:`REBOOT_MODEL`): the node is ``Pending`` (the reference names no rebooting
  status), then ``Running`` with the same id.

The default is one step per ``DescribeClusterNode`` / ``ListClusterNodes`` call on the cluster
(``{"progression": "manual", "times": 1}``): a caller always sees each intermediate state once.
A state is computed before a read answers and the clock ticks after it.

For retry tests, :func:`inject_throttling` makes the next *n* calls of an operation answer
``ThrottlingException`` (the code botocore's retry modes treat as throttling), and
:func:`call_count` tells how many requests the fake really received.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Final

from moto.core import DEFAULT_ACCOUNT_ID
from moto.core.responses import ActionResult
from moto.core.utils import utcnow
from moto.moto_api import state_manager
from moto.moto_api._internal import mock_random
from moto.moto_api._internal.managed_state_model import ManagedState
from moto.sagemaker.exceptions import (
    AWSValidationException,
    ResourceNotFound,
    SagemakerClientError,
)
from moto.sagemaker.models import ClusterNode, SageMakerModelBackend, sagemaker_backends
from moto.sagemaker.responses import SageMakerResponse

__all__ = [
    "MAX_NODE_IDS",
    "OPERATIONS",
    "REBOOT_MODEL",
    "REPLACE_MODEL",
    "ThrottlingException",
    "call_count",
    "inject_throttling",
    "install",
    "is_installed",
    "logical_id_of",
]

_LOG = logging.getLogger(__name__)

REPLACE_MODEL: Final = "sagemaker::cluster_node_replacement"
"""State-manager model name of a node replacement (accepted, still Running → ShuttingDown →
Pending → Running)."""

REBOOT_MODEL: Final = "sagemaker::cluster_node_reboot"
"""State-manager model name of a node reboot (Pending → Running)."""

MAX_NODE_IDS: Final = 25
"""AWS accepts 1 to 25 node ids per batch call."""

OPERATIONS: Final = (
    "BatchReplaceClusterNodes",
    "BatchRebootClusterNodes",
    "DescribeClusterNode",
    "ListClusterNodes",
)
"""Operations that count calls and honour :func:`inject_throttling`."""

_DEFAULT_TRANSITION: Final = {"progression": "manual", "times": 1}
_MARK: Final = "__sdcguard_hyperpod__"
_RUNNING: Final = "Running"
_PENDING: Final = "Pending"
_SHUTTING_DOWN: Final = "ShuttingDown"
_ACCEPTED: Final = "Accepted"
"""Internal phase of a replacement: requested, the node still reported ``Running``."""
_CONTINUOUS: Final = "Continuous"

# moto's server answers requests on several threads; every read-modify-write of cluster state
# below holds this lock so a replace and a poll never interleave half-way.
_STATE_LOCK = threading.RLock()
_INSTALL_LOCK = threading.Lock()


class ThrottlingException(SagemakerClientError):
    """The error code botocore's ``standard`` and ``adaptive`` retry modes back off on."""

    code = "ThrottlingException"

    def __init__(self, message: str) -> None:
        super().__init__(message)


class _NodeOperation(ManagedState):
    """One in-flight replace or reboot of a node, advanced by moto's state manager.

    The node stays *busy* (``InstanceIdInUse`` for any other batch call) until the operation
    reaches ``Running``: that is what makes a second replace of the same node fail per node.
    """

    def __init__(self, model_name: str, transitions: list[tuple[str | None, str]], node: Any):
        super().__init__(model_name, transitions)
        self.node = node
        self.new_node: Any | None = None
        self.done = False

    def busy_ids(self) -> set[str]:
        ids = {self.node.instance_id}
        if self.new_node is not None:
            ids.add(self.new_node.instance_id)
        return ids

    def apply(self, cluster: Any, phase: str) -> None:
        raise NotImplementedError


class _Replacement(_NodeOperation):
    def __init__(self, node: Any) -> None:
        super().__init__(
            REPLACE_MODEL,
            [(_ACCEPTED, _SHUTTING_DOWN), (_SHUTTING_DOWN, _PENDING), (_PENDING, _RUNNING)],
            node=node,
        )

    def apply(self, cluster: Any, phase: str) -> None:
        if phase == _ACCEPTED:
            return  # accepted: HyperPod has not started on the node yet; it reports Running
        if phase == _SHUTTING_DOWN:
            self.node.status = _SHUTTING_DOWN
            return
        if self.new_node is None:
            # The old instance is terminated: it leaves the cluster and a fresh one (new id,
            # same instance group and configuration) takes its place.
            cluster.nodes.pop(self.node.instance_id, None)
            self.new_node = _spawn_like(cluster, self.node)
            cluster.nodes[self.new_node.instance_id] = self.new_node
        self.new_node.status = phase
        self.done = phase == _RUNNING


class _Reboot(_NodeOperation):
    def __init__(self, node: Any) -> None:
        super().__init__(REBOOT_MODEL, [(_PENDING, _RUNNING)], node=node)
        node.status = _PENDING

    def apply(self, cluster: Any, phase: str) -> None:
        self.node.status = phase
        self.done = phase == _RUNNING


def _spawn_like(cluster: Any, old: Any) -> Any:
    """A new node in ``old``'s instance group, with an EC2-style id no node has used."""
    new_id = f"i-{mock_random.get_random_hex(17)}"
    while new_id in cluster.nodes:
        new_id = f"i-{mock_random.get_random_hex(17)}"
    node = ClusterNode(
        region_name=old.region_name,
        account_id=old.account_id,
        cluster_name=old.cluster_name,
        instance_group_name=old.instance_group_name,
        instance_type=old.instance_type,
        life_cycle_config=old.life_cycle_config,
        execution_role=old.execution_role,
        node_id=new_id,
        threads_per_core=old.threads_per_core,
    )
    node.launch_time = utcnow()
    # continuous provisioning: the logical id names the node, the instance is its hardware
    _set_logical_id(node, logical_id_of(old))
    return node


def logical_id_of(node: Any) -> str | None:
    """The node's ``NodeLogicalId`` (continuous provisioning), or None."""
    value: str | None = getattr(node, "_sdcguard_logical_id", None)
    return value


def _set_logical_id(node: Any, logical_id: str | None) -> None:
    node._sdcguard_logical_id = logical_id


def _continuous(cluster: Any) -> bool:
    return bool(getattr(cluster, "_sdcguard_continuous", False))


def _by_logical_id(cluster: Any, logical_id: str) -> Any | None:
    return next((n for n in cluster.nodes.values() if logical_id_of(n) == logical_id), None)


# --- per-cluster and per-backend state ------------------------------------------------------
# Kept as attributes of moto's own objects so that moto's reset (a new ``mock_aws``, the
# server's ``/moto-api/reset``, a deleted cluster) discards it with everything else.


def _operations(cluster: Any) -> list[_NodeOperation]:
    ops: list[_NodeOperation] | None = getattr(cluster, "_sdcguard_operations", None)
    if ops is None:
        ops = []
        cluster._sdcguard_operations = ops
    return ops


def _throttles(backend: Any) -> Counter[str]:
    counter: Counter[str] | None = getattr(backend, "_sdcguard_throttles", None)
    if counter is None:
        counter = Counter()
        backend._sdcguard_throttles = counter
    return counter


def _calls(backend: Any) -> Counter[str]:
    counter: Counter[str] | None = getattr(backend, "_sdcguard_calls", None)
    if counter is None:
        counter = Counter()
        backend._sdcguard_calls = counter
    return counter


def _reconcile(cluster: Any) -> None:
    """Bring node states up to what each operation's transition says now."""
    ops = _operations(cluster)
    for op in list(ops):
        phase = op.status
        if phase is not None:
            op.apply(cluster, phase)
        if op.done:
            ops.remove(op)


def _advance(cluster: Any) -> None:
    for op in _operations(cluster):
        op.advance()


def _cluster_or_not_found(backend: Any, cluster_name: str) -> Any:
    name = cluster_name
    if name.startswith("arn:"):
        name = name.split(":")[-1].split("/")[-1]
    cluster = backend.clusters.get(name)
    if cluster is None:
        raise ResourceNotFound(message=f"Cluster {cluster_name} not found.")
    return cluster


# --- validation (AWS wording) ---------------------------------------------------------------


def _validate_batch(
    cluster_name: str | None, node_ids: Sequence[str] | None, logical_ids: Sequence[str] | None
) -> None:
    errors: list[str] = []
    if not cluster_name:
        errors.append(
            "Value null at 'clusterName' failed to satisfy constraint: Member must not be null"
        )
    for field, values in (("nodeIds", node_ids), ("nodeLogicalIds", logical_ids)):
        if values is None:
            continue
        if len(values) < 1:
            errors.append(
                f"Value '{list(values)}' at '{field}' failed to satisfy constraint: "
                "Member must have length greater than or equal to 1"
            )
        if len(values) > MAX_NODE_IDS:
            errors.append(
                f"Value '{list(values)}' at '{field}' failed to satisfy constraint: "
                f"Member must have length less than or equal to {MAX_NODE_IDS}"
            )
        errors.extend(
            f"Value '{value}' at '{field}' failed to satisfy constraint: "
            "Member must have length between 1 and 256"
            for value in values
            if not isinstance(value, str) or not 1 <= len(value) <= 256
        )
    if errors:
        count = len(errors)
        noun = "error" if count == 1 else "errors"
        raise AWSValidationException(f"{count} validation {noun} detected: " + "; ".join(errors))
    if node_ids is None and logical_ids is None:
        raise AWSValidationException("Either NodeIds or NodeLogicalIds must be provided.")


# --- backend methods (added to SageMakerModelBackend) ---------------------------------------


def _node_verdict(cluster: Any, node: Any | None, name: str, verb: str) -> tuple[str, str] | None:
    """Why a batch call cannot act on ``node`` (``ErrorCode``, ``Message``), or None if it can."""
    if node is None:
        return (
            "InstanceIdNotFound",
            f"Instance {name} does not exist in cluster {cluster.cluster_name}.",
        )
    if any(node.instance_id in op.busy_ids() for op in _operations(cluster)):
        return (
            "InstanceIdInUse",
            f"Another operation is already in progress for instance {node.instance_id}.",
        )
    if node.status != _RUNNING:
        return "InvalidInstanceStatus", f"Instance {name} is {node.status}; cannot {verb} it now."
    return None


def _batch_node_action(
    backend: Any,
    cluster_name: str | None,
    node_ids: Sequence[str] | None,
    logical_ids: Sequence[str] | None,
    start: Callable[[Any], _NodeOperation],
    verb: str,
) -> dict[str, Any]:
    _validate_batch(cluster_name, node_ids, logical_ids)
    assert cluster_name is not None  # checked by _validate_batch
    with _STATE_LOCK:
        cluster = _cluster_or_not_found(backend, cluster_name)
        _reconcile(cluster)

        def act(node: Any) -> None:
            _operations(cluster).append(start(node))
            _LOG.info(
                "fake HyperPod started %s of %s",
                verb,
                node.instance_id,
                extra={"cluster": cluster.cluster_name, "node": node.instance_id},
            )

        successful: list[str] = []
        failed: list[dict[str, str]] = []
        for node_id in node_ids or ():
            refused = _node_verdict(cluster, cluster.nodes.get(node_id), node_id, verb)
            if refused is None:
                act(cluster.nodes[node_id])
                successful.append(node_id)
            else:
                failed.append({"NodeId": node_id, "ErrorCode": refused[0], "Message": refused[1]})
        result: dict[str, Any] = {"Successful": successful, "Failed": failed}
        if logical_ids is not None:
            done: list[str] = []
            refusals: list[dict[str, str]] = []
            for logical_id in logical_ids:
                node = _by_logical_id(cluster, logical_id) if _continuous(cluster) else None
                refused = _node_verdict(cluster, node, logical_id, verb)
                if node is None:
                    refused = (
                        "InstanceIdNotFound",
                        f"Node {logical_id} does not exist in cluster {cluster.cluster_name}.",
                    )
                if refused is None:
                    act(node)
                    done.append(logical_id)
                else:
                    refusals.append(
                        {
                            "NodeLogicalId": logical_id,
                            "ErrorCode": refused[0],
                            "Message": refused[1],
                        }
                    )
            result["SuccessfulNodeLogicalIds"] = done
            result["FailedNodeLogicalIds"] = refusals
        return result


def _backend_batch_replace_cluster_nodes(
    self: Any,
    cluster_name: str | None,
    node_ids: Sequence[str] | None = None,
    node_logical_ids: Sequence[str] | None = None,
) -> dict[str, Any]:
    return _batch_node_action(
        self, cluster_name, node_ids, node_logical_ids, _Replacement, "replace"
    )


def _backend_batch_reboot_cluster_nodes(
    self: Any,
    cluster_name: str | None,
    node_ids: Sequence[str] | None = None,
    node_logical_ids: Sequence[str] | None = None,
) -> dict[str, Any]:
    return _batch_node_action(self, cluster_name, node_ids, node_logical_ids, _Reboot, "reboot")


def _backend_describe_cluster_node(
    self: Any, cluster_name: str, node_id: str | None, node_logical_id: str | None = None
) -> dict[str, Any]:
    """moto's describe, plus lifecycles, logical ids and the modelled ``ResourceNotFound``."""
    if (node_id is None) == (node_logical_id is None):
        raise AWSValidationException(
            "You can specify either NodeLogicalId or InstanceId, but not both."
            if node_id is not None
            else "Either NodeId or NodeLogicalId must be provided."
        )
    with _STATE_LOCK:
        cluster = _cluster_or_not_found(self, cluster_name)
        _reconcile(cluster)
        if node_logical_id is not None:
            node = _by_logical_id(cluster, node_logical_id)
        else:
            node = cluster.nodes.get(node_id)
        if node is None:
            raise ResourceNotFound(
                message=f"Node {node_id or node_logical_id} not found in cluster "
                f"{cluster.cluster_name}."
            )
        details: dict[str, Any] = _with_logical_id(node.describe(), node)
        _advance(cluster)
        return details


def _with_logical_id(data: dict[str, Any], node: Any) -> dict[str, Any]:
    logical_id = logical_id_of(node)
    return data if logical_id is None else {**data, "NodeLogicalId": logical_id}


def _wrap_list_cluster_nodes(original: Callable[..., Any]) -> Callable[..., Any]:
    def list_cluster_nodes(self: Any, cluster_name: str, **kwargs: Any) -> Any:
        with _STATE_LOCK:
            cluster = self.clusters.get(cluster_name.split(":")[-1].split("/")[-1])
            if cluster is not None:
                _reconcile(cluster)
            # moto's own answer (its errors for an unknown cluster included).
            result = original(self, cluster_name, **kwargs)
            if cluster is not None:
                _advance(cluster)
            return result

    setattr(list_cluster_nodes, _MARK, True)
    return list_cluster_nodes


# --- response handlers (added to SageMakerResponse) -----------------------------------------


def _admit(response: Any, operation: str) -> Any | None:
    """Count the request; while throttles are pending, the ``ThrottlingException`` answer.

    The answer is serialised here, the way moto's ``call_action`` serialises a raised service
    error, because SageMaker's model has no ``ThrottlingException`` shape (it is a common AWS
    error) and moto warns about every unmodelled error it serialises; that warning says nothing
    about a deliberately injected throttle.
    """
    backend = response.sagemaker_backend
    with _STATE_LOCK:
        _calls(backend)[operation] += 1
        pending = _throttles(backend)
        if pending[operation] <= 0:
            return None
        pending[operation] -= 1
    error = ThrottlingException(f"Rate exceeded for {operation}.")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Exception\(ThrottlingException\)")
        status, headers, body = response.serialized(ActionResult(error))
    headers["status"] = status
    return body, headers


def _response_batch_replace_cluster_nodes(self: Any) -> Any:
    throttled = _admit(self, "BatchReplaceClusterNodes")
    if throttled is not None:
        return throttled
    result = self.sagemaker_backend.batch_replace_cluster_nodes(
        cluster_name=self._get_param("ClusterName"),
        node_ids=self._get_param("NodeIds"),
        node_logical_ids=self._get_param("NodeLogicalIds"),
    )
    return ActionResult(result)


def _response_batch_reboot_cluster_nodes(self: Any) -> Any:
    throttled = _admit(self, "BatchRebootClusterNodes")
    if throttled is not None:
        return throttled
    result = self.sagemaker_backend.batch_reboot_cluster_nodes(
        cluster_name=self._get_param("ClusterName"),
        node_ids=self._get_param("NodeIds"),
        node_logical_ids=self._get_param("NodeLogicalIds"),
    )
    return ActionResult(result)


def _response_describe_cluster_node(self: Any) -> Any:
    throttled = _admit(self, "DescribeClusterNode")
    if throttled is not None:
        return throttled
    details = self.sagemaker_backend.describe_cluster_node(
        cluster_name=self._get_param("ClusterName"),
        node_id=self._get_param("NodeId"),
        node_logical_id=self._get_param("NodeLogicalId"),
    )
    return ActionResult({"NodeDetails": details})


def _response_list_cluster_nodes(self: Any) -> Any:
    """moto's list (its filters, sorting and errors), plus ``IncludeNodeLogicalIds``."""
    throttled = _admit(self, "ListClusterNodes")
    if throttled is not None:
        return throttled
    nodes, next_token = self.sagemaker_backend.list_cluster_nodes(
        cluster_name=self._get_param("ClusterName"),
        creation_time_after=self._get_param("CreationTimeAfter"),
        creation_time_before=self._get_param("CreationTimeBefore"),
        instance_group_name_contains=self._get_param("InstanceGroupNameContains"),
        max_results=self._get_param("MaxResults"),
        next_token=self._get_param("NextToken"),
        sort_by=self._get_param("SortBy"),
        sort_order=self._get_param("SortOrder"),
    )
    include = bool(self._get_param("IncludeNodeLogicalIds"))
    summaries = [_with_logical_id(n.summary(), n) if include else n.summary() for n in nodes]
    return ActionResult({"NextToken": next_token, "ClusterNodeSummaries": summaries})


def _wrap_create_cluster(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """moto's create, plus ``NodeProvisioningMode="Continuous"``: a logical id per node."""

    def create_cluster(self: Any) -> Any:
        answer = original(self)
        if self._get_param("NodeProvisioningMode") == _CONTINUOUS:
            with _STATE_LOCK:
                cluster = self.sagemaker_backend.clusters[self._get_param("ClusterName")]
                cluster._sdcguard_continuous = True
                for node in cluster.nodes.values():
                    _set_logical_id(node, f"lid-{mock_random.get_random_hex(16)}")
        return answer

    setattr(create_cluster, _MARK, True)
    return create_cluster


def _marked(function: Callable[..., Any]) -> Callable[..., Any]:
    setattr(function, _MARK, True)
    return function


# --- public API -----------------------------------------------------------------------------


def is_installed() -> bool:
    """Whether :func:`install` has extended moto's SageMaker classes in this process."""
    return getattr(getattr(SageMakerResponse, "batch_replace_cluster_nodes", None), _MARK, False)


def install() -> None:
    """Add the batch node operations to moto's SageMaker backend and responses; idempotent.

    Call it once per process, before or inside ``mock_aws()`` and before starting a
    ``ThreadedMotoServer`` (the server runs in this process and uses the same classes).
    """
    with _INSTALL_LOCK:
        if is_installed():
            return
        for model in (REPLACE_MODEL, REBOOT_MODEL):
            state_manager.register_default_transition(model, dict(_DEFAULT_TRANSITION))

        backend_cls: Any = SageMakerModelBackend
        backend_cls.batch_replace_cluster_nodes = _marked(_backend_batch_replace_cluster_nodes)
        backend_cls.batch_reboot_cluster_nodes = _marked(_backend_batch_reboot_cluster_nodes)
        backend_cls.describe_cluster_node = _marked(_backend_describe_cluster_node)
        backend_cls.list_cluster_nodes = _wrap_list_cluster_nodes(backend_cls.list_cluster_nodes)

        response_cls: Any = SageMakerResponse
        response_cls.describe_cluster_node = _marked(_response_describe_cluster_node)
        response_cls.list_cluster_nodes = _marked(_response_list_cluster_nodes)
        response_cls.create_cluster = _wrap_create_cluster(response_cls.create_cluster)
        response_cls.batch_reboot_cluster_nodes = _marked(_response_batch_reboot_cluster_nodes)
        # Last: is_installed() looks at this one.
        response_cls.batch_replace_cluster_nodes = _marked(_response_batch_replace_cluster_nodes)
        _LOG.debug("moto SageMaker extended with HyperPod batch node operations")


def _backend(account_id: str, region: str) -> Any:
    return sagemaker_backends[account_id][region]


def _check_operation(operation: str) -> None:
    if operation not in OPERATIONS:
        raise ValueError(f"unknown operation {operation!r}; expected one of {OPERATIONS}")


def inject_throttling(
    operation: str,
    times: int,
    *,
    region: str = "us-east-1",
    account_id: str = DEFAULT_ACCOUNT_ID,
) -> None:
    """Make the next ``times`` calls of ``operation`` answer ``ThrottlingException``.

    The counter lives in the moto backend of ``account_id``/``region``, so a moto reset clears
    it. It works in-process and for a ``ThreadedMotoServer`` started in this process.
    """
    _check_operation(operation)
    if times < 0:
        raise ValueError(f"times must be >= 0, got {times}")
    with _STATE_LOCK:
        _throttles(_backend(account_id, region))[operation] = times


def call_count(
    operation: str,
    *,
    region: str = "us-east-1",
    account_id: str = DEFAULT_ACCOUNT_ID,
) -> int:
    """How many requests for ``operation`` reached the fake, throttled ones included."""
    _check_operation(operation)
    with _STATE_LOCK:
        return _calls(_backend(account_id, region))[operation]
