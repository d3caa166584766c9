"""The guard on a real-size model on one GPU: a Llama-style decoder, plain vs default vs full.

A model of a few million parameters measures launch overhead, not arithmetic (``overhead.py``):
its plain step is a few milliseconds of kernel launches, so the guard's fixed launches dominate.
Here the model fills the GPU: a Llama-style decoder (RMSNorm, rotary positions, causal
attention through ``scaled_dot_product_attention``, a SwiGLU MLP, untied embedding and head, no
biases) of about 370M parameters by default, sequence 2,048, bf16 autocast, AdamW, DDP at world
size 1 over NCCL. Three replicas of the same model, each with its own DDP wrapper and optimizer:

* ``plain``   — no sdcguard;
* ``default`` — ``SDCGuard`` with ``GuardConfig()``: the per-step layer, the weight vote, the
  layer checksums under their budget (``abft_every=8``: each layer checked once every 8 steps);
* ``full``    — the same with ``abft_every=1``: every layer's checksums on every step.

A round runs ``--block`` consecutive steps of each, in an order shuffled per round; each step
ends with a device synchronisation, so its wall time includes its kernels. The table gives the
median step, the median over rounds of each guarded step ÷ the plain step of the same round with
a 95 % bootstrap interval, and the milliseconds added per step. Targets: default ≤ 1.03, full
checksums ≤ 1.10. It then profiles a few steps of each and counts, per step, the host
synchronisations (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
``cudaEventSynchronize``, synchronous ``cudaMemcpy``; budget: one added, the read-back of the
decision row) and the kernel and graph launches.

Sized to finish within 8 minutes on one H100 (``make bench-cuda``), with a wall-clock budget
(``--budget-s``) that ends the timed rounds early rather than overrun. ``--tiny`` runs a toy
size (on the CPU over gloo when there is no GPU, or with ``--cpu``), to check the script itself::

    python benchmarks/cuda_llama.py                  # on a GPU: the real size
    python benchmarks/cuda_llama.py --tiny --cpu     # anywhere, in seconds
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detection.guard import GuardConfig, SDCGuard

VARIANTS = ("plain", "default", "full")
TARGETS = {"default": 1.03, "full": 1.10}


@dataclass(frozen=True)
class Size:
    vocab: int = 32_000
    d_model: int = 1024
    n_layers: int = 24
    n_heads: int = 16
    ffn: int = 2816  # ≈ 8/3 · d_model, a multiple of 256 (Llama's SwiGLU width)
    seq_len: int = 2048
    batch: int = 4


TINY = Size(vocab=256, d_model=64, n_layers=2, n_heads=4, ffn=176, seq_len=64, batch=2)


class Attention(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.heads = size.n_heads
        self.head_dim = size.d_model // size.n_heads
        self.wq = nn.Linear(size.d_model, size.d_model, bias=False)
        self.wk = nn.Linear(size.d_model, size.d_model, bias=False)
        self.wv = nn.Linear(size.d_model, size.d_model, bias=False)
        self.wo = nn.Linear(size.d_model, size.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, d))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (the half-split form)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.gate = nn.Linear(size.d_model, size.ffn, bias=False)
        self.up = nn.Linear(size.d_model, size.ffn, bias=False)
        self.down = nn.Linear(size.ffn, size.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(size.d_model)
        self.attn = Attention(size)
        self.mlp_norm = nn.RMSNorm(size.d_model)
        self.mlp = SwiGLU(size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.embed = nn.Embedding(size.vocab, size.d_model)
        self.blocks = nn.ModuleList(Block(size) for _ in range(size.n_layers))
        self.norm = nn.RMSNorm(size.d_model)
        self.head = nn.Linear(size.d_model, size.vocab, bias=False)
        half = size.d_model // size.n_heads // 2
        inv = 1.0 / (10_000 ** (torch.arange(half, dtype=torch.float32) / half))
        angles = torch.outer(torch.arange(size.seq_len, dtype=torch.float32), inv)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


Batch = tuple[torch.Tensor, torch.Tensor]


def make_batch(size: Size, step: int, rank: int, device: torch.device) -> Batch:
    g = torch.Generator(device=device).manual_seed(step * 1009 + rank)
    tokens = torch.randint(0, size.vocab, (size.batch, size.seq_len + 1), generator=g,
                           device=device)  # fmt: skip
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    tokens, targets = batch
    device_type = tokens.device.type
    with torch.autocast(device_type, dtype=torch.bfloat16):
        logits = model(tokens)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


_BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
_LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")


def _profile(fn: Callable[[int], None], first: int, steps: int) -> tuple[float, float]:
    """(host synchronisations, kernel and graph launches) per step of ``fn``, profiled."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for step in range(first, first + steps):
            fn(step)
        torch.cuda.synchronize()
    syncs = launches = 0
    for event in prof.events():
        name = event.name
        if any(name.startswith(b) for b in _BLOCKING) and not name.startswith("cudaMemcpyAsync"):
            syncs += 1
        elif name.startswith(_LAUNCH):
            launches += 1
    return syncs / steps, launches / steps


