"""Each parameter's place in the unsharded numbering, so that custody's record *is* the row's
fingerprint: one fingerprint pass of the weights a step fewer under pure FSDP2.

Under pure FSDP2 a rank fingerprints its weight shards after each update (custody's record,
:mod:`detection.guard.update_replay`), before the next one (custody's check), and as the step
ends (the row's fingerprint at unsharded positions, :mod:`detection.weights.sharded`). The
first and the last read the same words: nothing is meant to write a shard between the
optimizer's post-hook and the end of the step. So custody numbers each shard's words at their
unsharded positions (it only compares equality: any fixed numbering serves it), and the row
takes the record instead of a third pass.

*Why the records add up to the row's part.* Each optimizer's record is the fingerprint of its
parameters' local runs, each run at its position in the unsharded model (parameter ``k``
starts where parameters ``0 … k-1`` of the model end, global sizes): exactly the terms the
row's :func:`~detection.weights.sharded.local_parts` pass sums for those parameters. When the
optimizers' parameter lists *partition* the model's parameters (every parameter in exactly one
optimizer's record), the records' sum is, by "concatenation is addition", the row's part,
bitwise. When they do not (a parameter in no optimizer, or in two, a record missing because an
optimizer has not stepped yet or custody restarted after ``verify_loaded``), the guard takes
the pass as before (:meth:`UnshardedPositions.partition` says which).

*What the record misses, and who sees it.* A shard written after the post-hook and before the
step ends (a fault, or a loop writing weights it did not declare) is in the record as the
update left it, not as it is: the row's part is then the update's value for that step. The
next update's custody check compares the shards with that record and names the rank at the
next step — the same step a flip after the row's pass would have been caught at before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from detection.weights.sharded import local_parts

__all__ = ["UnshardedPositions"]


class UnshardedPositions:
    """The model's parameters in order, each at its first unsharded position; the runs of any
    subset of them at those positions."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.start: dict[int, int] = {}
        at = 0
        for p in params:
            self.start[id(p)] = at
            at += p.numel()  # a DTensor's numel is its global one
        self.ids = frozenset(self.start)

    def runs(self, params: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
        """This rank's runs of ``params`` (every copy it holds) and their unsharded positions:
        the terms the row's pass sums for them."""
        runs: list[torch.Tensor] = []
        offsets: list[int] = []
        for p in params:
            parts = local_parts([p], start=self.start[id(p)], every_copy=True)
            runs += parts.runs
            offsets += parts.offsets
        return runs, offsets

    def partition(self, covered: Iterable[Sequence[int]]) -> bool:
        """Whether the id lists ``covered`` hold every parameter exactly once."""
        seen = [i for ids in covered for i in ids]
        return len(seen) == len(self.ids) and self.ids.issuperset(seen)
