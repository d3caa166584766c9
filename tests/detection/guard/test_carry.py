"""The deferred row carried in the next gradient all-reduce (:mod:`detection.guard.carry`).

What must hold: the table every rank reads is every rank's row, bit for bit, for every bucket
dtype and any int64 word; the gradients reach the optimizer as DDP's own averaging all-reduce
would deliver them (bitwise at two ranks, where a sum of two has one order); a deferred step
costs no collective of its own; and a row no all-reduce took is all-gathered when it is read.
Real rank processes in a gloo group; collectives counted with the profiler.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel

from detection import native
from detection.guard import GuardConfig, SDCGuard
from detection.guard.carry import BUCKET_CAP, CarriedRowError, RowInBucket
from detection.native import carry as native_carry
from detection.simulation.model import ModelConfig, TinyTransformer, loss_fn, make_batch
from detection.stepcheck.gradstats import StatsConfig
from tests.detection.conftest import run_ranks

CFG = ModelConfig(vocab=64, d_model=32, n_heads=2, n_layers=1, seq_len=16, batch=4)
EXTREMES = [0, -1, 1, 2**63 - 1, -(2**63), 0x7FFF0000FFFF0000, -0x0123456789ABCDEF, 65535, 65536]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _row(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    random = torch.randint(-(2**63), 2**63 - 1, (23,), dtype=torch.int64, generator=g)
    return torch.cat([torch.tensor(EXTREMES, dtype=torch.int64) + rank, random])


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_rank_reads_every_row_bit_for_bit_whatever_the_order_of_the_sum(
    dtype: torch.dtype, kernels: str
) -> None:
    world, n = 5, 7
    buffers = [torch.randn(n).to(dtype) for _ in range(world)]
    rows = [
        RowInBucket(_row(r), step=3, rank=r, world_size=world, group=None) for r in range(world)
    ]
    joined = [row.join(buf, is_last=False) for row, buf in zip(rows, buffers, strict=True)]
    assert all(j is not None for j in joined)
    # Any order of the summation, as ring and tree algorithms differ: forwards and backwards.
    for order in (range(world), reversed(range(world))):
        total = torch.zeros_like(joined[0])  # type: ignore[arg-type]
        for r in order:
            total = total + joined[r]  # type: ignore[operator]
        for row in rows:
            row.received(total[n:])
            assert torch.equal(row.table(), torch.stack([_row(r) for r in range(world)]))
    # The gradient part was averaged as DDP averages it: divided by the world size first.
    expected = buffers[0] / world
    assert torch.equal(joined[0][:n], expected)  # type: ignore[index]


@pytest.mark.parametrize("world", [2, 3, 7])
def test_the_c_join_and_read_are_the_torch_ones_bit_for_bit(world: int) -> None:
    """A float32 CPU bucket takes native_carry's passes: the joined buffer (gradients divided
    by a world size whose reciprocal is inexact, chunks in place) and the table read back are
    the torch path's, bit for bit."""
    assert native.available(), native.unavailable_reason()
    buf = torch.randn(1001) * torch.logspace(-30, 30, 1001)
    both = []
    for on in (True, False):
        native.set_enabled(on)
        try:
            rows = [
                RowInBucket(_row(r), step=1, rank=r, world_size=world, group=None)
                for r in range(world)
            ]
            joined = [row.join(buf, is_last=False) for row in rows]
            total = torch.stack(joined).sum(0)  # type: ignore[arg-type]
            rows[0].received(total[buf.numel() :])
            both.append((joined[world - 1], rows[0].table()))
        finally:
            native.set_enabled(True)
    (c_joined, c_table), (t_joined, t_table) = both
    assert torch.equal(c_joined.view(torch.int32), t_joined.view(torch.int32))  # type: ignore[union-attr]
    assert torch.equal(c_table, t_table)
    assert torch.equal(c_table, torch.stack([_row(r) for r in range(world)]))