def _interval(ratios: list[float], draws: int = 1000) -> tuple[float, float]:
    pick = random.Random(0)
    n = len(ratios)
    medians = sorted(
        statistics.median(ratios[pick.randrange(n)] for _ in range(n)) for _ in range(draws)
    )
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def run(size: Size, device: torch.device, *, rounds: int, block: int, warmup: int,
        budget_s: float, profile_steps: int) -> dict[str, Any]:  # fmt: skip
    cuda = device.type == "cuda"
    ids = [device.index] if cuda else None
    models: dict[str, DistributedDataParallel] = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    guards: dict[str, SDCGuard] = {}

    def microbatch(step: int, rank: int) -> Batch:
        return make_batch(size, step, rank, device)

    for name in VARIANTS:
        torch.manual_seed(0)
        models[name] = DistributedDataParallel(Decoder(size).to(device), device_ids=ids)
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-4)
        if name != "plain":
            config = GuardConfig() if name == "default" else GuardConfig(abft_every=1)
            guards[name] = SDCGuard(models[name], opts[name], microbatch=microbatch,
                                    loss_fn=loss_fn, config=config)  # fmt: skip
    params = sum(p.numel() for p in models["plain"].parameters())
    steps = dict.fromkeys(VARIANTS, 0)

    def settle() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def one_step(name: str, step: int) -> None:
        model, opt, guard = models[name], opts[name], guards.get(name)
        batch = microbatch(step, 0)
        if guard is None:
            opt.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
            opt.step()
            return
        with guard.step(step):
            opt.zero_grad(set_to_none=True)
            guard.backward(loss_fn(model, batch))
            opt.step()

    def timed(name: str) -> float:
        """Median wall ms of ``block`` consecutive steps of one variant."""
        times = []
        for _ in range(block):
            settle()
            started = time.perf_counter()
            one_step(name, steps[name])
            settle()
            times.append((time.perf_counter() - started) * 1000.0)
            steps[name] += 1
        return statistics.median(times)

    started = time.monotonic()
    for _ in range(warmup):  # compiles, CUDA graphs captured, a whole rotation of checksums
        for name in VARIANTS:
            for _ in range(max(block, 1)):
                one_step(name, steps[name])
                steps[name] += 1
    settle()
    warm_s = time.monotonic() - started
    order = list(VARIANTS)
    shuffle = random.Random(1234)
    samples: list[dict[str, float]] = []
    timing = time.monotonic()
    for _ in range(rounds):
        if samples and time.monotonic() - started > budget_s:
            break
        shuffle.shuffle(order)
        samples.append({name: timed(name) for name in order})
    timed_s = time.monotonic() - timing
    profiled: dict[str, tuple[float, float]] = {}
    if cuda and profile_steps:
        for name in VARIANTS:
            first = steps[name]
            profiled[name] = _profile(lambda s, n=name: one_step(n, s), first, profile_steps)
            steps[name] += profile_steps
    for guard in guards.values():
        guard.close()
    return {
        "params": params,
        "samples": samples,
        "profiled": profiled,
        "alarms": sum(len(g.alarms) for g in guards.values()),
        "warm_s": warm_s,
        "timed_s": timed_s,
    }


