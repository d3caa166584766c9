"""FSDP2's reduce-scatter with each rank's own gradient checked first (as DDP's comm hook is).

FSDP2 reduce-scatters every rank's unsharded gradient into shards
(``FSDPModule.set_custom_reduce_scatter`` is the place to see each rank's input, as the comm
hook is for DDP). After the reduce-scatter a non-finite value sits in some shard whatever rank
it came from, so the check there cannot name a rank. Before it, the input is this rank's own
gradient (its padding is zeros): a non-finite value there is this rank's, and the alarm can
name it. :class:`CheckedReduceScatter` ORs a device flag with "the input holds a NaN or an
infinity" and then runs the same collective FSDP2's default does; the flag is read once a step,
in the guard's row, with no host synchronisation of its own.

*The algebra of the reduce-scatter.* The shards it writes hold, together, the reduction of
every rank's input: with ``c`` the op's scale (1 for ``SUM``, ``1/W`` for ``AVG`` over ``W``
ranks), ``Σ_r Σ out_r = c·Σ_r Σ in_r`` in exact arithmetic. Each rank sums its input and its
output shard in float64 (``torch.sum(dtype=float64)``: no copy), and the decision compares
``Σ_r out_r`` with ``Σ_r c·in_r``. Rounding: every output element is the reduction of
``W`` words of the reduce dtype (unit roundoff ``u``) in some order, then scaled: its error
is at most ``(gamma_(W-1) + 2u)·c·Σ_r |x_r|`` (``gamma_k = k·u/(1 - k·u)``), and the float64
sums of ``n`` words add ``gamma_n`` (float64) of ``Σ|in|`` and of ``Σ|out| ≤ c·Σ|in|·(1 + …)``
each. So each rank also sends its ``margin = c·Σ|in|·(gamma_(W-1) + 2u + 3·gamma_n(2**-53))``,
and a residual beyond the sum of the margins cannot be rounding: alarm
``allreduce/post-allreduce`` (no rank named: which rank's arithmetic inside the collective
went wrong is not visible from its ends). A
``PREMUL_SUM`` op (``set_gradient_divide_factor``) has a scale the comm cannot read: such a
step is not checked, and the row says so.

*Per-step statistics.* Each call also records the L2 norm and the L∞ of this rank's input
(its own gradient of that FSDP module, before anything is mixed in), which the guard hands to
the cross-rank and temporal tests of :mod:`detection.stepcheck.gradstats`, one "bucket" per
reduce-scatter: a rank whose gradient stands out is named (``gradstats``, weaker evidence).

A reduce-scatter of the user's own (``SDCGuard(comm_hook=...)``, a FSDP2 ``ReduceScatter``)
is wrapped: the checks run around it.

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
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from detection.weights.fingerprint import fingerprint_on_device

__all__ = ["CheckedAllGather", "CheckedReduceScatter"]


def _allocate(
    inner: ReduceScatter | AllGather | None,
    size: Sequence[int | torch.SymInt],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The wrapped collective's own buffer where there is one (a custom collective may need
    memory of its own kind), a plain tensor otherwise."""
    if inner is not None:
        return inner.allocate(size, dtype=dtype, device=device)
    return torch.empty(*size, dtype=dtype, device=device)


