"""This checkout's guard against another version's, in the same processes, step by step.

Why: on a shared 2-vCPU host a rerun of ``benchmarks/overhead.py`` moves a small model's ratio
by three to five points, so two runs, one of each version, cannot show a change of one or two.
Here both versions run in the same rank processes: the other checkout's ``detection`` package is
copied into a scratch directory under another name (``detection_base``, its imports rewritten
to match), each rank builds three replicas of the same model — plain DDP, this checkout's guard,
the other version's guard — and runs one step of each per round, in an order shuffled per round
(the same on every rank), so every drift of the machine hits the three alike. Printed: the median
over rounds of each guard's CPU time ÷ the plain step's of the same round, and the mean times.

    python benchmarks/side_by_side.py --base /path/to/other/checkout [--defer] [--steps 1200]

The other version needs the same constructor (``SDCGuard(ddp, opt, microbatch=, loss_fn=,
config=GuardConfig(...))``) and ``StatsConfig``; its C kernels are built from its own source.
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from detection.audit.ring import seed_rng, step_seed
from detection.simulation.model import ModelConfig, TinyTransformer, loss_fn, make_batch

BASE = "detection_base"
_IMPORT = re.compile(r"\bdetection\b(?=[.\s])")


def copy_as_base(checkout: Path, into: Path) -> Path:
    """``checkout/detection`` copied to ``into/detection_base`` with every import of
    ``detection`` rewritten to ``detection_base``: the other version, importable beside this
    one."""
    target = into / BASE
    shutil.copytree(checkout / "detection", target)
    for path in target.rglob("*.py"):
        path.write_text(_IMPORT.sub(BASE, path.read_text()))
    return target


def _guard(package: str, ddp: DistributedDataParallel, opt: Any, mb: Any, defer: bool) -> Any:
    # The package's public names: the same in every version, whatever its layout inside.
    top: ModuleType = importlib.import_module(package)
    config = top.GuardConfig(
        audit_every=0, abft=False, defer_decision=defer, stats=top.StatsConfig(warmup=3)
    )
    return top.SDCGuard(ddp, opt, microbatch=mb, loss_fn=loss_fn, config=config)


def _rank(rank: int, world: int, port: int, scratch: str, steps: int, defer: bool) -> None:
    sys.path.insert(0, scratch)
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    cfg = ModelConfig(vocab=64, d_model=32, n_heads=2, n_layers=1, seq_len=16, batch=4)
    device = torch.device("cpu")

    def microbatch(step: int, r: int) -> Any:
        return make_batch(cfg, 0, step, r, device)

    replicas: dict[str, tuple[DistributedDataParallel, Any, Any]] = {}
    for name, package in (("plain", None), ("this", "detection"), ("base", BASE)):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(TinyTransformer(cfg))
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        guard = _guard(package, ddp, opt, microbatch, defer) if package else None
        replicas[name] = (ddp, opt, guard)

    def one(name: str, step: int) -> float:
        ddp, opt, guard = replicas[name]
        started = time.process_time()
        if guard is None:
            seed_rng(step_seed(0, step, rank), device)
            opt.zero_grad(set_to_none=True)
            loss_fn(ddp, microbatch(step, rank)).backward()
            opt.step()
        else:
            with guard.step(step):
                opt.zero_grad(set_to_none=True)
                guard.backward(loss_fn(ddp, microbatch(step, rank)))
                opt.step()
        return time.process_time() - started

    order = list(replicas)
    shuffle = random.Random(7)
    warmup = 50
    ratios: dict[str, list[float]] = {"this": [], "base": []}
    totals = dict.fromkeys(replicas, 0.0)
    for step in range(steps):
        shuffle.shuffle(order)
        times = {}
        for name in order:
            dist.barrier()
            times[name] = one(name, step)
        if step >= warmup:
            for name in ratios:
                ratios[name].append(times[name] / times["plain"])
            for name in totals:
                totals[name] += times[name]
    for _, _, guard in replicas.values():
        if guard is not None:
            guard.close()
    if rank == 0:
        n = steps - warmup
        ms = {name: 1000.0 * total / n for name, total in totals.items()}
        print(
            f"defer_decision={defer}: this {statistics.median(ratios['this']):.3f}, "
            f"base {statistics.median(ratios['base']):.3f} (median of per-step CPU ratios over "
            f"{n} steps); mean CPU ms: plain {ms['plain']:.3f}, this {ms['this']:.3f}, "
            f"base {ms['base']:.3f}",
            flush=True,
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the other checkout")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--defer", action="store_true", help="defer_decision=True")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # The store's server here, on a port the system picks: the ranks join it as clients.
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=120), wait_for_workers=False
    )
    with tempfile.TemporaryDirectory() as scratch:
        copy_as_base(args.base, Path(scratch))
        mp.start_processes(
            _rank,
            args=(args.world_size, store.port, scratch, args.steps, args.defer),
            nprocs=args.world_size,
            start_method="spawn",
        )


if __name__ == "__main__":
    main()
