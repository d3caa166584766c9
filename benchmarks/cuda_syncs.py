"""Host synchronisations per guarded step on CUDA, counted with the profiler (world size 1).

Run on a machine with a GPU: ``python benchmarks/cuda_syncs.py``. It trains the built-in model
on ``cuda:0`` under DDP (NCCL, one rank) with SDCGuard in its default configuration, profiles
``--steps`` steps after a warm-up, and counts the CUDA runtime calls that block the host
(``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize`` and the
synchronous ``cudaMemcpy`` device-to-host copies behind ``.item()``/``.tolist()``), against the
same loop without the guard. The guard's budget is one per step: the read-back of the
all-gathered decision row. It exits 1 when a guarded step adds more than that.

On CUDA it then runs a few more guarded steps under ``torch.cuda.set_sync_debug_mode("warn")``
and prints where each synchronisation came from (the innermost frame in sdcguard's code), so an
extra one is found, not only counted. Without a GPU (or with ``--cpu``) it counts on the CPU
with :class:`host_reads.HostReads` (``benchmarks/host_reads.py``), which sees the calls that would
synchronise.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from host_reads import HostReads  # benchmarks/ is on sys.path when this file runs as a script
from torch.nn.parallel import DistributedDataParallel

from detection.audit.ring import seed_rng, step_seed
from detection.guard import GuardConfig, SDCGuard
from detection.simulation.model import ModelConfig, TinyTransformer, loss_fn, make_batch

_BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _count(fn: object, steps: int) -> Counter[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for step in range(steps):
            fn(step)  # type: ignore[operator]
        torch.cuda.synchronize()
    counts: Counter[str] = Counter()
    for event in prof.events():
        name = event.name
        if any(name.startswith(b) for b in _BLOCKING) and not name.startswith("cudaMemcpyAsync"):
            counts[name] += 1
    return counts


def _trace(fn: Callable[[int], object], steps: int) -> Counter[str]:
    """The innermost frame in this repository's code of every synchronising CUDA call."""
    root = str(Path(__file__).resolve().parent.parent)
    places: Counter[str] = Counter()

    def record(message: Any, category: Any, filename: str, lineno: int, *_: Any, **__: Any) -> None:
        if "synchroniz" not in str(message):
            return
        ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(root)]
        frame = ours[-1] if ours else None
        place = (
            f"{Path(frame.filename).relative_to(root)}:{frame.lineno} {frame.line}"
            if frame
            else "?"
        )
        places[place] += 1

    with warnings.catch_warnings():  # restores showwarning and the filters on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for step in range(steps):
                fn(step)
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return places


def _count_cpu(fn: object, steps: int) -> Counter[str]:
    with HostReads() as mode:
        for step in range(steps):
            fn(step)  # type: ignore[operator]
    return mode.counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cpu", action="store_true", help="count on the CPU (see above)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda:
        print("no CUDA device (or --cpu): counting host read-backs on the CPU instead")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    device = torch.device("cuda:0" if cuda else "cpu")
    ids = [0] if cuda else None
    cfg = ModelConfig()
    torch.manual_seed(0)
    plain_ddp = DistributedDataParallel(TinyTransformer(cfg).to(device), device_ids=ids)
    plain_opt = torch.optim.AdamW(plain_ddp.parameters())
    ddp = DistributedDataParallel(TinyTransformer(cfg).to(device), device_ids=ids)
    opt = torch.optim.AdamW(ddp.parameters())

    def microbatch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return make_batch(cfg, 0, step, rank, device)

    guard = SDCGuard(ddp, opt, microbatch=microbatch, loss_fn=loss_fn, config=GuardConfig())

    def plain(step: int) -> None:
        seed_rng(step_seed(0, step, 0), device)
        plain_opt.zero_grad(set_to_none=True)
        loss_fn(plain_ddp, microbatch(step, 0)).backward()
        plain_opt.step()

    def guarded(step: int) -> None:
        with guard.step(step):
            opt.zero_grad(set_to_none=True)
            guard.backward(loss_fn(ddp, microbatch(step, 0)))
            opt.step()

    warmup = 5
    for step in range(warmup):
        plain(step)
        guarded(step)
    count = _count if cuda else _count_cpu
    base = count(lambda step: plain(warmup + step), args.steps)
    with_guard = count(lambda step: guarded(warmup + step), args.steps)
    extra = sum(with_guard.values()) - sum(base.values())
    where = torch.cuda.get_device_name(0) if cuda else "CPU (stand-in for a device)"
    print(f"{where}, {args.steps} steps, world size 1")
    print(f"plain DDP blocking calls: {dict(base)}")
    print(f"with SDCGuard:            {dict(with_guard)}")
    print(f"host synchronisations added per step: {extra / args.steps:.2f} (budget 1)")
    if cuda:
        first = warmup + args.steps
        where_from = _trace(lambda step: guarded(first + step), steps=3)
        print("where the guarded steps synchronise (3 steps, sync debug mode):")
        for place, n in where_from.most_common():
            print(f"  {n:4d}  {place}")
    dist.destroy_process_group()
    return 0 if extra <= args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
