"""Step time with sdcguard ÷ plain DDP, side by side in one run (``make bench``).

Every rank holds a replica of the same model per variant, each with its own DDP wrapper and
optimizer:

* ``plain``    — plain DDP, no sdcguard at all (the baseline);
* ``checks``   — SDCGuard without audits and without ABFT checksums (``abft=False``):
  non-finite checks around all-reduce, the weight fingerprint vote, one all-gather per step,
  and the per-step layer (gradient statistics, algebraic all-reduce check, optimizer-state
  check: its row rides in the same all-gather);
* ``torch``    — ``checks`` with :mod:`detection.native`'s C kernels switched off: the per-step
  sums, fingerprints and state flag on torch's ops (a host without a C compiler, or
  ``SDCGUARD_NATIVE=0``), so the two rows say what the kernels save;
* ``defer``    — ``checks`` with ``defer_decision=True``: the row carried in the next step's
  gradient all-reduce and read at that step's end, no collective of the guard's own (the
  decision comes a step later);
* ``bare``     — the same with the per-step layer off (``step_checks=False``), so its own cost
  is the difference of the two rows;
* ``abft``     — ``checks`` with the ABFT checksums (``abft=True``) under their default budget
  (``abft_every=8``: each layer checked once every 8 steps, in rotation): the default
  configuration of an eager model (``GuardConfig.abft=None`` turns them on unless the model is
  compiled);
* ``abft-full`` — ``abft`` with every layer checked on every step (``abft_every=1``);
* ``abft-torch`` — ``abft`` with the C kernels switched off, as ``torch`` is ``checks``: the
  pair measures the checksums' fused passes side by side;
* ``state``    — the same with ``vote_optimizer_state=True`` (the vote also reads Adam's two
  moments, so an optimizer-state fault is named at its own step);
* ``loss``     — SDCGuard auditing every step in ``loss`` mode;
* ``gradient`` — SDCGuard auditing every step in ``gradient`` mode;
* ``gather``   — plain DDP and, after ``optimizer.step``, one all-gather of a row as long as
  the guard's (``all_gather_table``, brought to the host as the guard does) and nothing else:
  the floor under any design that decides every step with a collective of its own. Its row
  is not sdcguard's cost; it says how much of the fixed cost the collective alone takes, and
  so what carrying the row in the gradient all-reduce could save;
* ``hook``     — plain DDP with PyTorch's own averaging comm hook written in Python
  (``default_hooks.allreduce_hook``) in place of DDP's built-in C++ one, and nothing else: the
  floor under any check that reads a gradient bucket before its all-reduce, which only a comm
  hook can (the guard's is one). Like ``gather``, a floor, not sdcguard's cost: together the
  two rows say how much of a small model's target the design's fixed parts leave.

A round runs one step of each (``--block K``: K consecutive steps, their median), in an order
shuffled per round (the same on every rank), so slow drifts of a shared machine hit every
variant alike; the figures are medians over rounds of per-round ratios to ``plain``. Each
round's step (or block) starts after a barrier; with one step that barrier also hides what a
collective of the guard's own costs when ranks drift apart, which a block shows. An audited
job runs ``checks`` steps plus one audited step every K, so

    ratio(K) = ((K - 1)·checks + audit) / K / plain

is exact arithmetic on measured step times (a non-audited step of an audited job runs the very
code of a ``checks`` step). The AWS reference rows are the published overheads of the same
checks in the reference implementation. Next to each CPU ratio stands a 95 % bootstrap interval
of that median over the rounds: on a shared 2-vCPU host a rerun moves a row by a few points, so
a row whose interval straddles its target has not been shown to meet or miss it.

``--sharded 1`` (the default) adds the rows of the sharded guard on each model: FSDP2 and
HSDP, each guarded step ÷ the plain sharded step of the same layout, measured side by side in
a run of their own (``benchmarks/overhead_sharded.py``), with the operations it adds.

``--loop-paths 1`` adds the rows of the loop patterns — autocast, gradient accumulation, batch
shipping — and the replay's peak extra memory (``benchmarks/loop_paths.py``).

A second run repeats every variant on a small model (``--small-*``, about 20K parameters by
default and at most 0.5M), where a step takes milliseconds and what sdcguard adds per step
whatever the model — fingerprint launches, the all-gather, the host synchronisation — dominates;
each table prints that fixed per-step cost in ms (median of ``checks - plain`` per round).

Beside the time ratios, each row prints the operations the guard adds to a step on the torch
path a GPU takes, counted by ``benchmarks/ops_per_step.py`` (its own model: blocks of
Linear+LayerNorm, world size 2; means per step over a period of the checksums' rotation) at
2, 8 and 32 blocks, and their growth per block (``--ops-depths``; ``--ops-depths 0`` skips it).
On a GPU a model that does not fill it pays those launches at some 5-10 µs of host time each.

Run ``python benchmarks/overhead.py --help`` for the knobs; the defaults take a few minutes on
two cores, most of it the one-time compilation of the fingerprint kernel in each rank.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import loop_paths  # benchmarks/ is on sys.path when this file runs as a script
import ops_per_step
import overhead_sharded
import torch
import torch.distributed as dist
from bench_ranks import launch_ranks
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from detection import native
from detection.audit.ring import seed_rng, step_seed
from detection.guard import GuardConfig, SDCGuard
from detection.row.gather import all_gather_table
from detection.simulation.forkserver import PRELOAD as _PRELOAD
from detection.simulation.model import ModelConfig, TinyTransformer, loss_fn, make_batch
from detection.stepcheck.gradstats import StatsConfig
from detection.weights.fingerprint_kernels import set_kernel

VARIANTS = (
    "plain",
    "checks",
    "torch",
    "defer",
    "bare",
    "abft",
    "abft-full",
    "abft-torch",
    "state",
    "loss",
    "gradient",
    "gather",
    "hook",
)
# (row, reference overhead published by AWS, target ratio)
ROWS = (
    ("checks only (no audit)", "checks", 0, 1.074, 1.03),
    ("  (decided a step later)", "defer", 0, None, None),
    ("  (torch ops, native kernels off)", "torch", 0, None, None),
    ("  (per-step layer off)", "bare", 0, 1.074, 1.02),
    ("  (+ ABFT checksums = default)", "abft", 0, None, 1.10),
    ("  (ABFT every layer, every step)", "abft-full", 0, None, None),
    ("  (ABFT, native kernels off)", "abft-torch", 0, None, None),
    ("  (+ optimizer-state vote)", "state", 0, None, None),
    ("loss audit every 10 steps", "loss", 10, 1.125, 1.05),
    ("loss audit every 100 steps", "loss", 100, 1.076, 1.025),
    ("gradient audit every 10 steps", "gradient", 10, 1.347, 1.15),
    ("gradient audit every 100 steps", "gradient", 100, 1.101, 1.03),
    ("plain + one all-gather (floor)", "gather", 0, None, None),
    ("plain + Python comm hook (floor)", "hook", 0, None, None),
)
# Words in the ``gather`` variant's row: the guard's own row is 22 words, 30-50 with the
# per-step layer's row carried in it for these models; gloo's latency is the same over that range.
GATHER_WORDS = 64


SMALL_ROWS = (
    ("small model: checks only", "checks", 0, None, 1.05),
    ("  (decided a step later)", "defer", 0, None, 1.05),
    ("  (torch ops, native kernels off)", "torch", 0, None, None),
)
SMALL_MAX_PARAMS = 500_000


@dataclass(frozen=True)
class Bench:
    world_size: int = 2
    threads: int = 1
    rounds: int = 40
    warmup: int = 2
    # The library's default (``auto``): the fused kernel for the 2.7M weights, the eager table
    # for the buffers and every list under 1M elements.
    kernel: str = "auto"
    vocab: int = 2048
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 2
    seq_len: int = 256
    batch: int = 4
    loop_paths: int = 0  # 1: also the loop-pattern rows (benchmarks/loop_paths.py)
    loop_rounds: int = 20
    small_vocab: int = 64
    small_d_model: int = 32
    small_n_heads: int = 2
    small_n_layers: int = 1
    small_seq_len: int = 16
    small_rounds: int = 200
    # Consecutive steps of a variant per round (each round's figure is their median). 1: every
    # step starts with the ranks aligned by a barrier, which hides what a collective of the
    # guard's own costs when ranks drift apart in a real loop; more shows it.
    block: int = 1
    # The library's default: below 1M elements ``auto`` takes the eager plan, whose views are
    # built once; forcing ``fused`` there measures torch.compile's per-call dispatch instead.
    small_kernel: str = "auto"
    # ``cuda``: each rank on ``cuda:(rank % devices)``, NCCL when every rank has a GPU of its
    # own and gloo (CUDA tensors, staged through the host) when ranks share one; every timed
    # step ends with a device synchronisation, so a step's wall time includes its kernels.
    device: str = "cpu"
    # 1: also the sharded guard's rows (FSDP2, HSDP: benchmarks/overhead_sharded.py), CPU only
    sharded: int = 1

    def small(self) -> Bench:
        """The same benchmark on the small model."""
        return Bench(
            world_size=self.world_size,
            threads=self.threads,
            rounds=self.small_rounds,
            warmup=max(self.warmup, 5),
            block=self.block,
            kernel=self.small_kernel,
            vocab=self.small_vocab,
            d_model=self.small_d_model,
            n_heads=self.small_n_heads,
            n_layers=self.small_n_layers,
            seq_len=self.small_seq_len,
            batch=self.batch,
            device=self.device,
            sharded=self.sharded,
        )

    def model(self) -> ModelConfig:
        return ModelConfig(
            vocab=self.vocab,
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_layers=self.n_layers,
            seq_len=self.seq_len,
            batch=self.batch,
        )


def _placement(bench: Bench, rank: int) -> tuple[torch.device, str]:
    """The rank's device and the process group's backend (see ``Bench.device``)."""
    if bench.device == "cpu":
        return torch.device("cpu"), "gloo"
    if bench.device != "cuda" or not torch.cuda.is_available():
        raise SystemExit(f"--device {bench.device}: no such device here (cpu or cuda)")
    count = torch.cuda.device_count()
    backend = "nccl" if bench.world_size <= count else "gloo"
    return torch.device("cuda", rank % count), backend


@contextlib.contextmanager
def _kernels(variant: str) -> Iterator[None]:
    """The ``torch`` and ``abft-torch`` variants run with :mod:`detection.native` switched off
    (on every rank, as the guard requires): their rows are ``checks`` and ``abft`` on torch's
    ops, so each pair measures the kernels side by side. Every other variant runs with the
    library's default."""
    if variant not in ("torch", "abft-torch"):
        yield
        return
    was = native.is_enabled()
    native.set_enabled(False)
    try:
        yield
    finally:
        native.set_enabled(was)


