"""HyperPod adapter against moto (in-process and a local moto server)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from recovery.aws import moto_hyperpod
from recovery.aws.hyperpod import INSTANCE_ID_LABEL, HyperPod, sagemaker_client
from recovery.aws.hyperpod_nodes import (
    AlreadyReplacing,
    AmbiguousReplacement,
    BatchAction,
    MissingBaseline,
    NodeStatus,
    WaitTimeout,
)
from recovery.aws.local import LocalAws, create_demo_cluster
from recovery.errors import (
    ConflictError,
    ForbiddenError,
    NotFoundError,
    PermanentError,
    TemporaryError,
    ThrottledError,
)
from tests.recovery.aws_fixtures import (  # noqa: F401  (fixtures, registered by name)
    CLUSTER,
    GROUP,
    NODE_COUNT,
    REGION,
    fixture_aws_env,
    fixture_cluster_ids,
    fixture_local_aws,
    fixture_mocked_aws,
    fixture_session,
    fixture_shared_session,
    fixture_transition,
)


class FakeClock:
    """Monotonic time that moves only when the adapter sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _hyperpod(
    session: boto3.session.Session,
    clock: FakeClock | None = None,
    *,
    max_attempts: int = 3,
    wait_timeout_s: float = 600.0,
) -> HyperPod:
    clock = clock or FakeClock()
    client = sagemaker_client(REGION, max_attempts=max_attempts, session=session)
    return HyperPod(
        client,
        CLUSTER,
        poll_interval_s=10.0,
        wait_timeout_s=wait_timeout_s,
        clock=clock,
        sleep=clock.sleep,
    )


def test_replace_then_wait_gives_a_new_running_instance(
    session: boto3.session.Session, cluster_ids: list[str]
) -> None:
    clock = FakeClock()
    hyperpod = _hyperpod(session, clock)
    old = cluster_ids[2]

    result = hyperpod.replace([old])
    assert result.action is BatchAction.REPLACE
    assert result.successful == (old,)
    assert result.ok
    assert result.members_before == {GROUP: frozenset(cluster_ids)}

    new = hyperpod.wait_replaced(old, GROUP)
    assert new not in cluster_ids
    node = hyperpod.describe(new)
    assert node.group == GROUP
    assert node.status == NodeStatus.RUNNING
    assert node.launch_time is not None
    with pytest.raises(NotFoundError):
        hyperpod.describe(old)
    assert {n.instance_id for n in hyperpod.list_nodes(GROUP)} == (set(cluster_ids) - {old}) | {new}
    # Still Running (accepted), ShuttingDown, then Pending, then Running: three pauses.
    assert clock.sleeps == [10.0, 10.0, 10.0]


def test_two_replacements_in_one_group_get_distinct_new_nodes(
    session: boto3.session.Session, cluster_ids: list[str]
) -> None:
    hyperpod = _hyperpod(session)
    first, second = cluster_ids[0], cluster_ids[1]
    assert hyperpod.replace([first, second]).successful == (first, second)
    new_first = hyperpod.wait_replaced(first, GROUP)
    new_second = hyperpod.wait_replaced(second, GROUP)
    assert len({new_first, new_second} | set(cluster_ids)) == len(cluster_ids) + 2


def test_double_replace_is_refused_before_calling_aws_or_by_aws(
    session: boto3.session.Session,
    cluster_ids: list[str],
    transition: Callable[[str, dict[str, Any]], None],
) -> None:
    transition(moto_hyperpod.REPLACE_MODEL, {"progression": "manual", "times": 3})
    hyperpod = _hyperpod(session)
    target = cluster_ids[0]
    hyperpod.replace(target)
    calls = moto_hyperpod.call_count("BatchReplaceClusterNodes", region=REGION)

    with pytest.raises(AlreadyReplacing) as ours:
        hyperpod.replace([target])
    assert ours.value.instance_ids == (target,)

    assert moto_hyperpod.call_count("BatchReplaceClusterNodes", region=REGION) == calls

    # A second adapter (a re-run flow) has no memory of the first. Right after the request
    # HyperPod still reports the node Running, so the call is made and AWS refuses it per node;
    # once the node is ShuttingDown, the status stops the call before it is made.
    again = _hyperpod(session).replace([target])  # reads 1-2: still Running
    assert again.successful == ()
    assert [(f.instance_id, f.code) for f in again.failed] == [(target, "InstanceIdInUse")]
    assert hyperpod.describe(target).status == NodeStatus.RUNNING  # read 3
    with pytest.raises(AlreadyReplacing, match="ShuttingDown"):  # read 4: ShuttingDown
        _hyperpod(session).replace([target, cluster_ids[1]])
    assert moto_hyperpod.call_count("BatchReplaceClusterNodes", region=REGION) == calls + 1


