"""The carried decision row's two passes in C (:mod:`detection.guard.carry`), on a float32 CPU
bucket.

Why: joining a row to a bucket took seven torch ops (the division into the joined buffer, the
slab's zeroing, the chunks' shift, mask and copy) and reading it back four more; on a small
model every op is part of the fixed cost a step pays (``benchmarks/RESULTS.md``). Here each
is one call.

Invariant — the same bits as the torch path in :mod:`detection.guard.carry`: the gradients are
divided by the world size with one IEEE division each (``torch.div`` rounds the same way, not
through a reciprocal), the chunks are the row's 16-bit fields as exact float32 integers, and a
chunk that is not such an integer (the slab was not delivered as sent) is left to the torch
path's arithmetic, so the table never depends on which path read it.
"""

from __future__ import annotations

import torch

from detection import native
from detection.native import build as native_build

__all__ = ["join_f32", "table_f32", "takes"]


def takes(buffer: torch.Tensor, row: torch.Tensor) -> bool:
    """Whether the kernels take this bucket and row: a contiguous float32 CPU bucket, a
    contiguous int64 CPU row, and the kernels available here."""
    return (
        native.stats_kind_ok(buffer)
        and row.dtype == torch.int64
        and row.device.type == "cpu"
        and row.is_contiguous()
        and native.available()
    )


def join_f32(buffer: torch.Tensor, row: torch.Tensor, *, world: int, rank: int) -> torch.Tensor:
    """``[buffer / world, slab]``: a new float32 tensor of ``n + world * words * 4``, the slab
    zero but for ``rank``'s slot, which holds ``row``'s words as four 16-bit chunks each."""
    words = row.numel()
    n = buffer.numel()
    joined = torch.empty(n + world * words * 4, dtype=torch.float32)
    native_build.library().sdc_carry_join_f32(
        buffer.data_ptr(), n, world, row.data_ptr(), words, rank, joined.data_ptr()
    )
    return joined


def table_f32(slab: torch.Tensor, *, world: int, words: int) -> torch.Tensor | None:
    """The ``(world, words)`` int64 table from a reduced float32 slab, or ``None`` when some
    chunk is not an integer in ``[0, 2^16)`` (the caller then decodes it with torch's ops)."""
    if slab.numel() != world * words * 4 or not slab.is_contiguous():
        raise ValueError(f"a slab of {slab.numel()} elements for {world} x {words} words")
    table = torch.empty(world, words, dtype=torch.int64)
    got = native_build.library().sdc_carry_table_f32(
        slab.data_ptr(), world, words, table.data_ptr()
    )
    return table if got == 0 else None
