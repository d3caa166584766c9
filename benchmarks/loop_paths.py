"""The loop-pattern rows of ``benchmarks/overhead.py`` (``--loop-paths``): autocast, gradient
accumulation, batch shipping, and the replay's peak extra memory.

Every rank holds one replica per variant, as ``overhead.py`` does, and a round runs one step of
each in an order shuffled per round (the same on every rank); figures are medians over rounds of
per-round ratios:

* ``autocast``: a bfloat16 ``torch.autocast`` loop — guarded, auditing every step in loss or
  gradient mode — ÷ the same loop on plain DDP;
* ``accumulation``: four micro-batches per step with ``no_sync`` — guarded, auditing every step
  — ÷ the same loop on plain DDP;
* ``shipping``: a loss audit on every step fed by ``guard.backward(loss, batch=batch)`` (the
  batch is shipped to the auditor) ÷ the same audit fed by a pure ``microbatch(step, rank)``.

Peak extra memory of one replay (rank 0, after the rounds): the heap in use, sampled after every
module's forward and at every parameter's gradient during the replay, minus the heap in use
before it — next to the size of one gradient of the model, the bound ``docs/detection-design.md``
states.
"""

from __future__ import annotations

import contextlib
import ctypes
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detection.audit.ring import AuditMode, PartnerRecompute, seed_rng, step_seed
from detection.guard import GuardConfig, SDCGuard
from detection.simulation.model import ModelConfig, TinyTransformer, loss_fn, make_batch

ACCUM = 4
VARIANTS = (
    "plain-autocast",
    "autocast-loss",
    "autocast-gradient",
    "plain-accum",
    "accum-loss",
    "accum-gradient",
    "pure-loss",
    "shipped-loss",
)
# (label, variant, baseline)
ROWS = (
    ("autocast bf16, loss audit every step", "autocast-loss", "plain-autocast"),
    ("autocast bf16, gradient audit every step", "autocast-gradient", "plain-autocast"),
    ("accumulation x4, loss audit every step", "accum-loss", "plain-accum"),
    ("accumulation x4, gradient audit every step", "accum-gradient", "plain-accum"),
    ("shipped batch vs pure microbatch (loss)", "shipped-loss", "pure-loss"),
)


