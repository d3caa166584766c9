"""The simulated cluster's state file: contents, replacement, and writes from many processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from recovery.errors import NotFoundError, PermanentError
from recovery.local.cluster import LocalCluster, NodeRecord, NodeState, default_instance_id

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cluster(tmp_path: Path) -> LocalCluster:
    return LocalCluster.create(
        tmp_path / "state" / "cluster.json",
        nodes=["node-0", "node-1", "node-2", "node-3"],
        spares=["node-4", "node-5"],
        instance_ids={"node-2": "i-0222222222222222a"},
    )


def test_create_lists_nodes_with_instances(cluster: LocalCluster) -> None:
    nodes = cluster.nodes()
    assert [n.name for n in nodes] == [f"node-{i}" for i in range(6)]
    assert cluster.node("node-2").instance_id == "i-0222222222222222a"
    assert cluster.node("node-0").instance_id == default_instance_id("node-0")
    assert all(re.fullmatch(r"i-[0-9a-f]{17}", n.instance_id or "") for n in nodes)
    assert all(n.ready and not n.unschedulable and not n.taints for n in nodes)
    assert cluster.node_for_instance("i-0222222222222222a") == "node-2"


def test_create_refuses_duplicates(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unique"):
        LocalCluster.create(tmp_path / "c.json", nodes=["node-0"], spares=["node-0"])
    with pytest.raises(ValueError, match="unknown nodes"):
        LocalCluster.create(
            tmp_path / "c.json", nodes=["node-0"], spares=[], instance_ids={"x": "i-1"}
        )


def test_spares_are_ready_uncordoned_and_not_excluded(cluster: LocalCluster) -> None:
    assert cluster.spares() == ["node-4", "node-5"]
    assert cluster.spares(exclude=["node-4"]) == ["node-5"]

    def cordon(record: NodeRecord) -> None:
        record.unschedulable = True

    cluster.update("node-4", cordon)
    assert cluster.spares() == ["node-5"]
    cluster.set_state("node-5", NodeState.REPLACING)
    assert cluster.spares() == []
    assert cluster.node("node-5").ready is False


def test_state_is_shared_through_the_file(cluster: LocalCluster) -> None:
    def label(record: NodeRecord) -> str:
        record.labels["team"] = "ml"
        return record.name

    assert cluster.update("node-1", label) == "node-1"
    assert LocalCluster(cluster.path).node("node-1").labels["team"] == "ml"


def test_failed_update_writes_nothing(cluster: LocalCluster) -> None:
    before = cluster.path.read_bytes()

    def half_done(record: NodeRecord) -> None:
        record.unschedulable = True
        raise RuntimeError("changed my mind")

    with pytest.raises(RuntimeError):
        cluster.update("node-1", half_done)

    def rename(record: NodeRecord) -> None:
        record.instance_id = "i-0000000000000000f"

    with pytest.raises(ValueError, match="identity"):
        cluster.update("node-1", rename)
    assert cluster.path.read_bytes() == before


def test_replace_instance_joins_a_new_node(cluster: LocalCluster) -> None:
    def suspect(record: NodeRecord) -> None:
        record.unschedulable = True
        record.labels["sdcguard.io/incident"] = "inc-1"

    cluster.update("node-2", suspect)

    new = cluster.replace_instance("node-2", "i-0abcdefabcdefabcd")

    assert new == "node-6"  # next free node-N; node-2 is never reused
    info = cluster.node(new)
    assert info.instance_id == "i-0abcdefabcdefabcd"
    assert info.ready
    assert not info.unschedulable
    assert dict(info.labels) == {}
    with pytest.raises(NotFoundError) as caught:
        cluster.node("node-2")
    assert "replaced by node-6" in str(caught.value)
    assert "node-2" not in [n.name for n in cluster.nodes()]
    old = next(r for r in cluster.records() if r.name == "node-2")
    assert (old.state, old.replaced_by) == (NodeState.GONE, "node-6")
    assert cluster.node_for_instance("i-0abcdefabcdefabcd") == "node-6"
    with pytest.raises(NotFoundError):
        cluster.node_for_instance("i-0222222222222222a")


def test_replace_instance_is_idempotent_and_checked(cluster: LocalCluster) -> None:
    first = cluster.replace_instance("node-1", "i-0abcdefabcdefabcd")
    assert cluster.replace_instance("node-1", "i-0abcdefabcdefabcd") == first
    with pytest.raises(NotFoundError, match="already replaced"):
        cluster.replace_instance("node-1", "i-0fffffffffffffff0")
    with pytest.raises(PermanentError, match="already backs"):
        cluster.replace_instance("node-3", "i-0abcdefabcdefabcd")
    with pytest.raises(NotFoundError):
        cluster.replace_instance("node-42", "i-0fffffffffffffff0")
    spare = cluster.replace_instance("node-4", "i-0eeeeeeeeeeeeeee0")
    assert spare in cluster.spares()  # a replaced spare's successor is a spare


def test_missing_or_corrupt_state_is_a_typed_error(tmp_path: Path, cluster: LocalCluster) -> None:
    with pytest.raises(NotFoundError):
        LocalCluster(tmp_path / "nowhere.json")
    cluster.path.write_text("{not json")
    with pytest.raises(PermanentError, match="corrupt"):
        cluster.nodes()


_WRITER = """
import sys
from recovery.local.cluster import LocalCluster

path, worker, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
cluster = LocalCluster(path)

def bump(record):
    record.annotations["count"] = str(int(record.annotations.get("count", "0")) + 1)
    record.labels[f"writer-{worker}"] = str(int(record.labels.get(f"writer-{worker}", "0")) + 1)

for number in range(rounds):
    cluster.update("node-0", bump)
    cluster.update(f"node-{1 + number % 3}", bump)
"""


def test_concurrent_updates_from_processes_lose_nothing(cluster: LocalCluster) -> None:
    """Several processes hammer the same nodes with read-modify-writes; every increment must
    survive (without the lock, concurrent read-modify-writes would overwrite each other)."""
    workers, rounds = 4, 30
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(cluster.path), str(w), str(rounds)], cwd=REPO
        )
        for w in range(workers)
    ]
    assert [p.wait(timeout=120) for p in processes] == [0] * workers

    hot = cluster.node("node-0")
    assert hot.annotations["count"] == str(workers * rounds)
    assert {k: v for k, v in hot.labels.items()} == {
        f"writer-{w}": str(rounds) for w in range(workers)
    }
    spread = sum(int(cluster.node(f"node-{i}").annotations["count"]) for i in (1, 2, 3))
    assert spread == workers * rounds
    json.loads(cluster.path.read_text())  # and the file is whole
    assert not list(cluster.path.parent.glob("*.tmp"))
