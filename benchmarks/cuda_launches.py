"""Where a guarded step's host time goes, part by part, profiled (world size 1).

On a GPU the built-in models are far too small to keep the device busy: a step is the time the
host takes to issue its kernels, and so is what the guard adds to it (``docs/detection-design.md``,
"On a GPU"). This script says which parts of the guard spend that time. It trains each variant
of ``benchmarks/overhead.py`` that runs no audit (``plain``, ``bare``, ``checks``, ``abft``) under
DDP on one rank, and ``checks-eager``, ``checks`` with the CUDA graphs of
:mod:`detection.weights.device_graph` switched off (what they save, side by side). It times their
steps
side by side, then profiles a few steps of each with every function of ``detection`` wrapped in
a named profiler range, and prints per variant:

* the step time and what it adds to ``plain`` (ms, medians over rounds);
* kernel launches and host-device copies per step, next to ``plain``'s;
* per ``detection`` function: calls, inclusive and self host time, and device time per step,
  the largest first.

``--trace DIR`` also writes a Chrome trace (``chrome://tracing``, Perfetto) of two steps of each
guarded variant. It runs on the CPU too (``--cpu``, gloo), where the ranges time the same code
but nothing is launched. The wrappers cost about a microsecond a call, and only while profiling:
the step times are taken before, with the ranges switched off.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import importlib
import inspect
import os
import pkgutil
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, record_function

import detection
from detection.audit.ring import seed_rng, step_seed
from detection.guard import GuardConfig, SDCGuard
from detection.simulation.model import ModelConfig, TinyTransformer, loss_fn, make_batch
from detection.stepcheck.gradstats import StatsConfig
from detection.weights.device_graph import set_graphs_enabled

VARIANTS = ("plain", "bare", "checks", "checks-eager", "abft")
MODELS = {
    "2.7M": ModelConfig(vocab=2048, d_model=256, n_heads=4, n_layers=2, seq_len=256, batch=4),
    "17K": ModelConfig(vocab=64, d_model=32, n_heads=2, n_layers=1, seq_len=16, batch=4),
}
_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
_COPIES = ("cudaMemcpyAsync", "cudaMemsetAsync")
# Traced by torch.compile (a range inside would break the graph) or run per element of a loop
# the compiler unrolls: left unwrapped.
_TRACED = {
    "detection.weights.fingerprint",
    "detection.weights.fingerprint_kernels",
    "detection.weights.plan",
}
_TRACED_ENTRY = {
    "fingerprint_on_device",
    "FingerprintPlan.__call__",
    "FingerprintPlan._build",
    "fused_fingerprint",
    "eager_fingerprint",
    "_eager_table",
    "use_fused",
}
# The launcher of ``sdcguard train`` and its ranks' set-up: no part of a guarded step.
_SKIPPED_MODULES = {"detection.harness", "detection.__main__"} | {
    f"detection.simulation.{m}"
    for m in ("forkserver", "cli", "config", "diagnostics", "launch", "rank", "train_args")
}


class _Ranges:
    """Named profiler ranges around every function of ``detection``, on only while profiling."""

    on = False

    @classmethod
    def wrap(cls, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def ranged(*args: Any, **kwargs: Any) -> Any:
            if not cls.on:
                return fn(*args, **kwargs)
            with record_function(f"sdc:{name}"):
                return fn(*args, **kwargs)

        return ranged


def _wrappable(obj: object) -> bool:
    return inspect.isfunction(obj) and not inspect.isgeneratorfunction(obj)


def wrap_detection() -> int:
    """Wrap the functions and methods of every ``detection`` module (before any guard exists,
    so the hooks a guard registers are the wrapped ones). Returns how many were wrapped."""
    modules = [
        importlib.import_module(m.name)
        for m in pkgutil.walk_packages(detection.__path__, "detection.")
        if not m.ispkg and m.name not in _SKIPPED_MODULES
    ]
    wrapped: dict[int, Callable[..., Any]] = {}
    for module in modules:
        traced = module.__name__ in _TRACED
        for attr, obj in list(vars(module).items()):
            if inspect.isclass(obj) and obj.__module__ == module.__name__:
                for name, member in list(vars(obj).items()):
                    qual = f"{obj.__name__}.{name}"
                    if not _wrappable(member) or (traced and qual not in _TRACED_ENTRY):
                        continue
                    if name.startswith("__") and name not in ("__call__", "__init__"):
                        continue
                    setattr(obj, name, _Ranges.wrap(f"{module.__name__[10:]}.{qual}", member))
            elif _wrappable(obj) and obj.__module__ == module.__name__:
                if traced and attr not in _TRACED_ENTRY:
                    continue
                wrapped[id(obj)] = _Ranges.wrap(f"{module.__name__[10:]}.{attr}", obj)
    # a module-level function is also bound in the modules that import it
    for module in modules:
        for attr, obj in list(vars(module).items()):
            if id(obj) in wrapped and _wrappable(obj):
                setattr(module, attr, wrapped[id(obj)])
    return len(wrapped)


def _device_time(event: Any) -> float:
    for attr in ("device_time_total", "cuda_time_total"):
        value = getattr(event, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="profiled steps per variant")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per variant")
    parser.add_argument("--models", default="2.7M,17K", help=f"of {', '.join(MODELS)}")
    parser.add_argument("--top", type=int, default=25, help="functions listed per variant")
    parser.add_argument("--trace", type=Path, help="write Chrome traces here")
    parser.add_argument("--cpu", action="store_true", help="profile on the CPU (gloo)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    torch.set_num_threads(1 if not cuda else torch.get_num_threads())
    count = wrap_detection()
    print(f"{count} functions of detection wrapped in profiler ranges")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    device = torch.device("cuda:0" if cuda else "cpu")
    print(torch.cuda.get_device_name(0) if cuda else "CPU", f"torch {torch.__version__}")
    for model in args.models.split(","):
        _one_model(model, MODELS[model], device, args)
    dist.destroy_process_group()
    return 0


def _one_model(label: str, cfg: ModelConfig, device: torch.device, args: Any) -> None:
    cuda = device.type == "cuda"
    ids = [0] if cuda else None

    def microbatch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return make_batch(cfg, 0, step, rank, device)

    steps: dict[str, Callable[[], None]] = {}
    params = 0
    for name in VARIANTS:
        torch.manual_seed(0)
        ddp = DistributedDataParallel(TinyTransformer(cfg).to(device), device_ids=ids)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        params = sum(p.numel() for p in ddp.parameters())
        guard = None
        if name != "plain":
            config = GuardConfig(
                audit_every=0,
                step_checks=name != "bare",
                abft=name == "abft",
                stats=StatsConfig(warmup=3),
            )
            set_graphs_enabled(name != "checks-eager")  # read when the guard's plans are made
            try:
                guard = SDCGuard(ddp, opt, microbatch=microbatch, loss_fn=loss_fn, config=config)
            finally:
                set_graphs_enabled(True)
        steps[name] = _stepper(ddp, opt, guard, microbatch, device)

    def timed(name: str) -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        steps[name]()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1000.0

    for _ in range(5):
        for name in VARIANTS:
            timed(name)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name in VARIANTS:
            times[name].append(timed(name))
    plain_ms = statistics.median(times["plain"])
    print(f"\n=== {label} model ({params:,} parameters), {device.type}")
    for name in VARIANTS:
        ms = statistics.median(times[name])
        print(f"{name:12s} step {ms:8.3f} ms  (+{ms - plain_ms:7.3f} ms, x{ms / plain_ms:.3f})")

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    launches: dict[str, float] = {}
    for name in VARIANTS:
        _Ranges.on = True
        try:
            with profile(activities=activities) as prof:
                for _ in range(args.steps):
                    steps[name]()
                if cuda:
                    torch.cuda.synchronize()
        finally:
            _Ranges.on = False
        events = prof.key_averages()
        per = 1.0 / args.steps
        launches[name] = sum(e.count for e in events if e.key in _LAUNCHES) * per
        copies = sum(e.count for e in events if e.key in _COPIES) * per
        print(
            f"\n--- {name}: {launches[name]:.1f} kernel launches a step "
            f"(+{launches[name] - launches['plain']:.1f} over plain), {copies:.1f} copies/memsets"
        )
        ours = sorted(
            (e for e in events if e.key.startswith("sdc:")),
            key=lambda e: e.cpu_time_total,
            reverse=True,
        )
        if ours:
            print(
                f"  {'function':58s} {'calls':>6s} {'host µs':>9s} {'self µs':>8s} {'dev µs':>8s}"
            )
        for e in ours[: args.top]:
            print(
                f"  {e.key[4:]:58s} {e.count * per:6.1f} {e.cpu_time_total * per:9.1f} "
                f"{e.self_cpu_time_total * per:8.1f} {_device_time(e) * per:8.1f}"
            )
        if args.trace and name != "plain":
            args.trace.mkdir(parents=True, exist_ok=True)
            _Ranges.on = True
            try:
                with profile(activities=activities) as prof:
                    for _ in range(2):
                        steps[name]()
                    if cuda:
                        torch.cuda.synchronize()
            finally:
                _Ranges.on = False
            raw = args.trace / f"{label}-{name}.json"
            prof.export_chrome_trace(str(raw))
            with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
                dst.write(src.read())
            raw.unlink()


def _stepper(
    ddp: DistributedDataParallel,
    opt: torch.optim.Optimizer,
    guard: SDCGuard | None,
    microbatch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
) -> Callable[[], None]:
    counter = [0]

    def step() -> None:
        s = counter[0]
        counter[0] += 1
        if guard is None:
            seed_rng(step_seed(0, s, 0), device)
            opt.zero_grad(set_to_none=True)
            loss_fn(ddp, microbatch(s, 0)).backward()
            opt.step()
            return
        with guard.step(s):
            opt.zero_grad(set_to_none=True)
            guard.backward(loss_fn(ddp, microbatch(s, 0)))
            opt.step()

    return step


if __name__ == "__main__":
    sys.exit(main())
