"""The guard's communication hook (:class:`detection.guard.comm_hook.CheckedCommHook`) around DDP's
averaging all-reduce.

What must hold: the gradients reach the optimizer as DDP's built-in all-reduce delivers them
(bitwise at two ranks, where a sum of two has one order), with one bucket or many, with a row
carried or not; every bucket's sums before and after the all-reduce are taken; and on a CPU the
last bucket's all-reduce is waited for in the hook itself (its future is complete when the hook
returns: no callback on the backend's thread), while every earlier bucket's goes on through a
callback, so those all-reduces still overlap the rest of the backward. Real rank processes in a
gloo group.
"""

# No ``from __future__ import annotations``: DDP compares the hook's annotations with the real
# ``dist.GradBucket`` and ``Future[Tensor]`` when it is registered.

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detection.guard.carry import RowInBucket
from detection.guard.comm_hook import CheckedCommHook
from tests.detection.conftest import run_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )


def _hooked(rank: int, world: int, bucket_cap_mb: float, carry: bool) -> dict[str, Any]:
    plain = DistributedDataParallel(_model(), bucket_cap_mb=bucket_cap_mb)
    guarded = DistributedDataParallel(_model(), bucket_cap_mb=bucket_cap_mb)
    checked = CheckedCommHook(list(guarded.parameters()), process_group=None)
    seen: list[tuple[bool, bool]] = []  # (last bucket, future complete on return)

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = checked.hook(state, bucket)
        seen.append((bucket.is_last(), fut.done()))
        return fut

    guarded.register_comm_hook(state=None, hook=hook)
    tables: list[torch.Tensor] = []
    for step in range(4):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 16, generator=gen)
        for ddp in (plain, guarded):
            ddp.zero_grad(set_to_none=True)
        checked.begin_step(fingerprint_gradients=False, inject=False)
        row = None
        if carry:
            words = torch.arange(5, dtype=torch.int64) * (rank + 1) + step
            row = RowInBucket(words, step=step, rank=rank, world_size=world, group=None)
            checked.carry(row)
        plain(x).square().sum().backward()
        guarded(x).square().sum().backward()
        assert checked.flags_on_host() == (0, 0)
        checked.end_step()
        for a, b in zip(plain.parameters(), guarded.parameters(), strict=True):
            assert a.grad is not None
            assert b.grad is not None
            assert torch.equal(a.grad, b.grad), step
        if row is not None:
            tables.append(row.table())
    return {"seen": seen, "tables": tables}


@pytest.mark.parametrize("carry", [False, True], ids=["alone", "carrying"])
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.005], ids=["one-bucket", "many-buckets"])
def test_the_hook_delivers_ddps_own_gradients_and_waits_for_the_last_bucket_alone(
    bucket_cap_mb: float, carry: bool
) -> None:
    for rank_result in run_ranks(_hooked, 2, bucket_cap_mb, carry):
        seen = rank_result["seen"]
        last = [done for is_last, done in seen if is_last]
        earlier = [done for is_last, done in seen if not is_last]
        assert len(last) == 4  # one last bucket a step,
        assert all(last)  # its all-reduce complete when the hook returns
        # with small buckets, the earlier ones took the callback path (and delivered the same);
        # DDP's first step fills one larger bucket before it lays out the small ones
        assert (len(earlier) >= 3) == (bucket_cap_mb < 1)
        for step, table in enumerate(rank_result["tables"]):
            expected = torch.stack(
                [torch.arange(5, dtype=torch.int64) * (r + 1) + step for r in range(2)]
            )
            assert torch.equal(table, expected)
