"""A deferred step's decision row, carried to every rank inside the next gradient all-reduce.

Why: with ``GuardConfig(defer_decision=True)`` step ``s`` is decided at the end of step
``s + 1``, from every rank's row. An all-gather of its own is one more collective a step, and on
a small model its latency is most of what the guard costs (``benchmarks/RESULTS.md``). Step
``s + 1``'s gradient all-reduce is a collective every rank runs anyway, between the two points,
so the row travels in it.

An all-reduce sums; a sum in which every slot but one is zero is a gather. Each rank appends a
``(world, n, k)`` slab to one bucket, zeros except its own slot, and the reduced slab holds every
rank's row. Invariant — the table is exact, whatever the all-reduce's algorithm and order: each
int64 word is cut into ``k`` chunks of ``64 / k`` bits, non-negative integers below ``2^16``
(float32/float64 buckets) or ``2^8`` (float16/bfloat16, which hold integers up to 2^11 and 2^8
exactly); every partial sum of a slot is ``chunk + 0 + ... + 0``, and adding zero is exact in
IEEE arithmetic, so the chunks arrive bit for bit and reassemble into the words (two's
complement wrap-around included).

Only the gradient part is divided by the world size, as DDP's own all-reduce hook does, in the
same pass that copies the bucket into the joined buffer: no extra pass over the gradients. The
row joins the first bucket of at most :data:`BUCKET_CAP` elements (or the last bucket): every
rank has the same buckets in the same order, so every rank picks the same one. A row that no
bucket carried (the loop asked for the decision before its next backward: a checkpoint, the end
of the job) is all-gathered when it is read, which every rank does at the same point.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from detection.guard.config import GuardError
from detection.native import carry as native_carry
from detection.row.gather import GatherInFlight

__all__ = ["BUCKET_CAP", "SLAB_CAP", "CarriedRowError", "RowInBucket"]

#: Bits per chunk for each bucket dtype that can carry a row exactly.
CHUNK_BITS = {torch.float64: 16, torch.float32: 16, torch.float16: 8, torch.bfloat16: 8}
#: A row joins a bucket of at most this many elements (or the last bucket): a bucket is copied
#: once into the joined buffer, in place of the in-place division it would get otherwise.
BUCKET_CAP = 1 << 22
#: Slabs above this many elements (world x words x chunks) are all-gathered instead: past it a
#: slab would add more to a bucket's all-reduce than an all-gather of its own costs.
SLAB_CAP = 1 << 20


class CarriedRowError(GuardError):
    """A row went into a gradient all-reduce that never delivered it."""


class RowInBucket:
    """One rank's row for step ``step``, waiting for the next gradient all-reduce to carry it.

    The comm hook calls :meth:`join` on a bucket (``None``: this bucket cannot carry it, try the
    next) and :meth:`received` with the reduced slab; the guard calls :meth:`table` when it
    decides the step. Nothing here synchronises the host except :meth:`table`'s one read-back.
    """

    def __init__(
        self,
        row: torch.Tensor,
        *,
        step: int,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.row = row.contiguous()
        self.step = step
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.taken = False
        self._bits: int | None = None  # the chunk width of the bucket that took the row
        self._slab: torch.Tensor | None = None  # the reduced slab, decoded when read

    @staticmethod
    def fits(words: int, world_size: int) -> bool:
        """Whether a row of ``words`` int64 words may travel in a bucket (at 8-bit chunks, the
        largest slab any dtype needs), the same answer on every rank."""
        return world_size * words * 8 <= SLAB_CAP

    def join(self, buffer: torch.Tensor, *, is_last: bool) -> torch.Tensor | None:
        """``[buffer / world, slab]`` for a summing all-reduce, the slab zero but for this
        rank's chunks; ``None`` when this bucket does not carry the row (too large, or a dtype
        that cannot hold the chunks exactly), and then nothing was written. A float32 bucket on
        a CPU takes :mod:`detection.native.carry`'s one pass (the same bits)."""
        bits = CHUNK_BITS.get(buffer.dtype)
        if bits is None or (buffer.numel() > BUCKET_CAP and not is_last):
            return None
        flat = buffer.reshape(-1)
        if buffer.dtype == torch.float32 and native_carry.takes(flat, self.row):
            joined = native_carry.join_f32(flat, self.row, world=self.world_size, rank=self.rank)
        else:
            joined = self._join_torch(flat, bits)
        self._bits = bits
        self.taken = True
        return joined

    def _join_torch(self, flat: torch.Tensor, bits: int) -> torch.Tensor:
        k = 64 // bits
        n, words = flat.numel(), self.row.numel()
        joined = torch.empty(n + self.world_size * words * k, dtype=flat.dtype, device=flat.device)
        torch.div(flat, self.world_size, out=joined[:n])
        slab = joined[n:].view(self.world_size, words, k)
        slab.zero_()
        shifts = torch.arange(0, 64, bits, dtype=torch.int64, device=flat.device)
        mask = (1 << bits) - 1
        slab[self.rank].copy_(self.row.unsqueeze(1).bitwise_right_shift(shifts) & mask)
        return joined

    def received(self, slab: torch.Tensor) -> None:
        """Keep the reduced slab that :meth:`join` made; it is decoded when :meth:`table`
        reads it, on the training thread (the callback that calls this may run on a thread of
        the backend's, where every op costs more)."""
        if self._bits is None:
            raise CarriedRowError(f"step {self.step}'s row was received without being sent")
        self._slab = slab

    def _decode(self, slab: torch.Tensor, bits: int) -> torch.Tensor:
        """The words from the reduced slab (on its device, no synchronisation)."""
        words = self.row.numel()
        if slab.dtype == torch.float32 and native_carry.takes(slab, self.row):
            table = native_carry.table_f32(slab, world=self.world_size, words=words)
            if table is not None:
                return table
        shifts = torch.arange(0, 64, bits, dtype=torch.int64, device=slab.device)
        chunks = slab.view(self.world_size, words, shifts.numel()).to(torch.int64)
        # The chunks' bits do not overlap: their sum is their bitwise OR, the top chunk's
        # shift wrapping into the sign as two's complement does.
        return chunks.bitwise_left_shift(shifts).sum(-1)

    def table(self) -> torch.Tensor:
        """The ``(world, words)`` int64 table on the host: carried, or all-gathered now if no
        all-reduce took the row (every rank reaches this point with the same answer)."""
        if self._slab is not None and self._bits is not None:
            return self._decode(self._slab, self._bits).cpu()
        if self.taken:
            raise CarriedRowError(
                f"the gradient all-reduce that carried step {self.step}'s decision row never "
                "completed: the backward that ran it failed"
            )
        return GatherInFlight.start(self.row, self.group).table()