def _rank(rank: int, bench: Bench, port: int, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(bench.threads)
    set_kernel(bench.kernel)
    device, backend = _placement(bench, rank)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    store = dist.TCPStore(
        "127.0.0.1", port, bench.world_size, False, timeout=timedelta(seconds=120)
    )
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=bench.world_size, timeout=timedelta(seconds=600)
    )
    cfg = bench.model()
    device_ids = [device.index] if cuda else None

    def microbatch(step: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        return make_batch(cfg, 0, step, r, device)

    def settle() -> None:
        """Wait for the device: a timed step ends when its kernels have run, not when they
        were queued."""
        if cuda:
            torch.cuda.synchronize(device)

    ddps: dict[str, DistributedDataParallel] = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    guards: dict[str, SDCGuard] = {}
    modes = {
        "checks": (0, "loss", False),
        "torch": (0, "loss", False),
        "defer": (0, "loss", False),
        "bare": (0, "loss", False),
        "abft": (0, "loss", False),
        "abft-full": (0, "loss", False),
        "abft-torch": (0, "loss", False),
        "state": (0, "loss", True),
        "loss": (1, "loss", False),
        "gradient": (1, "gradient", False),
    }
    for name in VARIANTS:
        torch.manual_seed(0)
        ddps[name] = DistributedDataParallel(TinyTransformer(cfg).to(device), device_ids=device_ids)
        opts[name] = torch.optim.AdamW(ddps[name].parameters(), lr=1e-3)
        if name == "hook":
            ddps[name].register_comm_hook(state=None, hook=allreduce_hook)
        if name in modes:
            every, mode, state = modes[name]
            config = GuardConfig(
                audit_every=every,
                audit_mode=mode,
                vote_optimizer_state=state,
                step_checks=name != "bare",
                abft=name in ("abft", "abft-full", "abft-torch"),
                abft_every=1 if name == "abft-full" else GuardConfig.abft_every,
                defer_decision=name == "defer",
                # a short warm-up, so the rounds measure the tests in force, not calibration
                stats=StatsConfig(warmup=3),
            )
            with _kernels(name):
                guards[name] = SDCGuard(
                    ddps[name], opts[name], microbatch=microbatch, loss_fn=loss_fn, config=config
                )
    steps = dict.fromkeys(VARIANTS, 0)
    gather_row = torch.zeros(GATHER_WORDS, dtype=torch.int64, device=device)

    def one_block(name: str) -> tuple[float, float]:
        """(wall ms, CPU ms) of ``bench.block`` consecutive training steps of one variant: the
        medians of its steps. The ranks start the block together; within it nothing aligns
        them but the training's own collectives, as in a real loop."""
        settle()
        dist.barrier()
        settle()
        times = [one_step(name) for _ in range(bench.block)]
        return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)

    def one_step(name: str) -> tuple[float, float]:
        """(wall ms, CPU ms of this process, all its threads) of one training step."""
        step = steps[name]
        steps[name] += 1
        ddp, opt = ddps[name], opts[name]
        wall, cpu = time.perf_counter(), time.process_time()
        guard = guards.get(name)
        if guard is None:
            seed_rng(step_seed(0, step, rank), device)
            opt.zero_grad(set_to_none=True)
            loss_fn(ddp, microbatch(step, rank)).backward()
            opt.step()
            if name == "gather":
                all_gather_table(gather_row).tolist()
        else:
            with _kernels(name), guard.step(step):
                opt.zero_grad(set_to_none=True)
                guard.backward(loss_fn(ddp, microbatch(step, rank)))
                opt.step()
        settle()
        return (time.perf_counter() - wall) * 1000.0, (time.process_time() - cpu) * 1000.0

    order = list(VARIANTS)
    shuffle = random.Random(1234)
    samples: dict[str, list[dict[str, float]]] = {"wall": [], "cpu": []}
    for round_ in range(bench.warmup + bench.rounds):
        shuffle.shuffle(order)
        times = {name: one_block(name) for name in order}
        if round_ >= bench.warmup:
            samples["wall"].append({name: t[0] for name, t in times.items()})
            samples["cpu"].append({name: t[1] for name, t in times.items()})
    for guard in guards.values():
        guard.close()  # decides the deferred variant's last step
    alarms = sum(len(g.alarms) for g in guards.values())
    params = sum(p.numel() for p in ddps["plain"].parameters())
    loops = (
        loop_paths.run_rank(rank, cfg, bench.loop_rounds, bench.warmup)
        if bench.loop_paths
        else None
    )
    dist.destroy_process_group()
    if rank == 0:
        where = torch.cuda.get_device_name(device) if cuda else "CPU"
        record = {
            "samples": samples,
            "alarms": alarms,
            "params": params,
            "loops": loops,
            "placement": f"{backend} on {where}",
        }
        Path(out).write_text(json.dumps(record))


