"""The operations a guarded step launches, counted: what the guard costs on a GPU, on any host.

On a GPU a step of a model that is not huge is the time the host takes to issue its kernels,
at some 5-10 µs each; what the guard adds to a step is then, first, the kernels it adds. This
script counts them deterministically on the CPU, on the torch path a GPU takes
(``SDCGUARD_NATIVE=0``: no C kernels, no host-read row): every aten operation dispatched
while a step runs, on the training thread and on the autograd engine's (DDP's reducer and the
comm hook included), except views and allocations, which launch nothing. Collectives count as
one operation each.

The model is a stack of ``blocks`` blocks of plain ``torch.nn`` parts (``Linear`` then
``LayerNorm`` then ``GELU``) and a ``Linear`` head; DDP over gloo at world size 2; the guard with
its default :class:`~detection.GuardConfig`, audits off. Steps are counted after the per-step
layer's warm-up, when the steady state is reached. It prints, per depth: a plain step's count,
a guarded step's, what the guard adds, and the increment per block between depths::

    python benchmarks/ops_per_step.py                 # 2, 8 and 32 blocks
    python benchmarks/ops_per_step.py --blocks 2 32 --json out.json

``--by-op`` prints the operations the guard adds, by name, at the largest depth.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

WORLD = 2
WIDTH = 32
BATCH = 8
# Operations that launch no kernel: allocations (a caching allocator's bookkeeping) and
# metadata-only ones. Views are recognised by their schema (``func.is_view``).
_NO_LAUNCH = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "detach",
        "alias",
        "lift_fresh",
        "set_",
        "resize_",
        "_record_function_enter_new",
        "_record_function_exit",
        "record_stream",
        "is_same_size",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
    }
)


class KernelOps(TorchDispatchMode):
    """Counts, by operator name, the operations dispatched under it that launch work."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _NO_LAUNCH:
            self.counts[f"{func.namespace}.{name}"] += 1
        return func(*args, **(kwargs or {}))


def build_model(blocks: int, width: int = WIDTH) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def make_batch(step: int, rank: int, width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1009 + rank)
    return torch.randn(BATCH, width, generator=g), torch.randn(BATCH, 1, generator=g)


def _rank(rank: int, blocks: int, guarded: bool, warm: int, counted: int, out: str) -> None:
    os.environ["SDCGUARD_NATIVE"] = "0"  # the torch path a GPU takes
    torch.set_num_threads(1)
    store = dist.FileStore(out + ".store", WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))  # fmt: skip
    from detection import GuardConfig, SDCGuard

    torch.manual_seed(0)
    ddp = DistributedDataParallel(build_model(blocks))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    guard = (
        SDCGuard(ddp, optimizer, loss_fn=loss_fn, microbatch=make_batch, config=GuardConfig())
        if guarded
        else None
    )
    per_step: list[Counter[str]] = []
    for step in range(warm + counted):
        mode = KernelOps()
        with mode if step >= warm else _Nothing():
            _step(ddp, optimizer, guard, step, rank)
        if step >= warm:
            per_step.append(mode.counts)
    if guard is not None:
        guard.close()
        assert not guard.alarms, guard.alarms
    if rank == 0:
        Path(out).write_text(json.dumps([dict(c) for c in per_step]))
    dist.destroy_process_group()


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _step(ddp: nn.Module, optimizer: torch.optim.Optimizer, guard: Any, step: int,
          rank: int) -> None:  # fmt: skip
    batch = make_batch(step, rank)
    if guard is None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(ddp, batch).backward()
        optimizer.step()
        return
    with guard.step(step):
        optimizer.zero_grad(set_to_none=True)
        guard.backward(loss_fn(ddp, batch))
        optimizer.step()


def count(blocks: int, guarded: bool, *, warm: int = 30, counted: int = 3) -> Counter[str]:
    """The operations of one step (rank 0), after ``warm`` steps; the same on every counted
    step, or ValueError (the count is meant to be deterministic)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "counts.json")
        mp.start_processes(_rank, args=(blocks, guarded, warm, counted, out), nprocs=WORLD,
                           start_method="spawn")  # fmt: skip
        steps = [Counter(c) for c in json.loads(Path(out).read_text())]
    totals = {sum(c.values()) for c in steps}
    if len(totals) != 1:
        raise ValueError(f"{blocks} blocks, guarded={guarded}: steps differ: {sorted(totals)}")
    return steps[-1]


def table(depths: list[int], *, warm: int = 30) -> list[dict[str, Any]]:
    rows = []
    for blocks in depths:
        plain, guarded = count(blocks, False, warm=warm), count(blocks, True, warm=warm)
        rows.append({
            "blocks": blocks,
            "plain": sum(plain.values()),
            "guarded": sum(guarded.values()),
            "added": sum(guarded.values()) - sum(plain.values()),
            "added_by_op": dict((guarded - plain).most_common()),
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--warm", type=int, default=30, help="steps before counting")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    parser.add_argument("--by-op", action="store_true", help="the added operations, by name")
    args = parser.parse_args(argv)
    rows = table(sorted(args.blocks), warm=args.warm)
    print(f"operations per step (DDP world {WORLD}, default GuardConfig, audits off, "
          f"torch {torch.__version__}, the GPU path: SDCGUARD_NATIVE=0)")  # fmt: skip
    print(f"{'blocks':>6} {'plain':>7} {'guarded':>8} {'added':>6} {'added/plain':>12} "
          f"{'per block':>10}")  # fmt: skip
    previous: dict[str, Any] | None = None
    for row in rows:
        per_block = (
            f"{(row['added'] - previous['added']) / (row['blocks'] - previous['blocks']):10.1f}"
            if previous else f"{'':>10}"
        )  # fmt: skip
        print(f"{row['blocks']:>6} {row['plain']:>7} {row['guarded']:>8} {row['added']:>6} "
              f"{row['added'] / row['plain']:>11.0%} {per_block}")  # fmt: skip
        previous = row
    if args.by_op:
        print(f"\nadded at {rows[-1]['blocks']} blocks, by operation:")
        for name, n in rows[-1]["added_by_op"].items():
            print(f"  {n:6d}  {name}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
