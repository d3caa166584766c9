"""The step's one all-gather: one row per rank into a table every rank holds the same.

Every layer's per-step evidence travels as words of one int64 row (:mod:`detection.row.words`);
one all-gather gives every rank the whole table, from which every rank decides alike. The work
is held past its completion (:mod:`detection.row.held_works`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from detection.row.held_works import hold

__all__ = ["GatherInFlight", "all_gather_rows", "all_gather_table"]


def all_gather_table(row: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-gather one 1-D row per rank into a ``(world, n)`` table on the host: one collective
    and one host synchronisation (the single device-to-host copy)."""
    return GatherInFlight.start(row, group).table()


@dataclass
class GatherInFlight:
    """One all-gather of a row per rank, started and not yet read.

    Started, the collective runs while the host goes on (on gloo in its worker threads, on
    NCCL on its stream); :meth:`table` waits for it and brings the table to the host: the one
    host synchronisation. Waiting is local — every rank started the same collective — so any
    rank may read it at any later point, in any order with respect to later collectives. The
    row is held until then: the collective reads it while in flight."""

    row: torch.Tensor
    out: torch.Tensor
    work: Any

    @classmethod
    def start(cls, row: torch.Tensor, group: dist.ProcessGroup | None = None) -> GatherInFlight:
        world = dist.get_world_size(group)
        row = row.contiguous()
        out = torch.empty(world, row.numel(), dtype=row.dtype, device=row.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        # held past its completion: the backend thread must not be the one to free the row
        work = hold(gather(out.view(-1), row, group=group, async_op=True))
        return cls(row, out, work)

    def table(self) -> torch.Tensor:
        """The ``(world, n)`` table on the host (waits for the collective)."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.out.cpu()


def all_gather_rows(row: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[list[int]]:
    """All-gather one 1-D int64 row per rank and bring the table to the host: one collective
    and one host synchronisation."""
    rows: list[list[int]] = all_gather_table(row, group).tolist()
    return rows