def _run(bench: Bench) -> dict[str, Any]:
    return launch_ranks(_rank, bench, bench.world_size, preload=_PRELOAD, prefix="sdcguard-bench-")


def _ratio(samples: list[dict[str, float]], variant: str, every: int) -> float:
    k = every or 1  # one step of `variant` every k steps, the others are `checks` steps
    return statistics.median(((k - 1) * s["checks"] + s[variant]) / k / s["plain"] for s in samples)


def _interval(
    samples: list[dict[str, float]], variant: str, every: int, draws: int = 1000
) -> tuple[float, float]:
    """A 95 % bootstrap interval of :func:`_ratio` (rounds resampled with replacement, a fixed
    seed): how far the row could move on a rerun on this host in this load."""
    pick = random.Random(0)
    n = len(samples)
    medians = sorted(
        _ratio([samples[pick.randrange(n)] for _ in range(n)], variant, every) for _ in range(draws)
    )
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def _fixed_ms(samples: list[dict[str, float]], variant: str = "checks") -> float:
    return statistics.median(s[variant] - s["plain"] for s in samples)


# The counter's configuration (benchmarks/ops_per_step.py VARIANTS) of each timed variant: the
# counter runs the GPU's torch path whatever the kernels, so ``torch`` counts as ``checks``.
OPS_VARIANT = {
    "checks": "checks",
    "torch": "checks",
    "defer": "defer",
    "bare": "bare",
    "abft": "default",
    "abft-full": "abft-full",
    "abft-torch": "default",
    "state": "state",
    "loss": "loss-audit",
    "gradient": "gradient-audit",
}


