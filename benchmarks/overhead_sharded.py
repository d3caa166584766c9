"""Step time of the sharded guard ÷ a plain sharded step, FSDP2 and HSDP, side by side in one
run — the sharded rows of ``benchmarks/overhead.py`` (which imports this module; it also runs
alone: ``python benchmarks/overhead_sharded.py --rounds 5``).

Every rank holds the same model four times, each sharded as FSDP2's tutorial shards it
(``fully_shard`` on each block, then the root) with its own optimizer:

* ``plain-fsdp`` / ``fsdp`` — FSDP2 on a 1-D mesh of every rank, without and with
  ``SDCGuard`` (what the sharded guard runs by default: :mod:`detection.guard.sharded`);
* ``plain-hsdp`` / ``hsdp`` — HSDP on a ``(2, world / 2)`` mesh: two replicas; at world
  size 2 each replica is one rank (2x1: no reduce-scatter partner, the vote across the two),
  at 4 a 2x2 mesh. Two cores make a 2x2 run four processes on two cores: its times are
  mostly waiting, so the default is world size 2 and the 2x1 mesh.

A round runs one step of each variant, in an order shuffled per round (the same on every
rank), each after a barrier; a row is the median over rounds of the per-round ratio of the
guarded step to the plain step of the same layout, as ``overhead.py``'s rows are, with a 95 %
bootstrap interval of that median. The rows run no ring audit (its cost is a forward of a partner's
micro-batch every K steps, as under DDP) and the sharded guard runs no checksums, so there is
one row per layout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_ranks import launch_ranks  # benchmarks/ is on sys.path when run as a script
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from detection.audit.ring import seed_rng, step_seed
from detection.guard import GuardConfig, SDCGuard
from detection.simulation.forkserver import PRELOAD
from detection.simulation.model import ModelConfig, TinyTransformer, loss_fn, make_batch
from detection.stepcheck.gradstats import StatsConfig

VARIANTS = ("plain-fsdp", "fsdp", "plain-hsdp", "hsdp")
#: (row label, guarded variant, its plain baseline)
ROWS = (
    ("FSDP2: sharded guard", "fsdp", "plain-fsdp"),
    ("HSDP: sharded guard", "hsdp", "plain-hsdp"),
)


@dataclass(frozen=True)
class ShardedBench:
    world_size: int = 2
    threads: int = 1
    rounds: int = 40
    warmup: int = 2
    model: ModelConfig = field(default_factory=ModelConfig)

    def hsdp_mesh(self) -> tuple[int, int]:
        if self.world_size % 2:
            raise SystemExit(f"HSDP rows need an even world size, not {self.world_size}")
        return (2, self.world_size // 2)


def _sharded(cfg: ModelConfig, mesh_shape: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(0)
    model = TinyTransformer(cfg)
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _rank(rank: int, bench: ShardedBench, port: int, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(bench.threads)
    store = dist.TCPStore("127.0.0.1", port, bench.world_size, False, timedelta(seconds=120))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=bench.world_size, timeout=timedelta(seconds=600)
    )
    cfg = bench.model
    meshes = {"fsdp": (bench.world_size,), "hsdp": bench.hsdp_mesh()}
    models: dict[str, nn.Module] = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    guards: dict[str, Any] = {}
    for name in VARIANTS:
        layout = name.removeprefix("plain-")
        models[name] = _sharded(cfg, meshes[layout])
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-3)
        if not name.startswith("plain-"):
            # a short warm-up, so the rounds measure the tests in force
            config = GuardConfig(stats=StatsConfig(warmup=3))
            guards[name] = SDCGuard(models[name], opts[name], loss_fn=loss_fn, config=config)
    steps = dict.fromkeys(VARIANTS, 0)

    def one_step(name: str) -> tuple[float, float]:
        dist.barrier()
        step = steps[name]
        steps[name] += 1
        model, opt, guard = models[name], opts[name], guards.get(name)
        batch = make_batch(cfg, 0, step, rank)
        wall, cpu = time.perf_counter(), time.process_time()
        if guard is None:
            seed_rng(step_seed(0, step, rank), torch.device("cpu"))
            opt.zero_grad(set_to_none=True)
            loss_fn(model, batch).backward()
            opt.step()
        else:
            with guard.step(step):
                opt.zero_grad(set_to_none=True)
                guard.backward(loss_fn(model, batch))
                opt.step()
        return (time.perf_counter() - wall) * 1000.0, (time.process_time() - cpu) * 1000.0

    order = list(VARIANTS)
    shuffle = random.Random(1234)
    samples: dict[str, list[dict[str, float]]] = {"wall": [], "cpu": []}
    for round_ in range(bench.warmup + bench.rounds):
        shuffle.shuffle(order)
        times = {name: one_step(name) for name in order}
        if round_ >= bench.warmup:
            samples["wall"].append({n: t[0] for n, t in times.items()})
            samples["cpu"].append({n: t[1] for n, t in times.items()})
    alarms = sum(len(g.alarms) for g in guards.values())
    params = sum(p.numel() for p in models["fsdp"].parameters())  # DTensor: global numel
    for guard in guards.values():
        guard.close()
    dist.destroy_process_group()
    if rank == 0:
        record = {"samples": samples, "alarms": alarms, "params": params}
        Path(out).write_text(json.dumps(record))


def run(bench: ShardedBench) -> dict[str, Any]:
    """The rounds' samples (rank 0's), the alarms raised, the model's parameter count."""
    return launch_ranks(
        _rank, bench, bench.world_size, preload=PRELOAD, prefix="sdcguard-bench-sharded-"
    )