@pytest.mark.parametrize(
    "chunk", [0.5, -1.0, 65536.0, math.nan, math.inf], ids=["half", "neg", "2^16", "nan", "inf"]
)
def test_a_slab_that_did_not_arrive_as_sent_reads_the_same_on_both_paths(chunk: float) -> None:
    """A chunk no rank sent (the slab was corrupted on the way): the C read refuses it and the
    torch arithmetic decides the word, so which path a rank takes never changes its table."""
    slab = torch.zeros(2 * 3 * 4)
    slab[5] = chunk
    assert native_carry.table_f32(slab, world=2, words=3) is None
    tables = []
    for on in (True, False):
        native.set_enabled(on)
        try:
            row = RowInBucket(
                torch.zeros(3, dtype=torch.int64), step=0, rank=0, world_size=2, group=None
            )
            row.join(torch.zeros(4), is_last=True)
            row.received(slab)
            tables.append(row.table())
        finally:
            native.set_enabled(True)
    assert torch.equal(tables[0], tables[1])


def test_a_bucket_that_cannot_carry_the_row_is_left_alone() -> None:
    row = RowInBucket(_row(0), step=0, rank=0, world_size=2, group=None)
    assert row.join(torch.zeros(4, dtype=torch.complex64), is_last=True) is None
    big = torch.zeros(BUCKET_CAP + 1)
    assert row.join(big, is_last=False) is None  # a later bucket carries it
    assert not row.taken
    assert row.join(big, is_last=True) is not None  # the last bucket always does
    assert row.taken


def test_a_row_taken_by_an_all_reduce_that_never_delivered_it_is_an_error() -> None:
    row = RowInBucket(_row(0), step=9, rank=0, world_size=2, group=None)
    row.join(torch.zeros(3), is_last=False)
    with pytest.raises(CarriedRowError, match="step 9"):
        row.table()


def test_a_slab_past_its_cap_does_not_fit_and_any_rank_says_so() -> None:
    assert RowInBucket.fits(128, 8)
    assert not RowInBucket.fits(1 << 12, 1 << 10)


def _collectives(
    rank: int,
    world: int,
    defer: bool,
    options: dict[str, Any],
    lr: float = 1e-3,
    compress: bool = False,
) -> dict[str, Any]:
    steps = 6
    torch.manual_seed(0)
    ddp = DistributedDataParallel(TinyTransformer(CFG), **options)
    opt = torch.optim.AdamW(ddp.parameters(), lr=lr)
    config = GuardConfig(defer_decision=defer, stats=StatsConfig(warmup=2))

    def microbatch(step: int, r: int) -> Any:
        return make_batch(CFG, 0, step, r)

    hook = fp16_compress_hook if compress else None
    state = dist.group.WORLD if compress else None
    guard = SDCGuard(
        ddp,
        opt,
        microbatch=microbatch,
        loss_fn=loss_fn,
        config=config,
        comm_hook=hook,
        comm_state=state,
    )

    def step(s: int) -> None:
        with guard.step(s):
            opt.zero_grad(set_to_none=True)
            guard.backward(loss_fn(ddp, microbatch(s, rank)))
            opt.step()

    step(0)
    step(1)  # DDP lays its buckets out anew after the first step
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for s in range(2, steps):
            step(s)
    guard.close()
    counts: dict[str, int] = {}
    for event in prof.key_averages():
        if event.key.startswith("c10d::"):
            counts[event.key] = event.count
    outcome = guard.last_outcome
    assert outcome is not None
    dist.barrier()
    return {
        "counts": counts,
        "alarms": [(a.step, str(a.layer)) for a in guard.alarms],
        "decided": guard.counters.steps,
        "last": (outcome.step, outcome.fingerprint.hex()),
        "weights": [p.detach().clone() for p in ddp.module.parameters()],
        "grads": torch.cat(
            [p.grad.reshape(-1) for p in ddp.module.parameters() if p.grad is not None]
        ),
    }


def _gathers(counts: dict[str, int]) -> int:
    return sum(n for key, n in counts.items() if "allgather" in key)