def _ops(depths: list[int], sharded: bool = False) -> dict[str, list[dict[str, Any]]]:
    """The counter's rows for every configuration the tables time (one pair of ranks)."""
    variants = sorted(set(OPS_VARIANT.values()))
    return ops_per_step.table(depths, variants + (["fsdp", "hsdp"] if sharded else []))


def _sharded_rows(bench: Bench, ops: dict[str, list[dict[str, Any]]] | None) -> str:
    """The sharded guard's rows on ``bench``'s model, in a run of their own."""
    sharded = overhead_sharded.ShardedBench(
        world_size=bench.world_size,
        threads=bench.threads,
        rounds=bench.rounds,
        warmup=bench.warmup,
        model=bench.model(),
    )
    return overhead_sharded.table(sharded, overhead_sharded.run(sharded), ops)


def _ops_cells(ops: dict[str, list[dict[str, Any]]], variant: str, every: int) -> str:
    """Operations added per step at each depth and per block, as ``_ratio`` mixes an audited
    job's steps: ``((K - 1)·checks + audit) / K``."""
    name = OPS_VARIANT.get(variant)
    if name is None:
        return ""
    rows = ops[name]
    if every:
        checks = ops["checks"]
        rows = [
            {**r, "added": ((every - 1) * c["added"] + r["added"]) / every}
            for r, c in zip(rows, checks, strict=True)
        ]
    added = "/".join(f"{r['added']:.0f}" for r in rows)
    return f"  {added:>14} {ops_per_step.per_block(rows):6.1f}" if len(rows) > 1 else added


