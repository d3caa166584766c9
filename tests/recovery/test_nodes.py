"""Node operations on both backends: the official client against the fake API, and the local
simulated cluster — the same scenarios must end in the same node state."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from recovery.errors import (
    ConflictError,
    ForbiddenError,
    NotFoundError,
    PermanentError,
    TemporaryError,
)
from recovery.kube.client import api_client_for_host, make_api_client
from recovery.kube.nodes import KubeNodeOps
from recovery.local.cluster import LocalCluster, NodeRecord
from recovery.local.nodes import LocalNodeOps
from recovery.nodes import (
    ANNOTATION_CORDON_REASON,
    ANNOTATION_CORDONED_AT,
    ANNOTATION_CORDONED_BY,
    ANNOTATION_HEALTH_REQUESTED_BY,
    HEALTH_LABEL,
    LABEL_INCIDENT,
    TAINT_KEY,
    NodeHealth,
    NodeInfo,
    NodeOps,
    Taint,
)
from tests.recovery.fake_kube import FakeKube, FakeResponse, RecordedRequest

INCIDENT = "inc-7f3a"
OTHER_INCIDENT = "inc-0b21"
FOREIGN_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
NODE_PATH = r"^/api/v1/nodes/node-1$"


def _no_sleep(_: float) -> None:
    return None


# -- one scenario, two backends ----------------------------------------------------------


@dataclass
class Backend:
    """A backend under test and a way to seed a node on it the way an outsider would."""

    name: str
    ops: NodeOps
    seed: Callable[..., None]
    fake: FakeKube | None = None


@pytest.fixture(params=["kube", "local"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "kube":
        fake = request.getfixturevalue("fake_kube")
        api_client = request.getfixturevalue("kube_client")

        def seed_kube(name: str, *, unschedulable: bool = False, taints: Any = ()) -> None:
            fake.add_node(
                name, instance_id="i-0aaaabbbbccccdddd", unschedulable=unschedulable, taints=taints
            )

        yield Backend("kube", KubeNodeOps(api_client, conflict_backoff_s=0.0), seed_kube, fake)
        return
    cluster = LocalCluster.create(tmp_path / "cluster.json", nodes=["node-1", "node-2"], spares=[])

    def seed_local(name: str, *, unschedulable: bool = False, taints: Any = ()) -> None:
        # The node exists already; change it as an operator would (through the cluster, not
        # through our NodeOps).
        def outsider(record: NodeRecord) -> None:
            record.unschedulable = unschedulable
            record.taints = [Taint.from_dict(t) for t in taints]

        cluster.update(name, outsider)

    yield Backend("local", LocalNodeOps(cluster), seed_local)


def _ours(info: NodeInfo) -> dict[str, Any]:
    """Everything sdcguard may have written on a node."""
    return {
        "labels": {k: v for k, v in info.labels.items() if k.startswith("sdcguard.io/")},
        "annotations": {k: v for k, v in info.annotations.items() if k.startswith("sdcguard.io/")},
        "taints": [t for t in info.taints if t.key == TAINT_KEY],
    }


def test_cordon_and_taint_record_ownership(backend: Backend) -> None:
    backend.seed("node-1")

    assert backend.ops.cordon("node-1", INCIDENT) is True
    assert backend.ops.taint("node-1", INCIDENT) is True

    info = backend.ops.get("node-1")
    assert info.unschedulable is True
    assert info.labels[LABEL_INCIDENT] == INCIDENT
    assert info.annotations[ANNOTATION_CORDONED_BY] == INCIDENT
    assert info.annotations[ANNOTATION_CORDON_REASON]
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", info.annotations[ANNOTATION_CORDONED_AT]
    )
    assert Taint(TAINT_KEY, INCIDENT, "NoSchedule") in info.taints


def test_cordon_and_taint_are_idempotent(backend: Backend) -> None:
    backend.seed("node-1")
    backend.ops.cordon("node-1", INCIDENT)
    backend.ops.taint("node-1", INCIDENT)
    before = backend.ops.get("node-1")

    assert backend.ops.cordon("node-1", INCIDENT) is False
    assert backend.ops.taint("node-1", INCIDENT) is False

    after = backend.ops.get("node-1")
    assert after.taints == before.taints
    assert dict(after.annotations) == dict(before.annotations)


def test_uncordon_undoes_our_cordon_and_keeps_foreign_taints(backend: Backend) -> None:
    backend.seed("node-1", taints=[FOREIGN_TAINT])
    backend.ops.cordon("node-1", INCIDENT)
    backend.ops.taint("node-1", INCIDENT)

    assert backend.ops.uncordon("node-1", INCIDENT) is True

    info = backend.ops.get("node-1")
    assert info.unschedulable is False
    assert _ours(info) == {"labels": {}, "annotations": {}, "taints": []}
    assert info.taints == (Taint.from_dict(FOREIGN_TAINT),)
    assert backend.ops.uncordon("node-1", INCIDENT) is False  # idempotent


def test_node_cordoned_by_someone_else_stays_cordoned(backend: Backend) -> None:
    backend.seed("node-1", unschedulable=True)

    assert backend.ops.cordon("node-1", INCIDENT) is False  # not ours: no ownership recorded
    assert backend.ops.taint("node-1", INCIDENT) is True
    assert backend.ops.uncordon("node-1", INCIDENT) is False

    info = backend.ops.get("node-1")
    assert info.unschedulable is True
    assert _ours(info) == {"labels": {}, "annotations": {}, "taints": []}  # our taint is gone


def test_another_incident_cannot_uncordon_our_cordon(backend: Backend) -> None:
    backend.seed("node-1")
    backend.ops.cordon("node-1", INCIDENT)
    backend.ops.taint("node-1", INCIDENT)

    assert backend.ops.cordon("node-1", OTHER_INCIDENT) is False
    assert backend.ops.taint("node-1", OTHER_INCIDENT) is False  # one suspect taint per node
    assert backend.ops.uncordon("node-1", OTHER_INCIDENT) is False

    info = backend.ops.get("node-1")
    assert info.unschedulable is True
    assert info.annotations[ANNOTATION_CORDONED_BY] == INCIDENT
    assert Taint(TAINT_KEY, INCIDENT, "NoSchedule") in info.taints


@pytest.mark.parametrize(
    ("first", "second", "second_changes", "final"),
    [
        ("replacement", "reboot", False, NodeHealth.PENDING_REPLACEMENT),  # never downgraded
        ("reboot", "replacement", True, NodeHealth.PENDING_REPLACEMENT),
        ("reboot", "reboot", False, NodeHealth.PENDING_REBOOT),
    ],
)
def test_hyperpod_node_health_label(
    backend: Backend, first: str, second: str, second_changes: bool, final: NodeHealth
) -> None:
    backend.seed("node-1")
    mark = {
        "replacement": backend.ops.mark_for_replacement,
        "reboot": backend.ops.mark_for_reboot,
    }

    assert mark[first]("node-1", INCIDENT) is True
    assert mark[second]("node-1", INCIDENT) is second_changes

    info = backend.ops.get("node-1")
    assert info.labels[HEALTH_LABEL] == final.value
    assert info.annotations[ANNOTATION_HEALTH_REQUESTED_BY] == INCIDENT


def test_health_label_values_are_hyperpods() -> None:
    # The exact strings HyperPod's EKS resiliency documentation lists.
    assert HEALTH_LABEL == "sagemaker.amazonaws.com/node-health-status"
    assert NodeHealth.PENDING_REPLACEMENT == "UnschedulablePendingReplacement"
    assert NodeHealth.PENDING_REBOOT == "UnschedulablePendingReboot"


def test_unknown_node_is_not_found_naming_node_and_verb(backend: Backend) -> None:
    with pytest.raises(NotFoundError) as caught:
        backend.ops.cordon("node-9", INCIDENT)
    assert caught.value.verb == "cordon"
    assert caught.value.target == "node/node-9"
    assert "node-9" in str(caught.value)


def test_invalid_incident_id_is_refused_before_touching_the_node(backend: Backend) -> None:
    backend.seed("node-1")
    with pytest.raises(ValueError, match="label value"):
        backend.ops.cordon("node-1", "incident with spaces")
    assert backend.ops.get("node-1").unschedulable is False


def test_local_eviction_finds_nothing_but_checks_the_node(tmp_path: Path) -> None:
    cluster = LocalCluster.create(tmp_path / "cluster.json", nodes=["node-1"], spares=[])
    result = LocalNodeOps(cluster).evict_pods("node-1")
    assert result.complete
    assert result.evicted == ()
    with pytest.raises(NotFoundError) as caught:
        LocalNodeOps(cluster).evict_pods("node-9")
    assert caught.value.verb == "evict"


# -- Kubernetes specifics: the wire ------------------------------------------------------


@pytest.fixture
def ops(kube_client: k8s.ApiClient) -> KubeNodeOps:
    return KubeNodeOps(
        kube_client,
        conflict_retries=3,
        conflict_backoff_s=0.0,
        eviction_backoff_s=0.0,
        sleep=_no_sleep,
    )


def test_cordon_sends_a_conditional_strategic_merge_patch(
    fake_kube: FakeKube, ops: KubeNodeOps
) -> None:
    stored = fake_kube.add_node("node-1")

    ops.cordon("node-1", INCIDENT)

    (patch,) = fake_kube.requests_to("PATCH", NODE_PATH)
    assert patch.content_type == "application/strategic-merge-patch+json"
    assert patch.body["metadata"]["resourceVersion"] == stored["metadata"]["resourceVersion"]
    assert patch.body["spec"] == {"unschedulable": True}
    node = fake_kube.node("node-1")
    assert node["spec"]["unschedulable"] is True
    assert node["metadata"]["labels"][LABEL_INCIDENT] == INCIDENT
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == "node-1"  # merged, not replaced


def test_idempotent_cordon_sends_no_patch(fake_kube: FakeKube, ops: KubeNodeOps) -> None:
    fake_kube.add_node("node-1")
    ops.cordon("node-1", INCIDENT)
    fake_kube.clear_requests()

    assert ops.cordon("node-1", INCIDENT) is False
    assert fake_kube.requests_to("PATCH", NODE_PATH) == []


def test_injected_conflicts_are_retried(fake_kube: FakeKube, ops: KubeNodeOps) -> None:
    fake_kube.add_node("node-1")
    fake_kube.fail_next("PATCH", NODE_PATH, 409, times=2)

    assert ops.taint("node-1", INCIDENT) is True

    assert len(fake_kube.requests_to("PATCH", NODE_PATH)) == 3
    assert len(fake_kube.requests_to("GET", NODE_PATH)) == 3  # re-read before each attempt
    assert fake_kube.node("node-1")["spec"]["taints"] == [
        {"key": TAINT_KEY, "value": INCIDENT, "effect": "NoSchedule"}
    ]


def test_a_concurrent_writer_loses_nothing(fake_kube: FakeKube, ops: KubeNodeOps) -> None:
    """Another controller adds a taint between our read and our write: the stale
    resourceVersion makes the fake (like the real server) answer 409, we re-read, and both
    taints survive — the whole-list taint patch does not overwrite the other writer."""
    fake_kube.add_node("node-1")
    raced: list[bool] = []

    def racing_read(request: RecordedRequest, _: re.Match[str]) -> FakeResponse:
        answer = fake_kube.serve(request)
        if not raced:
            raced.append(True)
            fake_kube.mutate(
                "/api/v1",
                "nodes",
                "node-1",
                lambda n: n["spec"].setdefault("taints", []).append(FOREIGN_TAINT),
            )
        return answer

    fake_kube.route("GET", NODE_PATH.strip("^$"), racing_read)

    assert ops.taint("node-1", INCIDENT) is True

    patches = fake_kube.requests_to("PATCH", NODE_PATH)
    assert len(patches) == 2
    assert fake_kube.node("node-1")["spec"]["taints"] == [
        FOREIGN_TAINT,
        {"key": TAINT_KEY, "value": INCIDENT, "effect": "NoSchedule"},
    ]


def test_persistent_conflict_raises_conflict_error(fake_kube: FakeKube, ops: KubeNodeOps) -> None:
    fake_kube.add_node("node-1")
    fake_kube.fail_next("PATCH", NODE_PATH, 409, times=None)

    with pytest.raises(ConflictError) as caught:
        ops.cordon("node-1", INCIDENT)

    assert isinstance(caught.value, TemporaryError)  # a flow may retry the action later
    assert (caught.value.verb, caught.value.target) == ("cordon", "node/node-1")
    assert len(fake_kube.requests_to("PATCH", NODE_PATH)) == 4  # 1 + conflict_retries


def test_forbidden_names_node_and_verb(fake_kube: FakeKube, ops: KubeNodeOps) -> None:
    fake_kube.add_node("node-1")
    fake_kube.fail_next("PATCH", NODE_PATH, 403)

    with pytest.raises(ForbiddenError) as caught:
        ops.mark_for_replacement("node-1", INCIDENT)

    assert isinstance(caught.value, PermanentError)
    assert caught.value.verb == "mark-for-replacement"
    assert caught.value.target == "node/node-1"
    assert "forbidden" in caught.value.reason
    assert HEALTH_LABEL not in fake_kube.node("node-1")["metadata"]["labels"]


def test_server_error_is_temporary(fake_kube: FakeKube, ops: KubeNodeOps) -> None:
    fake_kube.add_node("node-1")
    fake_kube.fail_next("GET", NODE_PATH, 500)

    with pytest.raises(TemporaryError) as caught:
        ops.cordon("node-1", INCIDENT)
    assert not isinstance(caught.value, ConflictError)
    assert caught.value.verb == "cordon"


def test_unreachable_api_server_is_temporary() -> None:
    fake = FakeKube().start()
    url = fake.url
    fake.stop()  # nothing listens on that port any more
    api_client = api_client_for_host(url)
    try:
        with pytest.raises(TemporaryError) as caught:
            KubeNodeOps(api_client).get("node-1")
    finally:
        api_client.close()
    assert caught.value.verb == "get"
    assert "connection" in caught.value.reason


def test_get_reads_instance_and_readiness(fake_kube: FakeKube, ops: KubeNodeOps) -> None:
    fake_kube.add_node("node-1", instance_id="i-0123456789abcdef0")
    fake_kube.add_node("hyperpod-i-0fedcba9876543210", ready=False)

    assert ops.get("node-1").instance_id == "i-0123456789abcdef0"
    assert ops.get("node-1").ready is True
    other = ops.get("hyperpod-i-0fedcba9876543210")
    assert (other.instance_id, other.ready) == ("i-0fedcba9876543210", False)


# -- eviction ------------------------------------------------------------------------------


def _seed_pods(fake: FakeKube) -> None:
    fake.add_node("node-1")
    fake.add_pod("trainer-0", namespace="ml", node="node-1", labels={"app": "train"})
    fake.add_pod("trainer-1", namespace="ml", node="node-1", labels={"app": "train"})
    fake.add_pod("logger", namespace="default", node="node-1", labels={"app": "logs"})
    fake.add_pod("dcgm-exporter", namespace="gpu", node="node-1", owner_kind="DaemonSet")
    fake.add_pod("trainer-2", namespace="ml", node="node-2", labels={"app": "train"})


def test_eviction_retries_a_disruption_budget_then_succeeds(
    fake_kube: FakeKube, ops: KubeNodeOps
) -> None:
    _seed_pods(fake_kube)
    fake_kube.block_eviction("ml", "trainer-1", times=2)

    result = ops.evict_pods("node-1")

    assert result.complete
    assert sorted(result.evicted) == ["default/logger", "ml/trainer-0", "ml/trainer-1"]
    assert result.skipped == ("gpu/dcgm-exporter",)
    evictions = fake_kube.requests_to("POST", r"/pods/trainer-1/eviction$")
    assert len(evictions) == 3
    assert evictions[0].body["apiVersion"] == "policy/v1"
    assert fake_kube.pod("trainer-1", "ml") is None
    assert fake_kube.pod("trainer-2", "ml") is not None  # other node: untouched
    assert fake_kube.pod("dcgm-exporter", "gpu") is not None


def test_eviction_reports_pods_still_blocked_after_the_bound(
    fake_kube: FakeKube, ops: KubeNodeOps
) -> None:
    _seed_pods(fake_kube)
    fake_kube.block_eviction("ml", "trainer-1", times=None, budget="trainer-pdb")

    result = ops.evict_pods("node-1", "app=train")

    assert not result.complete
    assert result.evicted == ("ml/trainer-0",)
    (blocked,) = result.blocked
    assert blocked.pod == "ml/trainer-1"
    assert blocked.attempts == 6  # 1 + eviction_retries (5)
    assert "disruption budget" in blocked.reason
    assert fake_kube.pod("trainer-1", "ml") is not None  # never deleted around the budget
    assert fake_kube.pod("logger") is not None  # not selected


def test_eviction_failure_other_than_a_budget_raises(fake_kube: FakeKube, ops: KubeNodeOps) -> None:
    _seed_pods(fake_kube)
    fake_kube.fail_next("POST", r"/eviction$", 403)

    with pytest.raises(ForbiddenError) as caught:
        ops.evict_pods("node-1", "app=train")
    assert caught.value.verb == "evict"
    assert caught.value.target.startswith("pod/ml/")


def test_eviction_backoff_doubles_up_to_the_cap(
    fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    _seed_pods(fake_kube)
    fake_kube.block_eviction("ml", "trainer-0", times=None)
    waits: list[float] = []
    ops = KubeNodeOps(
        kube_client,
        eviction_retries=4,
        eviction_backoff_s=1.0,
        eviction_max_backoff_s=3.0,
        sleep=waits.append,
    )

    result = ops.evict_pods("node-1", "app=train")

    assert waits == [1.0, 2.0, 3.0, 3.0]
    assert [b.pod for b in result.blocked] == ["ml/trainer-0"]


# -- client construction (recovery.kube.client) -------------------------------------------------


def test_kubeconfig_client_reaches_the_server_with_its_token(
    fake_kube: FakeKube, tmp_path: Path
) -> None:
    fake_kube.add_node("node-1")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": fake_kube.url}}],
                "users": [{"name": "operator", "user": {"token": "kubeconfig-token"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "operator"}}],
                "current-context": "fake",
            }
        )
    )
    api_client = make_api_client(kubeconfig=kubeconfig, environ={})
    try:
        assert KubeNodeOps(api_client).get("node-1").name == "node-1"
    finally:
        api_client.close()
    (request,) = fake_kube.requests_to("GET", NODE_PATH)
    assert request.headers["authorization"] == "Bearer kubeconfig-token"


def test_explicit_host_wins_and_bad_configs_are_permanent(
    fake_kube: FakeKube, tmp_path: Path
) -> None:
    fake_kube.add_node("node-1")
    api_client = make_api_client(
        host=fake_kube.url,
        kubeconfig=tmp_path / "missing",
        environ={"KUBERNETES_SERVICE_HOST": "x"},
    )
    try:
        assert KubeNodeOps(api_client).get("node-1").ready
    finally:
        api_client.close()
    with pytest.raises(PermanentError) as caught:
        make_api_client(kubeconfig=tmp_path / "missing", environ={})
    assert caught.value.verb == "connect"
    with pytest.raises(ValueError, match="http"):
        api_client_for_host("127.0.0.1:6443")