def test_in_use_node_comes_back_as_a_typed_failure(
    session: boto3.session.Session,
    cluster_ids: list[str],
    transition: Callable[[str, dict[str, Any]], None],
) -> None:
    # A reboot still in flight: our guard lets a Pending node through, AWS refuses it per node.
    transition(moto_hyperpod.REBOOT_MODEL, {"progression": "manual", "times": 1_000})
    hyperpod = _hyperpod(session)
    busy, free = cluster_ids[0], cluster_ids[1]
    hyperpod.reboot([busy])

    result = hyperpod.replace([busy, free])
    assert result.successful == (free,)
    (failure,) = result.failed
    assert (failure.instance_id, failure.code) == (busy, "InstanceIdInUse")
    assert not result.ok
    with pytest.raises(ConflictError, match="InstanceIdInUse"):
        result.raise_for_failures()


def test_reboot_keeps_the_instance_id(
    session: boto3.session.Session, cluster_ids: list[str]
) -> None:
    clock = FakeClock()
    hyperpod = _hyperpod(session, clock)
    node = cluster_ids[3]
    result = hyperpod.reboot(node)
    assert result.action is BatchAction.REBOOT
    assert result.successful == (node,)
    assert hyperpod.wait_running(node).instance_id == node
    assert clock.sleeps == [10.0]
    assert {n.instance_id for n in hyperpod.list_nodes()} == set(cluster_ids)


def test_batch_size_is_checked_before_calling_aws(
    session: boto3.session.Session, cluster_ids: list[str]
) -> None:
    hyperpod = _hyperpod(session)
    for ids in ([], [f"i-{n:017x}" for n in range(26)]):
        with pytest.raises(PermanentError, match="1 to 25"):
            hyperpod.replace(ids)
        with pytest.raises(PermanentError, match="1 to 25"):
            hyperpod.reboot(ids)
    assert moto_hyperpod.call_count("BatchReplaceClusterNodes", region=REGION) == 0
    assert moto_hyperpod.call_count("BatchRebootClusterNodes", region=REGION) == 0


def test_unknown_instances(session: boto3.session.Session, cluster_ids: list[str]) -> None:
    hyperpod = _hyperpod(session)
    unknown = "i-0123456789abcdef0"
    with pytest.raises(NotFoundError) as described:
        hyperpod.replace([unknown])
    assert described.value.system == "hyperpod"
    assert described.value.verb == "describe"
    assert described.value.target == f"{CLUSTER}/{unknown}"

    result = hyperpod.reboot([cluster_ids[0], unknown])
    assert result.successful == (cluster_ids[0],)
    assert [(f.instance_id, f.code) for f in result.failed] == [(unknown, "InstanceIdNotFound")]
    with pytest.raises(NotFoundError, match="InstanceIdNotFound"):
        result.raise_for_failures()


def test_throttling_is_retried_by_botocore(
    session: boto3.session.Session, cluster_ids: list[str]
) -> None:
    moto_hyperpod.inject_throttling("BatchRebootClusterNodes", 2, region=REGION)
    result = _hyperpod(session, max_attempts=3).reboot([cluster_ids[0]])
    assert result.successful == (cluster_ids[0],)
    assert moto_hyperpod.call_count("BatchRebootClusterNodes", region=REGION) == 3


def test_throttling_beyond_the_attempts_is_throttled_error(
    session: boto3.session.Session, cluster_ids: list[str]
) -> None:
    moto_hyperpod.inject_throttling("BatchRebootClusterNodes", 2, region=REGION)
    with pytest.raises(ThrottledError) as err:
        _hyperpod(session, max_attempts=2).reboot([cluster_ids[0]])
    assert isinstance(err.value, TemporaryError)
    assert "ThrottlingException" in err.value.reason
    assert moto_hyperpod.call_count("BatchRebootClusterNodes", region=REGION) == 2


