"""The simulated cluster's counterparts of the Kubernetes remediations converge as the real ones:
a repeat after a crash retires the node once and joins one new node; a fault is recorded once
and its release removes only our record."""

from __future__ import annotations

from pathlib import Path

import pytest

from recovery.local.cluster import LocalCluster, NodeRecord, NodeState
from recovery.local.remediation import (
    ANNOTATION_EXTERNAL_FAULT,
    LocalFaultRemediation,
    LocalReplaceRemediation,
)
from recovery.remediation import RemediationOutcome, RemediationVerb, UnsupportedRemediation

REPLACE = RemediationVerb.REPLACE


@pytest.fixture
def cluster(tmp_path: Path) -> LocalCluster:
    return LocalCluster.create(tmp_path / "cluster.json", ["node-0", "node-1"], ["node-2"])


def test_replace_after_a_crash_retires_the_node_once_and_joins_one_new_node(
    cluster: LocalCluster,
) -> None:
    remediation = LocalReplaceRemediation(cluster)
    plan = remediation.plan("node-1", "inc-1", REPLACE)
    remediation.start(plan, first=True)
    assert cluster.node("node-1").ready is False  # deleted: leaving
    first = remediation.wait(plan, timeout_s=1, taken=set())

    LocalReplaceRemediation(cluster).start(plan, first=False)  # a re-run: the node is gone
    again = LocalReplaceRemediation(cluster).wait(plan, timeout_s=1, taken=set())

    assert first == again
    assert first["outcome"] == RemediationOutcome.REPLACED.value
    records = {r.name: r for r in cluster.records()}
    assert records["node-1"].state is NodeState.GONE
    assert [r.name for r in records.values() if r.replaces == "node-1"] == [first["new_node"]]
    assert cluster.node("node-0").ready  # the unaccused node: as it was
    with pytest.raises(UnsupportedRemediation):
        remediation.plan("node-0", "inc-1", RemediationVerb.REBOOT)


def test_a_fault_is_recorded_once_restored_in_place_and_release_removes_only_ours(
    cluster: LocalCluster,
) -> None:
    remediation = LocalFaultRemediation(cluster)
    plan = remediation.plan("node-1", "inc-1", REPLACE)
    remediation.start(plan, first=True)
    remediation.start(plan, first=False)
    result = remediation.wait(plan, timeout_s=1, taken=set())

    assert (result["outcome"], result["new_node"]) == (RemediationOutcome.RESTORED.value, "node-1")
    assert cluster.node("node-1").annotations[ANNOTATION_EXTERNAL_FAULT] == plan["fault"]
    assert remediation.release(result, "inc-1") is True
    assert remediation.release(result, "inc-1") is False

    def foreign(record: NodeRecord) -> None:
        record.annotations[ANNOTATION_EXTERNAL_FAULT] = "raised-by-someone-else"

    cluster.update("node-1", foreign)
    assert remediation.release(result, "inc-1") is False
    assert cluster.node("node-1").annotations[ANNOTATION_EXTERNAL_FAULT] == "raised-by-someone-else"
    assert ANNOTATION_EXTERNAL_FAULT not in cluster.node("node-0").annotations
