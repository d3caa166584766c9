"""The moto extension behaves like the SageMaker API reference says, at the boto3 wire."""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, ParamValidationError

from recovery.aws import moto_hyperpod
from recovery.aws.local import LocalAws, create_demo_cluster
from recovery.errors import PermanentError
from tests.recovery.aws_fixtures import (  # noqa: F401  (fixtures, registered by name)
    CLUSTER,
    GROUP,
    REGION,
    fixture_aws_env,
    fixture_cluster_ids,
    fixture_local_aws,
    fixture_mocked_aws,
    fixture_session,
    fixture_shared_session,
    fixture_transition,
)

EC2_ID = re.compile(r"i-[0-9a-f]{17}")


def _client(session: boto3.session.Session, **config: Any) -> Any:
    return session.client("sagemaker", config=Config(**config) if config else None)


def _states(sagemaker: Any, cluster: str = CLUSTER) -> dict[str, str]:
    nodes = sagemaker.list_cluster_nodes(ClusterName=cluster)["ClusterNodeSummaries"]
    return {n["InstanceId"]: n["InstanceStatus"]["Status"] for n in nodes}


def _error(err: pytest.ExceptionInfo[ClientError]) -> tuple[str, str]:
    return err.value.response["Error"]["Code"], err.value.response["Error"]["Message"]


def test_replace_swaps_in_a_new_instance_in_the_same_group(
    session: boto3.session.Session, cluster_ids: list[str]
) -> None:
    sagemaker = _client(session)
    old = cluster_ids[1]
    answer = sagemaker.batch_replace_cluster_nodes(ClusterName=CLUSTER, NodeIds=[old])
    assert answer["Successful"] == [old]
    assert answer["Failed"] == []

    accepted = _states(sagemaker)
    assert accepted[old] == "Running"  # the request is accepted; HyperPod has not begun
    first = _states(sagemaker)
    assert first[old] == "ShuttingDown"
    second = _states(sagemaker)
    assert old not in second
    (new,) = set(second) - set(cluster_ids)
    assert EC2_ID.fullmatch(new)
    assert second[new] == "Pending"
    third = _states(sagemaker)
    assert third[new] == "Running"
    assert {i: third[i] for i in cluster_ids if i != old} == dict.fromkeys(
        [i for i in cluster_ids if i != old], "Running"
    )
    details = sagemaker.describe_cluster_node(ClusterName=CLUSTER, NodeId=new)["NodeDetails"]
    assert details["InstanceGroupName"] == GROUP
    with pytest.raises(ClientError) as gone:
        sagemaker.describe_cluster_node(ClusterName=CLUSTER, NodeId=old)
    assert _error(gone)[0] == "ResourceNotFound"


def test_second_replace_of_a_node_comes_back_failed_not_as_an_error(
    session: boto3.session.Session, cluster_ids: list[str]
) -> None:
    sagemaker = _client(session)
    target, other = cluster_ids[0], cluster_ids[2]
    sagemaker.batch_replace_cluster_nodes(ClusterName=CLUSTER, NodeIds=[target])

    again = sagemaker.batch_replace_cluster_nodes(
        ClusterName=CLUSTER, NodeIds=[target, other, "i-0123456789abcdef0"]
    )
    assert again["Successful"] == [other]
    failed = {f["NodeId"]: f["ErrorCode"] for f in again["Failed"]}
    assert failed == {target: "InstanceIdInUse", "i-0123456789abcdef0": "InstanceIdNotFound"}
    assert all(f["Message"] for f in again["Failed"])