class _MallInfo(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap_in_use() -> int:
    """Bytes malloc has handed out and not got back (glibc ``mallinfo2``)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


@contextlib.contextmanager
def _peak_sampler(module: nn.Module) -> Iterator[dict[str, int]]:
    """Sample the heap after every submodule's forward and at every parameter's gradient."""
    seen = {"start": _heap_in_use(), "peak": 0}
    seen["peak"] = seen["start"]

    def sample(*_args: Any) -> None:
        seen["peak"] = max(seen["peak"], _heap_in_use())

    handles = [m.register_forward_hook(sample) for m in module.modules()]
    handles += [p.register_hook(sample) for p in module.parameters() if p.requires_grad]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def replay_peak_bytes(cfg: ModelConfig) -> dict[str, float]:
    """Peak extra heap of one loss replay, one gradient replay and one gradient replay of a
    group of ``ACCUM`` micro-batches, in MB, and the size of one gradient."""
    torch.manual_seed(0)
    model = TinyTransformer(cfg)
    params = list(model.parameters())
    partition = [list(range(len(params)))]
    out: dict[str, float] = {"gradient_size_mb": sum(p.numel() * 4 for p in params) / 1e6}
    for label, mode, micros in (
        ("loss", AuditMode.LOSS, 1),
        ("gradient", AuditMode.GRADIENT, 1),
        ("gradient_accum4", AuditMode.GRADIENT, ACCUM),
    ):
        replay = PartnerRecompute(
            model,
            loss_fn=loss_fn,
            microbatch=lambda s, r, m=0: make_batch(cfg, 0, s * ACCUM + m, r),
            mode=mode,
            seed=0,
            partner=1,
            injector=None,
            micro_batches=micros,
        )
        batches = {m: make_batch(cfg, 0, m, 1) for m in range(micros)}
        peaks = []
        for _ in range(3):  # the first run warms the allocator and the thread pools
            replay.buffers.capture()
            with _peak_sampler(model) as seen:
                replay.run(0, partition, micros=list(range(micros)), batches=batches)
            peaks.append(seen["peak"] - seen["start"])
        out[f"{label}_peak_mb"] = min(peaks[1:]) / 1e6
    return out


def run_rank(rank: int, cfg: ModelConfig, rounds: int, warmup: int) -> dict[str, Any]:
    """Collective: the interleaved rounds on this rank; rank 0's result is the one reported."""
    device = torch.device("cpu")

    def pure(step: int, r: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return make_batch(cfg, 0, step * ACCUM + micro, r)

    ddps: dict[str, DistributedDataParallel] = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    guards: dict[str, SDCGuard] = {}
    for name in VARIANTS:
        torch.manual_seed(0)
        ddps[name] = DistributedDataParallel(TinyTransformer(cfg))
        opts[name] = torch.optim.AdamW(ddps[name].parameters(), lr=1e-3)
        if name.startswith("plain"):
            continue
        mode = name.rsplit("-", 1)[1]
        config = GuardConfig(
            audit_every=1, audit_mode=mode, micro_batches=ACCUM if "accum" in name else 1
        )
        guards[name] = SDCGuard(
            ddps[name],
            opts[name],
            microbatch=None if name == "shipped-loss" else pure,
            loss_fn=loss_fn,
            config=config,
        )
    steps = dict.fromkeys(VARIANTS, 0)

    def one_step(name: str) -> float:
        step = steps[name]
        steps[name] += 1
        ddp, opt, guard = ddps[name], opts[name], guards.get(name)
        micros = ACCUM if "accum" in name else 1
        autocast = "autocast" in name
        dist.barrier()
        began = time.process_time()
        with guard.step(step) if guard is not None else contextlib.nullcontext():
            if guard is None:
                seed_rng(step_seed(0, step, rank), device)
            opt.zero_grad(set_to_none=True)
            for micro in range(micros):
                batch = pure(step, rank, micro)
                last = micro == micros - 1
                with contextlib.nullcontext() if last else ddp.no_sync():
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        loss = loss_fn(ddp, batch)
                    if guard is None:
                        loss.backward()
                    else:
                        guard.backward(loss, batch=batch if name == "shipped-loss" else None)
            opt.step()
        return (time.process_time() - began) * 1000.0

    order = list(VARIANTS)
    shuffle = random.Random(4321)
    samples: list[dict[str, float]] = []
    for round_ in range(warmup + rounds):
        shuffle.shuffle(order)
        times = {name: one_step(name) for name in order}
        if round_ >= warmup:
            samples.append(times)
    alarms = sum(len(g.alarms) for g in guards.values())
    memory = replay_peak_bytes(cfg) if rank == 0 else {}
    return {"samples": samples, "alarms": alarms, "memory": memory}


def table(result: dict[str, Any]) -> str:
    samples = result["samples"]

    def ratio(variant: str, base: str) -> float:
        return statistics.median(s[variant] / s[base] for s in samples)

    lines = [
        "",
        f"loop paths ({len(samples)} interleaved rounds; CPU ms of rank 0; alarms raised: "
        f"{result['alarms']})",
        "median step CPU ms: "
        + ", ".join(f"{v} {statistics.median(s[v] for s in samples):.1f}" for v in VARIANTS),
    ]
    lines += [f"{label:44} {ratio(v, b):7.3f}" for label, v, b in ROWS]
    mem = result["memory"]
    lines.append(
        f"replay peak extra memory: loss {mem['loss_peak_mb']:.2f} MB, gradient "
        f"{mem['gradient_peak_mb']:.2f} MB, gradient of 4 micro-batches "
        f"{mem['gradient_accum4_peak_mb']:.2f} MB (one gradient: {mem['gradient_size_mb']:.2f} MB)"
    )
    return "\n".join(lines)
