"""Node-level attribution of ring-audit mismatches: the smallest set of nodes, then ranks."""

from __future__ import annotations

import itertools

import pytest

from detection.audit.attribution import attribute_pairs, minimum_covers
from detection.audit.ring import attribute_audit, ring_partners


def _mismatches_of(nodes: list[str], faulty_ranks: set[int]) -> list[tuple[int, int]]:
    """The pairs a persistent fault of ``faulty_ranks`` makes disagree on the real ring: every
    pair with a faulty auditor (wrong recomputation) or a faulty audited rank (wrong own)."""
    partners = ring_partners(nodes)
    return [(a, b) for a, b in enumerate(partners) if a in faulty_ranks or b in faulty_ranks]


def _layout(n_nodes: int, per_node: int) -> list[str]:
    return [f"node-{r // per_node}" for r in range(n_nodes * per_node)]


@pytest.mark.parametrize(("n_nodes", "per_node"), [(4, 2), (16, 8), (3, 4), (8, 8)])
def test_a_persistent_node_fault_names_that_node_alone(n_nodes: int, per_node: int) -> None:
    nodes = _layout(n_nodes, per_node)
    for faulty in (0, n_nodes // 2, n_nodes - 1):
        ranks = {r for r, n in enumerate(nodes) if n == f"node-{faulty}"}
        verdict = attribute_pairs(_mismatches_of(nodes, ranks), nodes)
        assert verdict.nodes == (f"node-{faulty}",)
        assert verdict.ranks == tuple(sorted(ranks))
        assert not verdict.ambiguous


def test_sixteen_by_eight_node_zero_does_not_name_node_eight() -> None:
    nodes = _layout(16, 8)
    mismatches = _mismatches_of(nodes, set(range(8)))
    verdict = attribute_pairs(mismatches, nodes)
    assert verdict.nodes == ("node-0",)
    assert verdict.ranks == tuple(range(8))
    # Through the audit entry point too, with real own/recomputed values.
    partners = ring_partners(nodes)
    wrong = [[1 if r < 8 else 0] for r in range(128)]  # node-0 errs in both roles
    own, replay = wrong, wrong  # a healthy rank's recomputation is the right value, 0
    assert attribute_audit(partners, own, replay, nodes).suspects == tuple(range(8))


def test_a_single_rank_fault_among_several_per_node_names_that_rank() -> None:
    nodes = _layout(4, 2)
    verdict = attribute_pairs(_mismatches_of(nodes, {5}), nodes)
    assert verdict.nodes == ("node-2",)
    assert verdict.ranks == (5,)


def test_two_nodes_cannot_be_told_apart_and_the_verdict_says_ambiguous() -> None:
    nodes = _layout(2, 2)
    verdict = attribute_pairs(_mismatches_of(nodes, {0, 1}), nodes)
    assert verdict.ambiguous
    assert verdict.alternatives == (("node-0",), ("node-1",))
    assert verdict.nodes == ("node-0", "node-1")
    assert verdict.to_detail()["ambiguous"] is True


def test_a_lone_pair_names_both_sides_as_ambiguous() -> None:
    verdict = attribute_pairs([(0, 2)], ["a", "b", "c", "d"])
    assert verdict.ranks == (0, 2)
    assert verdict.ambiguous
    assert verdict.alternatives == (("a",), ("c",))


def test_one_rank_per_node_keeps_the_rank_level_verdicts() -> None:
    partners = [2, 3, 1, 0]  # ring 0 -> 2 -> 1 -> 3 -> 0
    verdict = attribute_pairs([(0, 2), (2, 1)])
    assert verdict.ranks == (2,)
    assert not verdict.ambiguous
    assert attribute_audit(partners, [[0]] * 4, [[0]] * 4).suspects == ()


def test_no_mismatch_names_nobody() -> None:
    verdict = attribute_pairs([], ["a", "b"])
    assert verdict.ranks == ()
    assert verdict.nodes == ()
    assert not verdict.ambiguous


def test_minimum_covers_are_exact_on_small_graphs() -> None:
    """Held to brute force on every graph of up to 5 edges over 5 vertices."""
    vertices = range(5)
    all_edges = [*list(itertools.combinations(vertices, 2)), (1, 1)]
    for size in range(1, 4):
        for edges in itertools.combinations(all_edges, size):
            best: list[frozenset[int]] = []
            for k in range(6):
                best = [
                    frozenset(c)
                    for c in itertools.combinations(vertices, k)
                    if all(u in c or v in c for u, v in edges)
                ]
                if best:
                    break
            got = minimum_covers(edges)
            assert got is not None
            assert sorted(map(sorted, got)) == sorted(map(sorted, best)), edges


def test_a_cover_beyond_the_limit_names_every_endpoint() -> None:
    edges = [(2 * i, 2 * i + 1) for i in range(20)]
    assert minimum_covers(edges, limit=4) is None
    verdict = attribute_pairs(edges)
    assert verdict.ambiguous
    assert verdict.ranks == tuple(range(40))