@pytest.mark.parametrize(
    "options",
    [{}, {"gradient_as_bucket_view": True}, {"static_graph": True}, {"bucket_cap_mb": 0.01}],
    ids=["default", "bucket-view", "static-graph", "many-buckets"],
)
def test_a_deferred_step_costs_no_collective_of_its_own_and_trains_the_same(
    options: dict[str, Any],
) -> None:
    at_once = run_ranks(_collectives, 2, False, options)
    deferred = run_ranks(_collectives, 2, True, options)
    for now, late in zip(at_once, deferred, strict=True):
        assert now["alarms"] == late["alarms"] == []
        assert now["decided"] == late["decided"] == 6
        # at once: one all-gather a step; deferred: none, the row rode in the gradients'
        assert _gathers(now["counts"]) == 4
        assert _gathers(late["counts"]) == 0
        # and no extra all-reduce either: the same collectives as plain DDP's buckets
        reduces = {k: n for k, n in now["counts"].items() if "allreduce" in k}
        assert {k: n for k, n in late["counts"].items() if "allreduce" in k} == reduces
        # two ranks sum in one order: the carried all-reduce trains bit for bit the same
        assert now["last"] == late["last"]
        for a, b in zip(now["weights"], late["weights"], strict=True):
            assert torch.equal(a, b)


def test_under_a_comm_hook_of_the_users_the_row_is_all_gathered() -> None:
    """A compression hook rounds what it is handed (fp16 holds 11 bits, not a 16-bit chunk):
    the deferred row keeps an all-gather of its own there, and decides the same."""
    for late in run_ranks(_collectives, 2, True, {}, 1e-3, True):
        assert late["alarms"] == []
        assert late["decided"] == 6
        assert _gathers(late["counts"]) == 4


def test_at_three_ranks_the_replicas_agree_and_the_gradients_differ_by_rounding_alone() -> None:
    """A longer buffer may sum in another order at three ranks or more: the gradients may differ
    from those of a guard deciding at once in their last bits, never between replicas."""
    deferred = run_ranks(_collectives, 3, True, {})
    for late in deferred:
        assert late["alarms"] == []  # every replica voted equal at every step
        assert _gathers(late["counts"]) == 0
    # With the weights held still (lr=0) both guards see the same local gradients at every
    # step: the reduced ones agree to float32 rounding of a sum of three.
    at_once = run_ranks(_collectives, 3, False, {}, 0.0)
    held = run_ranks(_collectives, 3, True, {}, 0.0)
    for now, late in zip(at_once, held, strict=True):
        difference = (now["grads"] - late["grads"]).norm()
        assert difference <= 1e-6 * now["grads"].norm()
        assert now["grads"].norm() > 0


def _plain_nn(rank: int, world: int, dtype: torch.dtype, inject: tuple[str, ...]) -> Any:
    """A model of plain ``torch.nn`` parts in ``dtype``, two micro-batches a step (the first
    under ``no_sync``): its buckets, and so the slab, are in that dtype."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def microbatch(step: int, r: int, micro: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(step * 100 + r * 10 + micro)
        return torch.randn(4, 8, generator=g).to(dtype)

    def loss(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module(x).float().pow(2).mean()

    config = GuardConfig(
        defer_decision=True, micro_batches=2, stats=StatsConfig(warmup=2), inject=inject
    )
    guard = SDCGuard(ddp, opt, microbatch=microbatch, loss_fn=loss, config=config)
    for step in range(8):
        with guard.step(step):
            opt.zero_grad()
            with ddp.no_sync():
                guard.backward(loss(ddp, microbatch(step, rank, 0)))
            guard.backward(loss(ddp, microbatch(step, rank, 1)))
            opt.step()
        if guard.halted:
            break
    guard.close()
    return [(a.step, str(a.layer), a.suspect_ranks) for a in guard.alarms], guard.counters.steps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_rows_ride_in_buckets_of_every_float_dtype_with_accumulation(dtype: torch.dtype) -> None:
    for alarms, decided in run_ranks(_plain_nn, 3, dtype, ()):
        assert (alarms, decided) == ([], 8)
    for alarms, decided in run_ranks(_plain_nn, 3, dtype, ("weight-flip@1:5",)):
        # raised at the end of step 6, which halts: steps 0-6 decided, the flip named at 5
        assert (alarms, decided) == ([(5, "fingerprint", (1,))], 7)