def _table(
    bench: Bench,
    result: dict[str, Any],
    rows: tuple[Any, ...] = ROWS,
    ops: dict[str, list[dict[str, Any]]] | None = None,
) -> str:
    """The rows' ratios, wall and CPU. Which of the two a target is held to: CPU time on CPU
    (a shared host's wall time includes waiting for the other rank's core), wall time on a GPU
    (a step's kernels run off the host; its CPU time is only what launched them)."""
    wall, cpu = result["samples"]["wall"], result["samples"]["cpu"]
    held, held_name = (wall, "wall") if bench.device == "cuda" else (cpu, "CPU")

    def medians(samples: list[dict[str, float]]) -> str:
        return ", ".join(f"{v} {statistics.median(s[v] for s in samples):.1f}" for v in VARIANTS)

    lines = [
        f"sdcguard overhead: world size {bench.world_size}, {bench.threads} thread(s) per rank, "
        f"{result.get('placement', 'gloo on CPU')}, fingerprint kernel {bench.kernel}",
        f"model: TinyTransformer d_model={bench.d_model} layers={bench.n_layers} "
        f"heads={bench.n_heads} vocab={bench.vocab}, {result['params']:,} parameters, "
        f"AdamW; {bench.batch}x{bench.seq_len} = {bench.batch * bench.seq_len} tokens per rank "
        "per step (dropout 0.1, BatchNorm)",
        f"{len(wall)} interleaved rounds after {bench.warmup} warm-up rounds, "
        f"{bench.block} consecutive step(s) of each variant per round",
        f"median step wall ms: {medians(wall)}",
        f"median step CPU ms (rank 0, all threads): {medians(cpu)}",
        f"alarms raised during the benchmark: {result['alarms']}",
        f"fixed per-step cost of the checks (median checks - plain): "
        f"{_fixed_ms(wall):.3f} ms wall, {_fixed_ms(cpu):.3f} ms CPU; of which one all-gather "
        f"alone (median gather - plain): {_fixed_ms(wall, 'gather'):.3f} ms wall, "
        f"{_fixed_ms(cpu, 'gather'):.3f} ms CPU; a Python comm hook alone (median hook - plain): "
        f"{_fixed_ms(wall, 'hook'):.3f} ms wall, {_fixed_ms(cpu, 'hook'):.3f} ms CPU",
        "ratios: median over rounds of (sdcguard step / plain step of the same round); "
        f"{held_name} 95 %: a bootstrap interval of that median over the rounds",
    ]
    header = (
        f"{'':32} {'wall':>7} {'CPU':>7} {held_name + ' 95 %':>13} {'target':>7} "
        f"{'AWS ref':>8}  met ({held_name})"
    )
    if ops:
        depths = "/".join(str(r["blocks"]) for r in next(iter(ops.values())))
        plain = "/".join(f"{r['plain']:.0f}" for r in next(iter(ops.values())))
        lines.append(
            f"ops: operations the guard adds per step on a GPU's torch path "
            f"(benchmarks/ops_per_step.py: blocks of Linear+LayerNorm, world size 2) at "
            f"{depths} blocks, where a plain step takes {plain}; and per block"
        )
        header = f"{header:<80} {'ops ' + depths:>16} {'/block':>6}"
    lines += ["", header]
    for label, variant, every, reference, target in rows:
        r_wall, r_cpu = _ratio(wall, variant, every), _ratio(cpu, variant, every)
        r_held = _ratio(held, variant, every)
        low, high = _interval(held, variant, every)
        row = f"{label:32} {r_wall:7.3f} {r_cpu:7.3f} {low:6.3f}-{high:6.3f}"
        if target is not None:
            met = "yes" if r_held <= target else f"no (+{(r_held - target) * 100:.1f} pt)"
            ref = f"{reference:8.3f}" if reference is not None else f"{'-':>8}"
            row += f" {target:7.3f} {ref}  {met}"
        if ops:
            row = f"{row:<80}{_ops_cells(ops, variant, every)}"
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Bench()
    for name, value in asdict(defaults).items():
        kind = type(value)
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value)
    parser.add_argument("--dump", type=Path, default=None, help="write the raw samples here")
    parser.add_argument("--small-only", action="store_true", help="only the small-model run")
    parser.add_argument(
        "--ops-depths",
        type=int,
        nargs="+",
        default=[2, 8, 32],
        help="depths of the operation counts beside the ratios (0: none)",
    )
    args = parser.parse_args(argv)
    extra = ("dump", "small_only", "ops_depths")
    options = {k: v for k, v in vars(args).items() if k not in extra}
    bench = Bench(**options)
    if bench.loop_paths and bench.device != "cpu":
        raise SystemExit("--loop-paths runs on the CPU only")
    sharded = bool(bench.sharded) and bench.device == "cpu"  # the sharded guard: CPU-tested
    started = time.monotonic()
    depths = [d for d in args.ops_depths if d > 0]
    ops = _ops(depths, sharded) if depths else None
    if not args.small_only:
        result = _run(bench)
        if args.dump is not None:
            args.dump.write_text(json.dumps({**result, "ops": ops}))
        print(_table(bench, result, ROWS, ops))
        if result.get("loops"):
            print(loop_paths.table(result["loops"]))
        if sharded:
            print()
            print(_sharded_rows(bench, ops))
    small = bench.small()
    small_result = _run(small)
    if small_result["params"] > SMALL_MAX_PARAMS:
        raise SystemExit(f"the small model has {small_result['params']:,} parameters (> 0.5M)")
    print()
    print(_table(small, small_result, (*SMALL_ROWS, *ROWS), ops))
    if sharded:
        print()
        print(_sharded_rows(small, ops))
    print(f"(took {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
