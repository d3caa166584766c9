"""The vote within replicate groups (HSDP): who holds which shard, who is named, the whole."""

from __future__ import annotations

from detection.weights.fingerprint import Fingerprint
from detection.weights.replicas import ReplicaGroups, replica_vote

# A 3x2 HSDP mesh: replicas are rows, shards columns.
MESH = [[0, 1], [2, 3], [4, 5]]
GOOD = {0: Fingerprint(1, 10), 1: Fingerprint(2, 20)}  # shard index -> its fingerprint


def _parts(**changed: Fingerprint) -> list[Fingerprint]:
    groups = ReplicaGroups.of_mesh(MESH)
    parts = [Fingerprint(0, 0)] * 6
    for shard, group in enumerate(groups.groups):
        for rank in group:
            parts[rank] = changed.get(f"r{rank}", GOOD[shard])
    return parts


def test_replicate_groups_are_the_mesh_columns() -> None:
    groups = ReplicaGroups.of_mesh(MESH)
    assert groups.groups == ((0, 2, 4), (1, 3, 5))
    assert (groups.replicas, groups.voting) == (3, True)
    one_copy = ReplicaGroups.of_mesh([[0, 1, 2, 3]])  # FSDP2: each rank its own group
    assert (one_copy.groups, one_copy.voting) == (((0,), (1,), (2,), (3,)), False)


def test_three_replicas_name_the_divergent_rank_and_two_cannot() -> None:
    groups = ReplicaGroups.of_mesh(MESH)
    assert replica_vote(_parts(), groups).passed
    verdict = replica_vote(_parts(r3=Fingerprint(9, 9)), groups)
    assert (verdict.split, verdict.divergent, verdict.culprit_known) == (((1, 3, 5),), (3,), True)
    pair = ReplicaGroups.of_mesh(MESH[:2])
    parts = _parts(r3=Fingerprint(9, 9))[:4]
    verdict = replica_vote(parts, pair)
    assert (verdict.split, verdict.divergent, verdict.culprit_known) == (((1, 3),), (), False)


def test_the_whole_sums_one_copy_of_each_shard_and_each_replica_has_its_own() -> None:
    groups = ReplicaGroups.of_mesh(MESH)
    parts = _parts(r2=Fingerprint(5, 5))  # replica 1's copy of shard 0 is wrong
    assert groups.whole(parts) == Fingerprint(3, 30)
    per_rank = groups.per_rank(parts)
    assert {r for r, fp in per_rank.items() if fp != Fingerprint(3, 30)} == {2, 3}
    wrapped = ReplicaGroups.of_mesh([[0, 1]]).whole([Fingerprint(2**64 - 1, 1), Fingerprint(2, 0)])
    assert wrapped == Fingerprint(1, 1)  # mod 2**64