def test_the_new_node_stays_busy_until_running(
    session: boto3.session.Session,
    cluster_ids: list[str],
    transition: Callable[[str, dict[str, Any]], None],
) -> None:
    # Two reads per step: the batch call below lands while the new node is still Pending.
    transition(moto_hyperpod.REPLACE_MODEL, {"progression": "manual", "times": 2})
    sagemaker = _client(session)
    sagemaker.batch_replace_cluster_nodes(ClusterName=CLUSTER, NodeIds=[cluster_ids[0]])
    seen = [_states(sagemaker) for _ in range(5)]
    assert [s.get(cluster_ids[0]) for s in seen] == [
        "Running",
        "Running",
        "ShuttingDown",
        "ShuttingDown",
        None,
    ]
    (new,) = set(seen[-1]) - set(cluster_ids)
    assert seen[-1][new] == "Pending"

    answer = sagemaker.batch_replace_cluster_nodes(ClusterName=CLUSTER, NodeIds=[new])
    assert [f["ErrorCode"] for f in answer["Failed"]] == ["InstanceIdInUse"]
    assert [_states(sagemaker)[new] for _ in range(2)] == ["Pending", "Running"]
    rebooted = sagemaker.batch_reboot_cluster_nodes(ClusterName=CLUSTER, NodeIds=[new])
    assert rebooted["Successful"] == [new]


def test_reboot_keeps_the_instance_id(
    session: boto3.session.Session, cluster_ids: list[str]
) -> None:
    sagemaker = _client(session)
    node = cluster_ids[3]
    answer = sagemaker.batch_reboot_cluster_nodes(ClusterName=CLUSTER, NodeIds=[node])
    assert answer["Successful"] == [node]
    seen = [
        sagemaker.describe_cluster_node(ClusterName=CLUSTER, NodeId=node)["NodeDetails"][
            "InstanceStatus"
        ]["Status"]
        for _ in range(3)
    ]
    assert seen == ["Pending", "Running", "Running"]
    assert set(_states(sagemaker)) == set(cluster_ids)


def test_more_than_25_ids_is_a_validation_error(
    session: boto3.session.Session, cluster_ids: list[str]
) -> None:
    sagemaker = _client(session)
    ids = [f"i-{n:017x}" for n in range(26)]
    for call in (sagemaker.batch_replace_cluster_nodes, sagemaker.batch_reboot_cluster_nodes):
        with pytest.raises(ClientError) as err:
            call(ClusterName=CLUSTER, NodeIds=ids)
        code, message = _error(err)
        assert code == "ValidationException"
        assert "at 'nodeIds'" in message
        assert "less than or equal to 25" in message
    assert set(_states(sagemaker).values()) == {"Running"}


def test_empty_ids_are_refused_by_botocore_and_by_the_fake(
    session: boto3.session.Session, cluster_ids: list[str]
) -> None:
    with pytest.raises(ParamValidationError):
        _client(session).batch_replace_cluster_nodes(ClusterName=CLUSTER, NodeIds=[])

    raw = _client(session, parameter_validation=False)
    with pytest.raises(ClientError) as empty:
        raw.batch_replace_cluster_nodes(ClusterName=CLUSTER, NodeIds=[])
    assert _error(empty)[0] == "ValidationException"
    assert "greater than or equal to 1" in _error(empty)[1]

    with pytest.raises(ClientError) as neither:
        raw.batch_reboot_cluster_nodes(ClusterName=CLUSTER)
    assert _error(neither) == (
        "ValidationException",
        "Either NodeIds or NodeLogicalIds must be provided.",
    )

    with pytest.raises(ClientError) as nameless:
        raw.batch_reboot_cluster_nodes(NodeIds=[cluster_ids[0]])
    assert _error(nameless)[0] == "ValidationException"
    assert "clusterName" in _error(nameless)[1]


def test_unknown_cluster_is_resource_not_found(
    session: boto3.session.Session, cluster_ids: list[str]
) -> None:
    with pytest.raises(ClientError) as err:
        _client(session).batch_replace_cluster_nodes(
            ClusterName="no-such-cluster", NodeIds=[cluster_ids[0]]
        )
    assert _error(err)[0] == "ResourceNotFound"


def test_logical_ids_are_reported_unknown(
    session: boto3.session.Session, cluster_ids: list[str]
) -> None:
    answer = _client(session).batch_reboot_cluster_nodes(
        ClusterName=CLUSTER, NodeLogicalIds=["node-logical-1"]
    )
    assert answer["Successful"] == []
    assert answer["FailedNodeLogicalIds"] == [
        {
            "NodeLogicalId": "node-logical-1",
            "ErrorCode": "InstanceIdNotFound",
            "Message": f"Node node-logical-1 does not exist in cluster {CLUSTER}.",
        }
    ]