def test_wait_replaced_times_out_with_what_it_saw(
    session: boto3.session.Session,
    cluster_ids: list[str],
    transition: Callable[[str, dict[str, Any]], None],
) -> None:
    transition(moto_hyperpod.REPLACE_MODEL, {"progression": "manual", "times": 1_000})
    clock = FakeClock()
    hyperpod = _hyperpod(session, clock, wait_timeout_s=35.0)
    hyperpod.replace([cluster_ids[0]])
    with pytest.raises(WaitTimeout) as err:
        hyperpod.wait_replaced(cluster_ids[0], GROUP)
    assert isinstance(err.value, TemporaryError)
    assert "after 35 s" in str(err.value)
    assert "old instance still Running" in str(err.value)  # accepted, not begun
    assert clock.sleeps == [10.0, 10.0, 10.0, 5.0]


def test_wait_running_times_out(
    session: boto3.session.Session,
    cluster_ids: list[str],
    transition: Callable[[str, dict[str, Any]], None],
) -> None:
    transition(moto_hyperpod.REBOOT_MODEL, {"progression": "manual", "times": 1_000})
    hyperpod = _hyperpod(session, wait_timeout_s=20.0)
    hyperpod.reboot([cluster_ids[1]])
    with pytest.raises(WaitTimeout, match="still Pending after 20 s"):
        hyperpod.wait_running(cluster_ids[1])


def test_wait_replaced_in_a_new_adapter(
    session: boto3.session.Session, cluster_ids: list[str]
) -> None:
    result = _hyperpod(session).replace([cluster_ids[0]])

    # The members recorded at replace time identify the new node from another process.
    resumed = _hyperpod(session)
    new = resumed.wait_replaced(cluster_ids[0], GROUP, known_ids=result.members_before[GROUP])
    assert new not in cluster_ids

    # Without them, a wait that starts after the old node is gone cannot tell: it says so.
    with pytest.raises(MissingBaseline):
        _hyperpod(session).wait_replaced(cluster_ids[0], GROUP)


def test_instance_for_maps_kubernetes_nodes(
    session: boto3.session.Session, cluster_ids: list[str]
) -> None:
    hyperpod = _hyperpod(session)
    hyperpod.replace([cluster_ids[0]])
    new = hyperpod.wait_replaced(cluster_ids[0], GROUP)

    assert hyperpod.instance_for(f"hyperpod-{new}") == new
    assert hyperpod.instance_for("node-7", {INSTANCE_ID_LABEL: cluster_ids[1]}) == cluster_ids[1]
    # moto names its own nodes <group>-<n>; the list fallback finds them by id.
    assert hyperpod.instance_for(f"hyperpod-{cluster_ids[2]}") == cluster_ids[2]
    assert hyperpod.instance_for(cluster_ids[3]) == cluster_ids[3]

    with pytest.raises(NotFoundError):
        hyperpod.instance_for("node-7")
    with pytest.raises(NotFoundError):
        hyperpod.instance_for(f"hyperpod-{cluster_ids[0]}")  # replaced: gone
    with pytest.raises(NotFoundError):
        hyperpod.instance_for("node-7", {INSTANCE_ID_LABEL: cluster_ids[0]})


@pytest.mark.parametrize(
    ("code", "status", "expected"),
    [
        ("ThrottlingException", 400, ThrottledError),
        ("ResourceNotFound", 400, NotFoundError),
        ("ValidationException", 400, PermanentError),
        ("AccessDeniedException", 400, ForbiddenError),
        ("InternalFailure", 500, TemporaryError),
        ("ConflictException", 400, ConflictError),
    ],
)
def test_client_errors_map_to_the_recovery_hierarchy(
    session: boto3.session.Session, code: str, status: int, expected: type[Exception]
) -> None:
    client = sagemaker_client(REGION, max_attempts=1, session=session)
    with Stubber(client) as stub:
        stub.add_client_error(
            "describe_cluster_node", service_error_code=code, http_status_code=status
        )
        with pytest.raises(expected) as err:
            HyperPod(client, CLUSTER).describe("i-0123456789abcdef0")
    assert type(err.value) is expected
    assert err.value.__cause__ is not None


def test_from_settings_configures_botocore_retries() -> None:
    hyperpod = HyperPod.from_settings(
        CLUSTER,
        REGION,
        "http://127.0.0.1:1",
        max_attempts=5,
        retry_mode="adaptive",
        session=boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing"),
    )
    client = hyperpod._client
    assert client.meta.config.retries == {"mode": "adaptive", "total_max_attempts": 5}
    assert client.meta.endpoint_url == "http://127.0.0.1:1"
    assert hyperpod.cluster_name == CLUSTER
    with pytest.raises(ValueError, match="retry_mode"):
        sagemaker_client(REGION, retry_mode="legacy")


