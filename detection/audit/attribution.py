"""Who is behind the mismatching pairs of a ring audit: the smallest set of nodes, then ranks.

Every rank recomputes its ring successor's micro-batch, so a mismatching pair ``(auditor,
audited)`` says only that one of the two erred. A faulty rank is wrong in both of its roles, so
it mismatches with both ring neighbours; a faulty *node* makes every one of its ranks do so.
The mismatch graph (ranks as vertices, mismatching pairs as edges) of one cycle is therefore a
union of paths, and the culprits are the vertices that explain — cover — every edge.

Attribution (a contract for the alarm's suspects):

1. Contract ranks to their nodes; a mismatching pair inside one node is a loop that only that
   node explains.
2. The suspect nodes are the *smallest* node set covering every node-level edge (a minimum
   vertex cover). When several sets of that size exist, the evidence cannot tell them apart:
   the verdict is ``ambiguous``, lists every alternative, and names all of them — an innocent
   node is named only when the data could not clear it.
3. Inside the chosen nodes, the suspect ranks are the smallest rank set covering the pairs
   (a pair with one endpoint inside a chosen node names that endpoint; a pair inside the chosen
   nodes is covered by its own minimum cover, every alternative kept).

Why smallest: independent hardware faults are rare, so the fewest faulty units that explain the
data is the likeliest explanation; a whole node's fault is one unit, not its eight GPUs plus the
neighbours each of them disagreed with. The search is exact (bounded branching over the two
endpoints of an uncovered edge, ``O(2**k · edges)`` for a cover of size ``k``); past
``MAX_COVER`` units it stops and names every endpoint, ambiguous.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["MAX_COVER", "Attribution", "attribute_pairs", "minimum_covers"]

MAX_COVER = 16
_T = TypeVar("_T", bound=Hashable)


@dataclass(frozen=True)
class Attribution:
    """``ranks``/``nodes``: the suspects (sorted); ``ambiguous``: more than one minimum node set
    explains the pairs equally, and ``alternatives`` lists each of them (sorted)."""

    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    ambiguous: bool
    alternatives: tuple[tuple[str, ...], ...]

    def to_detail(self) -> dict[str, Any]:
        """The alarm-detail form (JSON values only)."""
        return {
            "suspect_nodes": list(self.nodes),
            "ambiguous": self.ambiguous,
            "alternatives": [list(a) for a in self.alternatives],
        }


def _search(
    edges: list[tuple[_T, _T]], chosen: frozenset[_T], budget: int, found: set[frozenset[_T]]
) -> None:
    uncovered = [(u, v) for u, v in edges if u not in chosen and v not in chosen]
    if not uncovered:
        found.add(chosen)
        return
    if budget == 0:
        return
    u, v = uncovered[0]
    _search(uncovered, chosen | {u}, budget - 1, found)
    if v != u:
        _search(uncovered, chosen | {v}, budget - 1, found)


def minimum_covers(
    edges: Iterable[tuple[_T, _T]], limit: int = MAX_COVER
) -> list[frozenset[_T]] | None:
    """Every minimum vertex cover of the graph with these edges (loops allowed: a loop's vertex
    is in every cover), or ``None`` when the smallest one is larger than ``limit``.
    No edges: one empty cover."""
    pairs = sorted({(u, v) if repr(u) <= repr(v) else (v, u) for u, v in edges}, key=repr)
    forced = frozenset(u for u, v in pairs if u == v)
    rest = [(u, v) for u, v in pairs if u not in forced and v not in forced]
    for k in range(0, limit - len(forced) + 1):
        found: set[frozenset[_T]] = set()
        _search(rest, forced, k, found)
        if found:
            return sorted(found, key=lambda s: sorted(map(repr, s)))
    return None


def attribute_pairs(
    mismatches: Sequence[tuple[int, int]], nodes: Sequence[str] | None = None
) -> Attribution:
    """The suspects behind ``mismatches`` (ring pairs of ranks) given each rank's node
    (``None``: every rank its own node). No mismatches: nobody."""
    if not mismatches:
        return Attribution((), (), False, ())
    node_of = list(nodes) if nodes is not None else [str(r) for r in range(_world(mismatches))]
    node_edges = [(node_of[a], node_of[b]) for a, b in mismatches]
    covers = minimum_covers(node_edges)
    if covers is None:
        every = {r for pair in mismatches for r in pair}
        names = tuple(sorted({node_of[r] for r in every}))
        return Attribution(tuple(sorted(every)), names, True, (names,))
    alternatives = tuple(tuple(sorted(c)) for c in covers)
    chosen_nodes = {n for c in covers for n in c}
    ranks: set[int] = set()
    for cover in covers:
        ranks |= _ranks_inside(mismatches, node_of, cover)
    return Attribution(
        tuple(sorted(ranks)), tuple(sorted(chosen_nodes)), len(covers) > 1, alternatives
    )


def _ranks_inside(
    mismatches: Sequence[tuple[int, int]], node_of: Sequence[str], cover: frozenset[str]
) -> set[int]:
    """The smallest rank sets inside ``cover``'s nodes that explain every pair (all of them)."""
    forced: set[int] = set()
    inner: list[tuple[int, int]] = []
    for a, b in mismatches:
        a_in, b_in = node_of[a] in cover, node_of[b] in cover
        if a_in and b_in:
            inner.append((a, b))
        elif a_in:
            forced.add(a)
        else:
            forced.add(b)
    left = [(a, b) for a, b in inner if a not in forced and b not in forced]
    covers = minimum_covers(left)
    if covers is None:
        return forced | {r for pair in left for r in pair}
    return forced.union(*covers)


def _world(mismatches: Sequence[tuple[int, int]]) -> int:
    return 1 + max(r for pair in mismatches for r in pair)
