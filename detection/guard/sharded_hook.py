"""FSDP2's reduce-scatter with each rank's own gradient checked first (as DDP's comm hook is).

FSDP2 reduce-scatters every rank's unsharded gradient into shards
(``FSDPModule.set_custom_reduce_scatter`` is the place to see each rank's input, as the comm
hook is for DDP). After the reduce-scatter a non-finite value sits in some shard whatever rank
it came from, so the check there cannot name a rank. Before it, the input is this rank's own
gradient (its padding is zeros): a non-finite value there is this rank's, and the alarm can
name it. :class:`CheckedReduceScatter` ORs a device flag with "the input holds a NaN or an
infinity" and then runs the same collective FSDP2's default does; the flag is read once a step,
in the guard's row, with no host synchronisation of its own.

Installed on every ``FSDPModule`` of the model (each ``fully_shard`` call is one parameter
group with its own reduce-scatter). A comm set later with ``set_custom_reduce_scatter``
replaces it: the guard then sees the shards only (``calls`` stays 0, and the row says so).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

__all__ = ["CheckedReduceScatter"]


class CheckedReduceScatter(ReduceScatter):
    """The default reduce-scatter, after a non-finite check of this rank's input."""

    def __init__(self, device: torch.device) -> None:
        self.flag = torch.zeros((), dtype=torch.int64, device=device)
        self.calls = 0

    def install(self, model: nn.Module) -> int:
        """Become the reduce-scatter of every FSDP2 module in ``model``; how many."""
        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for m in modules:
            m.set_custom_reduce_scatter(self)
        return len(modules)

    def begin_step(self) -> None:
        self.flag.zero_()
        self.calls = 0

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        if input_tensor.is_floating_point():
            bad = (~torch.isfinite(input_tensor).all()).to(torch.int64)
            self.flag.bitwise_or_(bad.to(self.flag.device))
        self.calls += 1
        work: dist.Work | None = dist.reduce_scatter_single(
            output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
        )
        return work