def test_replace_flow_against_a_moto_server(
    local_aws: LocalAws, transition: Callable[[str, dict[str, Any]], None]
) -> None:
    transition(moto_hyperpod.REPLACE_MODEL, {"progression": "manual", "times": 3})
    cluster = f"srv-{uuid.uuid4().hex[:8]}"
    ids = create_demo_cluster(local_aws, cluster, 3)
    hyperpod = HyperPod.from_settings(
        cluster,
        local_aws.region,
        local_aws.endpoint_url,
        session=local_aws.session(),
        poll_interval_s=0.0,
        wait_timeout_s=30.0,
    )
    old = hyperpod.instance_for(f"hyperpod-{ids[1]}")
    assert hyperpod.replace([old]).successful == (old,)
    other = HyperPod.from_settings(
        cluster, local_aws.region, local_aws.endpoint_url, session=local_aws.session()
    )
    assert [f.code for f in other.replace([old]).failed] == ["InstanceIdInUse"]  # reads 1-2
    assert other.describe(old).running  # read 3
    with pytest.raises(AlreadyReplacing):  # read 4: ShuttingDown
        other.replace([old])
    new = hyperpod.wait_replaced(old, GROUP)
    assert new not in ids
    assert hyperpod.describe(new).running
    with pytest.raises(NotFoundError):
        hyperpod.describe(old)


def _successor_under(sagemaker: Any, logical_id: str) -> str:
    node = sagemaker.describe_cluster_node(ClusterName=CLUSTER, NodeLogicalId=logical_id)
    return str(node["NodeDetails"]["InstanceId"])


def test_with_logical_ids_the_new_node_is_the_one_under_the_old_nodes_logical_id(
    mocked_aws: None, shared_session: boto3.session.Session
) -> None:
    """Another replacement in the same group (HyperPod's auto-recovery, another incident) runs
    a step ahead of ours: its new node is Running first, and is still not taken for ours."""
    ids = create_demo_cluster(shared_session, CLUSTER, NODE_COUNT, GROUP, continuous=True)
    clock = FakeClock()
    hyperpod = _hyperpod(shared_session, clock)
    ours, theirs = ids[1], ids[2]
    sagemaker = shared_session.client("sagemaker")
    logical = {n.instance_id: n.logical_id for n in hyperpod.list_nodes(GROUP)}
    assert all(logical.values())
    assert sagemaker.batch_replace_cluster_nodes(ClusterName=CLUSTER, NodeIds=[theirs])[
        "Successful"
    ] == [theirs]

    result = hyperpod.replace([ours])
    assert result.logical_ids == {ours: logical[ours]}
    new = hyperpod.wait_replaced(ours, GROUP, known_ids=result.members_before[GROUP])

    assert new == _successor_under(sagemaker, str(logical[ours]))
    foreign = _successor_under(sagemaker, str(logical[theirs]))
    assert foreign != theirs  # the other replacement finished, and first
    assert new not in {*ids, foreign}
    # a new adapter (a re-run flow) given only the logical id finds the same node
    assert _hyperpod(shared_session).wait_replaced(ours, GROUP, logical_id=logical[ours]) == new


def test_without_logical_ids_a_foreign_departure_is_ambiguous_never_ours(
    session: boto3.session.Session, cluster_ids: list[str]
) -> None:
    hyperpod = _hyperpod(session)
    ours, theirs = cluster_ids[1], cluster_ids[2]
    sagemaker = session.client("sagemaker")
    sagemaker.batch_replace_cluster_nodes(ClusterName=CLUSTER, NodeIds=[theirs])
    result = hyperpod.replace([ours])
    assert result.logical_ids == {}

    with pytest.raises(AmbiguousReplacement, match=theirs) as err:
        hyperpod.wait_replaced(ours, GROUP, known_ids=result.members_before[GROUP])
    assert "map the new node by hand" in str(err.value)

    # the clean run: our departure alone is accounted for, and the new node is ours
    clean = _hyperpod(session)
    other = cluster_ids[3]
    again = clean.replace([other])
    new = clean.wait_replaced(other, GROUP, known_ids=again.members_before[GROUP])
    assert new not in {*cluster_ids, *again.members_before[GROUP]}
