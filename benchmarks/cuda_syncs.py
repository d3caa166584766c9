"""Host synchronisations per guarded step on CUDA, counted with the profiler (world size 1).

Run on a machine with a GPU: ``python benchmarks/cuda_syncs.py``. It trains the built-in model
on ``cuda:0`` under DDP (NCCL, one rank) with SDCGuard in its default configuration, profiles
``--steps`` steps after a warm-up, and counts the CUDA runtime calls that block the host
(``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize`` and the
synchronous ``cudaMemcpy`` device-to-host copies behind ``.item()``/``.tolist()``), against the
same loop without the guard. The guard's budget is one per step: the read-back of the
all-gathered decision row. Without a GPU it says so and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from detection.audit import seed_rng, step_seed
from detection.guard import GuardConfig, SDCGuard
from detection.model import ModelConfig, TinyTransformer, loss_fn, make_batch

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing measured")
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    device = torch.device("cuda:0")
    cfg = ModelConfig()
    torch.manual_seed(0)
    plain_ddp = DistributedDataParallel(TinyTransformer(cfg).to(device), device_ids=[0])
    plain_opt = torch.optim.AdamW(plain_ddp.parameters())
    ddp = DistributedDataParallel(TinyTransformer(cfg).to(device), device_ids=[0])
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

    for step in range(5):
        plain(step)
        guarded(step)
    base = _count(plain, args.steps)
    with_guard = _count(guarded, args.steps)
    extra = sum(with_guard.values()) - sum(base.values())
    print(f"{torch.cuda.get_device_name(0)}, {args.steps} steps, world size 1")
    print(f"plain DDP blocking calls: {dict(base)}")
    print(f"with SDCGuard:            {dict(with_guard)}")
    print(f"host synchronisations added per step: {extra / args.steps:.2f} (budget 1)")
    dist.destroy_process_group()
    return 0 if extra <= args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
