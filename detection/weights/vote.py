"""Weight fingerprints across replicas: a strict-majority verdict, and the known divergence.

DDP keeps every replica's weights bitwise equal, so after ``optimizer.step`` all fingerprints
must agree. A corruption after all-reduce — in the reduced gradient, the weights or the optimizer
state — makes one replica diverge. With three or more replicas a strict majority names the
divergent ranks; two replicas (or a tie) can only say that they differ, never which one is wrong,
and the verdict says so instead of guessing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["KnownDivergence", "VoteVerdict", "majority_vote"]


@dataclass(frozen=True)
class VoteVerdict:
    """``divergent``: ranks outside a strict majority (empty when unanimous or when there is no
    strict majority); ``culprit_known``: whether a strict majority exists."""

    unanimous: bool
    culprit_known: bool
    divergent: tuple[int, ...]

    @property
    def passed(self) -> bool:
        return self.unanimous


_UNANIMOUS = VoteVerdict(unanimous=True, culprit_known=True, divergent=())


def majority_vote(values: Sequence[Hashable]) -> VoteVerdict:
    """Vote over one value per rank (a fingerprint, or a tuple of them)."""
    if not values or values.count(values[0]) == len(values):
        return _UNANIMOUS  # every step but a faulty one: no counting
    counts = Counter(values)
    if len(counts) <= 1:
        return VoteVerdict(unanimous=True, culprit_known=True, divergent=())
    top, count = counts.most_common(1)[0]
    if len(values) >= 3 and 2 * count > len(values):
        divergent = tuple(rank for rank, v in enumerate(values) if v != top)
        return VoteVerdict(unanimous=False, culprit_known=True, divergent=divergent)
    return VoteVerdict(unanimous=False, culprit_known=False, divergent=())


class KnownDivergence:
    """Which replicas are *known* to hold different weights: the classes of equal replicas at
    the last divergence that was alarmed.

    A divergence is known only once an alarm named it, and it stays known only as precisely as
    it was seen: ranks in different classes compute different things from then on (their later
    disagreement is a consequence), ranks in one class must keep agreeing. So a divergence
    without a majority (every rank in its own class, or a tie) does not blind the guard: a
    later split inside a class is a new event, and so is an audit mismatch between two ranks
    of one class. Weights equal again (unanimous and finite) forget it.
    """

    def __init__(self) -> None:
        self.classes: tuple[frozenset[int], ...] = ()

    @staticmethod
    def partition(values: Sequence[Hashable]) -> tuple[frozenset[int], ...]:
        groups: dict[Hashable, set[int]] = {}
        for rank, value in enumerate(values):
            groups.setdefault(value, set()).add(rank)
        return tuple(sorted((frozenset(g) for g in groups.values()), key=min))

    def is_new(self, values: Sequence[Hashable]) -> bool:
        """Whether ``values`` (one per rank) split replicas not known to differ."""
        if len(set(values)) <= 1:
            return False
        if not self.classes:
            return True
        return any(len({values[r] for r in cls}) > 1 for cls in self.classes)

    def snapshot(self) -> KnownDivergence:
        """An independent copy as of now (``classes`` is an immutable tuple, replaced whole by
        :meth:`record` and :meth:`clear`, so sharing it is safe)."""
        copy = KnownDivergence()
        copy.classes = self.classes
        return copy

    def apart(self, a: int, b: int) -> bool:
        """Whether ranks ``a`` and ``b`` are known to hold different weights."""
        return any((a in cls) != (b in cls) for cls in self.classes)

    def record(self, values: Sequence[Hashable]) -> None:
        self.classes = self.partition(values)

    def clear(self) -> None:
        self.classes = ()

    def minority(self) -> frozenset[int]:
        """Ranks outside a strict-majority class: the replicas an alarm named as wrong. Empty
        when no class holds a strict majority (then nobody is known to be the wrong one)."""
        total = sum(len(c) for c in self.classes)
        for cls in self.classes:
            if 2 * len(cls) > total and total >= 3:
                return frozenset(range(total)) - cls
        return frozenset()