def report(size: Size, where: str, result: dict[str, Any]) -> str:
    samples = result["samples"]
    lines = [
        f"Llama-style decoder: {result['params'] / 1e6:.0f}M parameters, d_model "
        f"{size.d_model}, {size.n_layers} layers, {size.n_heads} heads, SwiGLU {size.ffn}, "
        f"vocab {size.vocab}; {size.batch} x {size.seq_len} tokens a step, bf16 autocast, AdamW",
        f"{where}; DDP world size 1; {len(samples)} interleaved rounds (warm-up "
        f"{result['warm_s']:.0f} s, timed {result['timed_s']:.0f} s); alarms: {result['alarms']}",
        f"default = GuardConfig() (checksums every {GuardConfig.abft_every} steps per layer), "
        "full = GuardConfig(abft_every=1)",
        "",
        f"{'variant':8} {'step ms':>9} {'ratio':>7} {'95 %':>13} {'ms added':>9} {'target':>7}"
        f" {'met':>4}",
    ]
    plain = statistics.median(s["plain"] for s in samples)
    lines.append(f"{'plain':8} {plain:9.2f}")
    for name in VARIANTS[1:]:
        ratios = [s[name] / s["plain"] for s in samples]
        ratio = statistics.median(ratios)
        low, high = _interval(ratios)
        added = statistics.median(s[name] - s["plain"] for s in samples)
        step = statistics.median(s[name] for s in samples)
        target = TARGETS[name]
        lines.append(
            f"{name:8} {step:9.2f} {ratio:7.3f} {low:6.3f}-{high:6.3f} {added:9.2f} "
            f"{target:7.2f} {'yes' if ratio <= target else 'no':>4}"
        )
    profiled = result["profiled"]
    if profiled:
        base_syncs, base_launches = profiled["plain"]
        lines += ["", "profiled per step: host synchronisations (added; budget 1), launches"]
        for name, (syncs, launches) in profiled.items():
            lines.append(
                f"{name:8} syncs {syncs:6.2f} (+{syncs - base_syncs:.2f})  kernel/graph "
                f"launches {launches:7.1f} (+{launches - base_launches:.1f})"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a toy size, to check the script")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (gloo)")
    parser.add_argument("--layers", type=int, default=None, help="override the depth")
    parser.add_argument("--batch", type=int, default=None, help="sequences a step")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--block", type=int, default=2, help="steps of a variant per round")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up rounds (default: a whole rotation and 2 more)")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=360.0,
                        help="stop timing new rounds after this many seconds in all")  # fmt: skip
    parser.add_argument("--profile-steps", type=int, default=4)
    args = parser.parse_args(argv)
    size = TINY if args.tiny else Size()
    if args.layers is not None:
        size = Size(**{**size.__dict__, "n_layers": args.layers})
    if args.batch is not None:
        size = Size(**{**size.__dict__, "batch": args.batch})
    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and not args.tiny:
        print(
            "no CUDA device (or --cpu): the real size needs a GPU; use --tiny to check the script"
        )
        return 2
    device = torch.device("cuda:0" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    rotation = GuardConfig.abft_every
    warmup = args.warmup if args.warmup is not None else math.ceil(rotation / args.block) + 2
    try:
        result = run(size, device, rounds=args.rounds, block=args.block, warmup=warmup,
                     budget_s=args.budget_s, profile_steps=args.profile_steps)  # fmt: skip
    finally:
        dist.destroy_process_group()
    where = torch.cuda.get_device_name(device) if cuda else "CPU, gloo (a toy check, no timing)"
    print(report(size, where, result))
    return 0 if result["alarms"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
