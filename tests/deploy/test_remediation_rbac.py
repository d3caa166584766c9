"""Each remediation backend's RBAC grants exactly what the backend sends at the wire.

The backend runs one node's remediation (plan, start, wait, release) through the official
client against the fake Kubernetes API; every request it made must be granted by the base role
plus its component (``deploy/k8s/components/remediation-*``), and every rule the component adds
must be one the backend used — nothing more. ``hyperpod`` and ``isolate`` need nothing beyond
the base; the IAM policy without HyperPod names no SageMaker call.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client as k8s

from recovery.isolation import IsolateRemediation
from recovery.kube.client import api_client_for_host
from recovery.kube.nodes import KubeNodeOps
from recovery.kube.nvsentinel import NVSentinelRemediation
from recovery.kube.remediation import KubeReplaceRemediation
from recovery.remediation import Remediation, RemediationVerb
from tests.deploy.overlays import DEPLOY, render
from tests.deploy.rbac import denied, rules_of, used
from tests.recovery.fake_kube import FakeKube
from tests.recovery.fake_remediators import FakeAutoscaler, FakeNVSentinel

COMPONENTS = DEPLOY / "k8s" / "components"
POOL = {"karpenter.sh/nodepool": "gpu"}


def _no_sleep(_: float) -> None:
    pass


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    with FakeKube() as server:
        for name in ("gpu-a", "gpu-b"):
            server.add_node(name, labels=POOL)
        server.add_pod("trainer-0", namespace="training", node="gpu-b")
        yield server


def _remediate(fake: FakeKube, make: Callable[[k8s.ApiClient], Remediation]) -> None:
    client = api_client_for_host(fake.url, token="test-token")
    try:
        remediation = make(client)
        plan = remediation.plan("gpu-b", "inc-1", RemediationVerb.REPLACE)
        remediation.start(plan, first=True)
        result = remediation.wait(plan, timeout_s=5, taken=set())
        remediation.release({**plan, **result}, "inc-1")
    finally:
        client.close()


def _kubernetes(client: k8s.ApiClient) -> Remediation:
    return KubeReplaceRemediation(client, KubeNodeOps(client), poll_s=0.01, sleep=_no_sleep)


def _nvsentinel(client: k8s.ApiClient) -> Remediation:
    return NVSentinelRemediation(client, poll_s=0.01, sleep=_no_sleep)


def _isolate(client: k8s.ApiClient) -> Remediation:
    return IsolateRemediation(KubeNodeOps(client))


BASE = rules_of("ClusterRole", "sdcguard-recovery")


@pytest.mark.parametrize(
    ("backend", "make"),
    [("kubernetes", _kubernetes), ("nvsentinel", _nvsentinel), ("isolate", _isolate)],
)
def test_each_backend_is_granted_exactly_what_it_sends(
    fake: FakeKube, backend: str, make: Callable[[k8s.ApiClient], Remediation]
) -> None:
    FakeAutoscaler(fake)
    FakeNVSentinel(fake)
    _remediate(fake, make)
    component = COMPONENTS / f"remediation-{backend}" / "rbac.yaml"
    extra = (
        rules_of("ClusterRole", "sdcguard-remediation", component) if component.exists() else set()
    )
    assert denied(fake.requests, BASE | extra, set()) == []
    assert extra <= used(fake.requests), (
        f"{backend}: rules it never uses: {extra - used(fake.requests)}"
    )
    assert extra.isdisjoint(BASE)


@pytest.mark.parametrize("backend", ["kubernetes", "nvsentinel"])
def test_the_overlay_binds_the_component_to_the_recovery_identity(backend: str) -> None:
    rendered = render(DEPLOY / "k8s" / "overlays" / f"remediation-{backend}")
    binding = next(
        d for d in rendered
        if d["kind"] == "ClusterRoleBinding" and d["metadata"]["name"] == "sdcguard-remediation"
    )  # fmt: skip
    assert binding["roleRef"]["name"] == "sdcguard-remediation"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "sdcguard-recovery", "namespace": "sdcguard"}
    ]
    assert any(
        d["kind"] == "Deployment" and d["metadata"]["name"] == "sdcguard-webhook" for d in rendered
    )  # on top of production, not beside it


def test_the_iam_policy_without_hyperpod_is_the_checkpoint_reads_only() -> None:
    iam: Path = DEPLOY / "iam"
    full = json.loads((iam / "sdcguard-recovery-policy.json").read_text())
    reads = json.loads((iam / "sdcguard-checkpoint-policy.json").read_text())
    actions = {a for s in reads["Statement"] for a in s["Action"]}
    assert actions == {"s3:GetObject", "s3:ListBucket"}
    assert all(s in full["Statement"] for s in reads["Statement"])