class CheckedReduceScatter(ReduceScatter):
    """The default (or the user's) reduce-scatter, with a non-finite check of this rank's input
    and the sums of its input and output for the algebra check."""

    def __init__(self, device: torch.device, inner: ReduceScatter | None = None) -> None:
        self.flag = torch.zeros((), dtype=torch.int64, device=device)
        # c·Σ in, margin, Σ out: this step's, over every reduce-scatter of every FSDP module
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)
        self.inner = inner
        self.calls = 0
        self.unchecked = 0  # calls whose op's scale is unknown (PREMUL_SUM)
        # Per call: this rank's gradient's L2 norm and L∞ (float64, on the device): the
        # per-step statistics' columns, one "bucket" per reduce-scatter.
        self.stats: list[torch.Tensor] = []

    def install(self, model: nn.Module) -> int:
        """Become the reduce-scatter of every FSDP2 module in ``model``; how many."""
        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for m in modules:
            m.set_custom_reduce_scatter(self)
        return len(modules)

    def begin_step(self) -> None:
        self.flag.zero_()
        self.sums.zero_()
        self.calls = 0
        self.unchecked = 0
        self.stats = []

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return _allocate(self.inner, size, dtype, device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        self.calls += 1
        floating = input_tensor.is_floating_point()
        if floating:
            bad = (~torch.isfinite(input_tensor).all()).to(torch.int64)
            self.flag.bitwise_or_(bad.to(self.flag.device))
            l2 = torch.linalg.vector_norm(input_tensor, 2, dtype=torch.float64)
            peak = torch.linalg.vector_norm(input_tensor, float("inf"), dtype=torch.float64)
            self.stats.append(torch.stack([l2, peak]).to(self.sums.device))
        scale = _scale(op, group)
        if floating and scale is not None:
            s_in = torch.sum(input_tensor, dtype=torch.float64)
            s_abs = torch.linalg.vector_norm(input_tensor, 1, dtype=torch.float64)
        elif floating:
            self.unchecked += 1
        work: dist.Work | None
        if self.inner is not None:
            work = self.inner(output_tensor, input_tensor, group, op, async_op)
        else:
            work = dist.reduce_scatter_single(
                output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
            )
        if floating and scale is not None:
            if async_op and work is not None:
                work.wait()
            s_out = torch.sum(output_tensor, dtype=torch.float64)
            k = _margin(group.size(), input_tensor.dtype, input_tensor.numel())
            part = torch.stack([scale * s_in, k * scale * s_abs, s_out])
            self.sums.add_(part.to(self.sums.device))
        return work


def _scale(op: dist.ReduceOp | dist.ReduceOp.RedOpType, group: dist.ProcessGroup) -> float | None:
    """``c`` of the module: 1 for SUM, 1/W for AVG, unknown otherwise."""
    if op == dist.ReduceOp.SUM:
        return 1.0
    if op == dist.ReduceOp.AVG:
        return 1.0 / group.size()
    return None


def _gamma(k: int, u: float) -> float:
    return k * u / (1 - k * u)


def _margin(world: int, dtype: torch.dtype, n: int) -> float:
    """The per-unit-of-``c·Σ|in|`` rounding allowance of the module's bound."""
    u = torch.finfo(dtype).eps / 2
    return _gamma(max(world - 1, 1), u) + 2 * u + 3 * _gamma(max(n, 1), 2.0**-53)


class CheckedAllGather(AllGather):
    """The default (or the user's) all-gather, with the fingerprint of what this rank received.

    Every rank of an all-gather receives the same bytes: the concatenation of every rank's
    (padded) shard. So each rank fingerprints its output — at positions that run on across the
    step's calls, so that two calls' words never cancel — and the decision compares the ranks
    of each all-gather group: a rank whose view differs received (or holds) a wrong parameter
    for its forward or backward. With an async call the fingerprint waits for the collective:
    on CUDA ``wait`` orders the all-gather stream after it (no host synchronisation, compute
    still overlaps); on CPU it blocks, so gloo's prefetch no longer overlaps compute."""

    def __init__(self, device: torch.device, inner: AllGather | None = None) -> None:
        self.view = torch.zeros(2, dtype=torch.int64, device=device)
        self.inner = inner
        self.position = 0
        self.calls = 0

    def install(self, model: nn.Module) -> int:
        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for m in modules:
            m.set_custom_all_gather(self)
        return len(modules)

    def begin_step(self) -> None:
        self.view.zero_()
        self.position = 0
        self.calls = 0

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return _allocate(self.inner, size, dtype, device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        work: dist.Work | None
        if self.inner is not None:
            work = self.inner(output_tensor, input_tensor, group, async_op)
        else:
            work = dist.all_gather_single(
                output_tensor, input_tensor, group=group, async_op=async_op
            )
        if async_op and work is not None:
            work.wait()
        fp = fingerprint_on_device([output_tensor], start=self.position)
        self.view.add_(fp.to(self.view.device))
        self.position += output_tensor.numel()
        self.calls += 1
        return work