def test_install_twice_wraps_once(session: boto3.session.Session, cluster_ids: list[str]) -> None:
    moto_hyperpod.install()
    moto_hyperpod.install()
    assert moto_hyperpod.is_installed()
    lists_before = moto_hyperpod.call_count("ListClusterNodes", region=REGION)
    sagemaker = _client(session)
    sagemaker.batch_replace_cluster_nodes(ClusterName=CLUSTER, NodeIds=[cluster_ids[0]])
    # A doubly wrapped list would tick twice per call and skip a state.
    assert _states(sagemaker)[cluster_ids[0]] == "Running"
    assert _states(sagemaker)[cluster_ids[0]] == "ShuttingDown"
    assert "Pending" in _states(sagemaker).values()
    assert moto_hyperpod.call_count("ListClusterNodes", region=REGION) == lists_before + 3


def test_immediate_transition_finishes_at_the_first_read(
    session: boto3.session.Session,
    cluster_ids: list[str],
    transition: Callable[[str, dict[str, Any]], None],
) -> None:
    transition(moto_hyperpod.REPLACE_MODEL, {"progression": "immediate"})
    sagemaker = _client(session)
    sagemaker.batch_replace_cluster_nodes(ClusterName=CLUSTER, NodeIds=[cluster_ids[0]])
    states = _states(sagemaker)
    assert cluster_ids[0] not in states
    assert set(states.values()) == {"Running"}
    assert len(states) == len(cluster_ids)


def test_injected_throttling_answers_throttling_exception(
    session: boto3.session.Session, cluster_ids: list[str]
) -> None:
    moto_hyperpod.inject_throttling("DescribeClusterNode", 1, region=REGION)
    no_retries = _client(session, retries={"mode": "standard", "total_max_attempts": 1})
    with pytest.raises(ClientError) as err:
        no_retries.describe_cluster_node(ClusterName=CLUSTER, NodeId=cluster_ids[0])
    assert _error(err)[0] == "ThrottlingException"
    node = no_retries.describe_cluster_node(ClusterName=CLUSTER, NodeId=cluster_ids[0])
    assert node["NodeDetails"]["InstanceId"] == cluster_ids[0]
    assert moto_hyperpod.call_count("DescribeClusterNode", region=REGION) == 2
    with pytest.raises(ValueError, match="unknown operation"):
        moto_hyperpod.inject_throttling("DeleteCluster", 1)


def test_demo_cluster_is_reused_when_it_matches(
    session: boto3.session.Session, cluster_ids: list[str]
) -> None:
    assert create_demo_cluster(session, CLUSTER, len(cluster_ids), GROUP) == cluster_ids
    with pytest.raises(PermanentError, match=f"has {len(cluster_ids)} nodes"):
        create_demo_cluster(session, CLUSTER, len(cluster_ids) + 1, GROUP)


def test_server_runs_the_extension_and_moto_api_transitions(local_aws: LocalAws) -> None:
    cluster = f"srv-{uuid.uuid4().hex[:8]}"
    ids = create_demo_cluster(local_aws, cluster, 2)
    request = urllib.request.Request(
        f"{local_aws.endpoint_url}/moto-api/state-manager/set-transition",
        data=json.dumps(
            {
                "model_name": moto_hyperpod.REBOOT_MODEL,
                "transition": {"progression": "manual", "times": 2},
            }
        ).encode(),
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 201
        sagemaker = local_aws.client("sagemaker")
        answer = sagemaker.batch_reboot_cluster_nodes(ClusterName=cluster, NodeIds=[ids[0]])
        assert answer["Successful"] == [ids[0]]
        statuses = [_states(sagemaker, cluster)[ids[0]] for _ in range(3)]
        assert statuses == ["Pending", "Pending", "Running"]
    finally:
        unset = urllib.request.Request(
            f"{local_aws.endpoint_url}/moto-api/state-manager/unset-transition",
            data=json.dumps({"model_name": moto_hyperpod.REBOOT_MODEL}).encode(),
            method="POST",
        )
        with urllib.request.urlopen(unset, timeout=10):
            pass
