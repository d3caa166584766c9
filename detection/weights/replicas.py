"""The weight vote of a sharded model: each shard compared across the ranks that hold it.

Under HSDP (a 2-D mesh, replicate x shard) the ranks with the same shard coordinate hold the
same shard of every parameter, and after ``optimizer.step`` those copies must be bitwise equal,
as DDP's replicas are: each applied the same reduced gradient (HSDP all-reduces the
reduce-scattered shard across its replicate group) to the same state. So the vote of
:mod:`detection.weights.vote` runs once per *replicate group*, over the fingerprints of that
group's copies of its shard (each at its global positions, :mod:`detection.weights.sharded`):

* a group of three or more copies with a strict majority names the divergent ranks;
* two copies (or a tie) can only say that they differ: the verdict is ambiguous, names nobody;
* a group of one copy (pure FSDP2, no replica of a shard) has nothing to compare with: its
  shard is not voted on at all, and :attr:`ReplicaGroups.voting` says so.

The whole model's fingerprint is the sum of one copy of each shard (:meth:`ReplicaGroups.whole`):
the same value as the unsharded model's.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from detection.weights.fingerprint import Fingerprint
from detection.weights.vote import majority_vote

__all__ = ["ReplicaGroups", "ReplicaVerdict", "replica_vote"]

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class ReplicaGroups:
    """``groups[s]``: the ranks holding shard ``s``, in replica order (the first is the copy
    that counts towards the whole)."""

    groups: tuple[tuple[int, ...], ...]

    @classmethod
    def of_mesh(cls, ranks: Sequence[Sequence[int]]) -> ReplicaGroups:
        """From a mesh's rank table, replicate dim first (``mesh.mesh.tolist()``, a 1-D mesh
        given as one row: every rank its own group)."""
        rows = [list(r) for r in ranks]
        if not rows or any(len(r) != len(rows[0]) for r in rows):
            raise ValueError(f"not a rectangular mesh: {rows}")
        return cls(tuple(tuple(row[s] for row in rows) for s in range(len(rows[0]))))

    @property
    def replicas(self) -> int:
        return len(self.groups[0])

    @property
    def voting(self) -> bool:
        """Whether there is anything to vote on: at least two copies of each shard."""
        return self.replicas >= 2

    def whole(self, parts: Sequence[Fingerprint], replica: int = 0) -> Fingerprint:
        """The model's fingerprint from every rank's part (indexed by rank): one copy of each
        shard — replica ``replica``'s — summed mod 2**64 (concatenation is addition)."""
        a = sum(parts[g[replica]].a for g in self.groups)
        b = sum(parts[g[replica]].b for g in self.groups)
        return Fingerprint(a & _MASK64, b & _MASK64)

    def per_rank(self, parts: Sequence[Fingerprint]) -> dict[int, Fingerprint]:
        """Each rank's replica's whole fingerprint: what every copy of the model holds (after a
        checkpoint load all must equal the recorded value)."""
        wholes = [self.whole(parts, i) for i in range(self.replicas)]
        return {rank: wholes[i] for g in self.groups for i, rank in enumerate(g)}


@dataclass(frozen=True)
class ReplicaVerdict:
    """``split``: replicate groups whose copies disagree; ``divergent``: ranks a strict
    majority of their group named; ``culprit_known``: every split group had one."""

    split: tuple[tuple[int, ...], ...]
    divergent: tuple[int, ...]
    culprit_known: bool

    @property
    def passed(self) -> bool:
        return not self.split


def replica_vote(values: Sequence[Hashable], groups: ReplicaGroups) -> ReplicaVerdict:
    """Vote within each replicate group over ``values`` (one per rank, indexed by rank)."""
    split: list[tuple[int, ...]] = []
    divergent: list[int] = []
    known = True
    for group in groups.groups:
        verdict = majority_vote([values[r] for r in group])
        if verdict.unanimous:
            continue
        split.append(group)
        divergent.extend(group[i] for i in verdict.divergent)
        known = known and verdict.culprit_known
    return ReplicaVerdict(
        split=tuple(split), divergent=tuple(sorted(divergent)), culprit_known=known
    )
