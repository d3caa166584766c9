"""The Kubernetes remediations at the wire: the official client against the fake API server.

``kubernetes``: a drain that a PodDisruptionBudget holds stops before the delete; the Node is
deleted once, even when the attempt is repeated after a crash; another object under the same
name is never deleted; the new node is one of the same pool that was not there before.
``nvsentinel``: one ``ExternalFault`` of the documented shape per node, followed to completion,
deleted on release; a repeat creates none. Neither touches a node nobody accused.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client as k8s

from recovery.errors import PermanentError, TemporaryError
from recovery.kube.nodes import KubeNodeOps
from recovery.kube.nvsentinel import NVSentinelRemediation
from recovery.kube.remediation import KubeReplaceRemediation
from recovery.remediation import RemediationOutcome, RemediationVerb, UnsupportedRemediation
from tests.recovery.fake_kube import FakeKube
from tests.recovery.fake_remediators import EXTERNAL_FAULT_PREFIX, FakeAutoscaler, FakeNVSentinel

POOL = {"karpenter.sh/nodepool": "gpu"}
REPLACE = RemediationVerb.REPLACE


def _no_sleep(_: float) -> None:
    pass


def _cluster(fake: FakeKube) -> None:
    for number, name in enumerate(("gpu-a", "gpu-b", "gpu-c")):
        fake.add_node(name, labels=POOL, instance_id=f"i-{0xA0 + number:017x}")
    fake.add_node("cpu-a", labels={"karpenter.sh/nodepool": "cpu"})  # another pool
    fake.add_pod("trainer-0", namespace="training", node="gpu-b")
    fake.add_pod("dcgm-exporter-b", namespace="gpu-operator", node="gpu-b", owner_kind="DaemonSet")
    fake.add_pod("trainer-1", namespace="training", node="gpu-c")


def _writes_to_others(fake: FakeKube, node: str) -> list[str]:
    """Every write that reached a node other than ``node``, or a pod that is not on it."""
    others = []
    for r in fake.requests:
        if r.method == "GET":
            continue
        if "/nodes/" in r.path and not r.path.endswith(f"/nodes/{node}"):
            others.append(f"{r.method} {r.path}")
        if "/pods/" in r.path and "trainer-1" in r.path:
            others.append(f"{r.method} {r.path}")
    return others


def _replacer(client: k8s.ApiClient) -> KubeReplaceRemediation:
    nodes = KubeNodeOps(client, eviction_retries=1, sleep=_no_sleep)
    return KubeReplaceRemediation(client, nodes, poll_s=0.01, sleep=_no_sleep)


def test_kubernetes_drains_deletes_once_and_finds_the_new_node_of_the_pool(
    fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    _cluster(fake_kube)
    autoscaler = FakeAutoscaler(fake_kube)
    remediation = _replacer(kube_client)
    plan = remediation.plan("gpu-b", "inc-1", REPLACE)
    assert plan["pool"] == POOL
    assert "gpu-b" in plan["nodes_before"]

    remediation.start(plan, first=True)
    result = remediation.wait(plan, timeout_s=5, taken=set())

    assert fake_kube.pod("trainer-0", "training") is None  # evicted through the Eviction API
    assert fake_kube.pod("dcgm-exporter-b", "gpu-operator") is not None  # DaemonSet: skipped
    (delete,) = fake_kube.requests_to("DELETE", r"/api/v1/nodes/")
    assert delete.path == "/api/v1/nodes/gpu-b"
    assert delete.body["preconditions"]["uid"] == plan["uid"]
    assert result["outcome"] == RemediationOutcome.REPLACED.value
    assert result["new_node"] == autoscaler.joined[0] == "gpu-new-1"
    assert _writes_to_others(fake_kube, "gpu-b") == []


def test_kubernetes_never_deletes_past_a_disruption_budget(
    fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    _cluster(fake_kube)
    fake_kube.block_eviction("training", "trainer-0", times=None)
    remediation = _replacer(kube_client)
    plan = remediation.plan("gpu-b", "inc-1", REPLACE)

    with pytest.raises(TemporaryError, match="PodDisruptionBudget holds training/trainer-0"):
        remediation.start(plan, first=True)
    assert fake_kube.requests_to("DELETE", r"/api/v1/nodes/") == []
    fake_kube.node("gpu-b")  # still there


def test_kubernetes_after_a_crash_converges_without_a_second_delete(
    fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    _cluster(fake_kube)
    FakeAutoscaler(fake_kube)
    plan = _replacer(kube_client).plan("gpu-b", "inc-1", REPLACE)
    _replacer(kube_client).start(plan, first=True)  # the process dies after the delete

    again = _replacer(kube_client)  # a new process, the plan from the ledger
    again.start(plan, first=False)
    result = again.wait(plan, timeout_s=5, taken=set())

    assert len(fake_kube.requests_to("DELETE", r"/api/v1/nodes/")) == 1
    assert result["new_node"] == "gpu-new-1"


def test_kubernetes_never_deletes_another_node_under_the_same_name(
    fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    _cluster(fake_kube)
    plan = _replacer(kube_client).plan("gpu-b", "inc-1", REPLACE)
    fake_kube.delete_object("/api/v1", "nodes", "gpu-b")
    fake_kube.add_node("gpu-b", labels=POOL)  # a new machine re-registered the name

    _replacer(kube_client).start(plan, first=False)

    assert fake_kube.requests_to("DELETE", r"/api/v1/nodes/") == []
    assert fake_kube.node("gpu-b")["metadata"]["uid"] != plan["uid"]


def test_kubernetes_refuses_a_reboot_and_times_out_without_a_new_node(
    fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    _cluster(fake_kube)
    remediation = _replacer(kube_client)
    with pytest.raises(UnsupportedRemediation):
        remediation.plan("gpu-b", "inc-1", RemediationVerb.REBOOT)
    plan = remediation.plan("gpu-b", "inc-1", REPLACE)
    remediation.start(plan, first=True)  # no autoscaler: nothing joins
    with pytest.raises(TemporaryError, match="no new node of pool"):
        remediation.wait(plan, timeout_s=0.05, taken=set())


def _sentinel(client: k8s.ApiClient) -> NVSentinelRemediation:
    return NVSentinelRemediation(client, poll_s=0.01, sleep=_no_sleep)


def _faults(fake: FakeKube) -> list[dict[str, Any]]:
    return fake.list_objects(EXTERNAL_FAULT_PREFIX, "externalfaults")


def test_nvsentinel_raises_one_external_fault_follows_it_and_deletes_it_on_release(
    fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    _cluster(fake_kube)
    sentinel = FakeNVSentinel(fake_kube, auto_complete=False)
    remediation = _sentinel(kube_client)
    plan = remediation.plan("gpu-b", "inc-1", REPLACE)
    remediation.start(plan, first=True)
    remediation.start(plan, first=False)  # a repeat after a crash: found, not created again

    (fault,) = _faults(fake_kube)
    event = fault["spec"]["healthEvent"]
    assert fault["apiVersion"] == "nvsentinel.dgxc.nvidia.com/v1"
    assert (event["nodeName"], event["isHealthy"], event["isFatal"]) == ("gpu-b", False, True)
    assert event["recommendedAction"] == "REPLACE_VM"
    assert event["entitiesImpacted"] == [{"entityType": "Node", "entityValue": "gpu-b"}]
    assert len(fake_kube.requests_to("POST", r"/externalfaults$")) == 1
    with pytest.raises(TemporaryError, match="not completed"):
        remediation.wait(plan, timeout_s=0.05, taken=set())

    sentinel.complete(sentinel.created[0])
    result = remediation.wait(plan, timeout_s=5, taken=set())
    assert result["outcome"] == RemediationOutcome.RESTORED.value
    assert result["new_node"] == "gpu-b"
    assert remediation.release({**plan, **result}, "inc-1") is True
    assert _faults(fake_kube) == []
    assert remediation.release({**plan, **result}, "inc-1") is False  # idempotent
    assert _writes_to_others(fake_kube, "gpu-b") == []
    assert fake_kube.requests_to("DELETE", r"/api/v1/nodes/") == []


def test_nvsentinel_fault_force_closed_by_an_operator_goes_to_a_human(
    fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    _cluster(fake_kube)
    FakeNVSentinel(fake_kube, auto_complete=False)
    remediation = _sentinel(kube_client)
    plan = remediation.plan("gpu-b", "inc-1", RemediationVerb.REBOOT)
    remediation.start(plan, first=True)
    assert _faults(fake_kube)[0]["spec"]["healthEvent"]["recommendedAction"] == "RESTART_VM"
    fake_kube.delete_object(EXTERNAL_FAULT_PREFIX, "externalfaults", plan["fault"])
    with pytest.raises(PermanentError, match="force-closed"):
        remediation.wait(plan, timeout_s=5, taken=set())
