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
import weakref
from collections import Counter
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.overrides import TorchFunctionMode

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


_READ_BACK = ("tolist", "item", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
_FROM_HOST = ("tensor", "as_tensor")


class _HostReads(TorchFunctionMode):
    """Counts the torch calls that would block the host on a device (see the module docstring).

    ``host`` holds the tensors already on the host side of a read-back (and of anything
    computed from them): the CPU stands in for a device, so this taint is what tells a copy from
    a device tensor apart from work on a copy already made."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        # by id, holding the tensor weakly: an id is reused once its tensor is freed
        self.host: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        on_host = any(self.host.get(id(t)) is t for t in tensors)
        out = func(*args, **kwargs)
        if name in _READ_BACK and tensors and not on_host:
            self.counts[f"read back ({name})"] += 1
            on_host = True
        elif name in _FROM_HOST and kwargs.get("device") is not None:
            self.counts[f"host to device ({name})"] += 1
        if on_host:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.host[id(t)] = t
        return out


def _count_cpu(fn: object, steps: int) -> Counter[str]:
    mode = _HostReads()
    with mode:
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

    for step in range(5):
        plain(step)
        guarded(step)
    count = _count if cuda else _count_cpu
    base = count(plain, args.steps)
    with_guard = count(guarded, args.steps)
    extra = sum(with_guard.values()) - sum(base.values())
    where = torch.cuda.get_device_name(0) if cuda else "CPU (stand-in for a device)"
    print(f"{where}, {args.steps} steps, world size 1")
    print(f"plain DDP blocking calls: {dict(base)}")
    print(f"with SDCGuard:            {dict(with_guard)}")
    print(f"host synchronisations added per step: {extra / args.steps:.2f} (budget 1)")
    dist.destroy_process_group()
    return 0 if extra <= args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