def _ratio(samples: list[dict[str, float]], variant: str, plain: str) -> float:
    return statistics.median(s[variant] / s[plain] for s in samples)


def _interval(
    samples: list[dict[str, float]], variant: str, plain: str, draws: int = 1000
) -> tuple[float, float]:
    pick = random.Random(0)
    n = len(samples)
    medians = sorted(
        _ratio([samples[pick.randrange(n)] for _ in range(n)], variant, plain) for _ in range(draws)
    )
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def table(
    bench: ShardedBench, result: dict[str, Any], ops: dict[str, list[dict[str, Any]]] | None
) -> str:
    """The rows: wall and CPU ratios, the CPU interval (CPU time is what a target is held to
    on a shared CPU host, as in ``overhead.py``), and the operations the sharded guard adds
    per step (``benchmarks/ops_per_step.py``'s ``fsdp`` / ``hsdp`` variants) where counted."""
    wall, cpu = result["samples"]["wall"], result["samples"]["cpu"]

    def medians(samples: list[dict[str, float]]) -> str:
        return ", ".join(f"{v} {statistics.median(s[v] for s in samples):.1f}" for v in VARIANTS)

    cfg = bench.model
    lines = [
        f"sharded guard overhead: world size {bench.world_size}, {bench.threads} thread(s) per "
        f"rank, gloo on CPU; FSDP2 mesh ({bench.world_size},), HSDP mesh {bench.hsdp_mesh()}",
        f"model: TinyTransformer d_model={cfg.d_model} layers={cfg.n_layers} vocab={cfg.vocab},"
        f" {result['params']:,} parameters, AdamW; fully_shard on each block and the root",
        f"{len(wall)} interleaved rounds after {bench.warmup} warm-up rounds",
        f"median step wall ms: {medians(wall)}",
        f"median step CPU ms (rank 0): {medians(cpu)}",
        f"alarms raised during the benchmark: {result['alarms']}",
    ]
    header = f"{'':32} {'wall':>7} {'CPU':>7} {'CPU 95 %':>13}"
    if ops:
        depths = "/".join(str(r["blocks"]) for r in next(iter(ops.values())))
        header += f" {'ops ' + depths:>16} {'/block':>6}"
        lines.append(
            f"ops: operations the sharded guard adds per step on a GPU's torch path "
            f"(benchmarks/ops_per_step.py, world size 2) at {depths} blocks; and per block"
        )
    lines += ["", header]
    for label, variant, plain in ROWS:
        low, high = _interval(cpu, variant, plain)
        row = (
            f"{label:32} {_ratio(wall, variant, plain):7.3f} {_ratio(cpu, variant, plain):7.3f} "
            f"{low:6.3f}-{high:6.3f}"
        )
        if ops and variant in ops:
            import ops_per_step  # benchmarks/ is on sys.path when run as a script

            rows = ops[variant]
            added = "/".join(f"{r['added']:.0f}" for r in rows)
            per = f"{ops_per_step.per_block(rows):6.1f}" if len(rows) > 1 else ""
            row += f" {added:>16} {per:>6}"
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ops-depths", type=int, nargs="+", default=[2, 8])
    args = parser.parse_args(argv)
    bench = ShardedBench(args.world_size, args.threads, args.rounds, args.warmup)
    started = time.monotonic()
    ops = None
    depths = [d for d in args.ops_depths if d > 0]
    if depths:
        import ops_per_step

        ops = ops_per_step.table(depths, ["fsdp", "hsdp"])
    print(table(bench, run(bench), ops))
    print(f"(took {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
