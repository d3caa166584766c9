"""Guarded training loops the benchmarks and tests share: the built-in model or a model of plain
``torch.nn`` parts, optionally under bf16 autocast and with gradient accumulation.

The per-step layer must stay silent on the loops people write (dropout, BatchNorm, mixed
precision, several micro-batches per update) and catch a flip on the step it happens, on more
than one architecture. :func:`run_guarded` runs one :class:`Workload` in the calling rank of an
initialised process group and returns what the guard saw; :func:`launch` starts the ranks.

Data are seeded per (seed, step, rank, micro-batch) through private generators, so every run of
a workload is the same run.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detection.guard import GuardConfig, SDCGuard
from detection.simulation.forkserver import PRELOAD
from detection.simulation.model import ModelConfig, TinyTransformer, batch_seed, make_batch
from detection.simulation.model import loss_fn as tiny_loss
from detection.stepcheck.gradstats import StatsConfig
from detection.weights.fingerprint import weight_fingerprint

__all__ = ["PlainMLP", "Workload", "launch", "run_guarded"]

Batch = tuple[torch.Tensor, torch.Tensor]


class PlainMLP(nn.Sequential):
    """A classifier of plain ``torch.nn`` parts: Linear, BatchNorm1d, ReLU, Dropout, GELU."""

    def __init__(self, features: int = 32, hidden: int = 64, classes: int = 10) -> None:
        super().__init__(
            nn.Linear(features, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, classes),
        )


def _mlp_batch(seed: int, step: int, rank: int, micro: int) -> Batch:
    generator = torch.Generator().manual_seed(batch_seed(seed, step * 64 + micro, rank))
    x = torch.randn(32, 32, generator=generator)
    teacher = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 10, generator=teacher)
    return x, (x @ w).argmax(-1)


def _mlp_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


@dataclass(frozen=True)
class Workload:
    """One guarded job: model, seed, steps, loop features, faults and layer settings."""

    model: Literal["tiny", "mlp"] = "tiny"
    seed: int = 0
    steps: int = 60
    accumulate: int = 1
    autocast: bool = False
    inject: tuple[str, ...] = ()
    skip_update: bool = False
    abft: bool | None = None  # None: GuardConfig's default (on)
    abft_every: int | None = None  # None: GuardConfig's checksum budget; 1: full coverage
    stats: StatsConfig = field(default_factory=StatsConfig)

    def label(self) -> str:
        parts = [self.model, f"seed {self.seed}"]
        if self.accumulate > 1:
            parts.append(f"accumulate {self.accumulate}")
        if self.autocast:
            parts.append("bf16 autocast")
        if self.abft is False:
            parts.append("no abft")
        elif self.abft_every is not None:
            parts.append(f"abft every {self.abft_every}")
        return ", ".join(parts)


def _build(work: Workload) -> tuple[nn.Module, Callable[[int, int, int], Batch], Any]:
    torch.manual_seed(work.seed)
    if work.model == "tiny":
        cfg = ModelConfig()

        def tiny_batch(step: int, rank: int, micro: int) -> Batch:
            return make_batch(cfg, work.seed, step * 64 + micro, rank)

        return TinyTransformer(cfg), tiny_batch, tiny_loss

    def mlp_batch(step: int, rank: int, micro: int) -> Batch:
        return _mlp_batch(work.seed, step, rank, micro)

    return PlainMLP(), mlp_batch, _mlp_loss


def run_guarded(rank: int, world_size: int, work: Workload) -> dict[str, Any]:
    """Run ``work`` in this rank; return alarms, skipped steps, the faults that struck and the
    statistics' headroom (how close clean steps came to the floor: the same on every rank)."""
    module, batch, loss_fn = _build(work)
    ddp = DistributedDataParallel(module)
    ddp.reducer._push_all_rebuilt_params()  # one bucket layout from the first step on
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=2e-3)
    guard = SDCGuard(
        ddp,
        optimizer,
        microbatch=batch,  # batch(step, rank, micro)
        loss_fn=loss_fn,
        config=GuardConfig(
            seed=work.seed,
            inject=work.inject,
            micro_batches=work.accumulate,
            halt_on_alarm=False,  # a fault matrix counts every flip of one run
            skip_update_on_alarm=work.skip_update,
            abft=work.abft,
            stats=work.stats,
            abft_every=GuardConfig.abft_every if work.abft_every is None else work.abft_every,
        ),
    )

    def forward(micro: int, step: int) -> torch.Tensor:
        amp = (
            torch.autocast("cpu", dtype=torch.bfloat16)
            if work.autocast
            else contextlib.nullcontext()
        )
        with amp:
            loss: torch.Tensor = loss_fn(ddp, batch(step, rank, micro))
        return loss / work.accumulate

    try:
        for step in range(work.steps):
            with guard.step(step):
                optimizer.zero_grad(set_to_none=True)
                with ddp.no_sync():
                    for micro in range(work.accumulate - 1):
                        guard.backward(forward(micro, step))
                guard.backward(forward(work.accumulate - 1, step))
                optimizer.step()
    finally:
        guard.close()
    return {
        "alarms": [a.to_report() for a in guard.alarms],
        "steps": work.steps,
        "skipped": list(guard.checks.skipped_steps),
        "injected": list(guard.injector.injected) if guard.injector is not None else [],
        "flips": list(guard.injector.flips) if guard.injector is not None else [],
        "fingerprint": weight_fingerprint(list(module.parameters())).hex(),
        "headroom": guard.checks.detector.headroom.to_dict(work.stats.floor_factor),
    }


def _rank_main(
    fn: Callable[..., Any], rank: int, world: int, port: int, out: str, args: tuple[Any, ...]
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=120))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    try:
        result: tuple[str, Any] = ("ok", fn(rank, world, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    finally:
        dist.destroy_process_group()
    Path(out).write_bytes(pickle.dumps(result))


def launch(
    fn: Callable[..., Any], world: int, *args: Any, timeout_s: float | None = None
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` (a module-level function) in ``world`` gloo ranks and
    return each rank's result. Ranks still alive after ``timeout_s`` are killed; every rank
    that failed or left no result is named in one ``RuntimeError``."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=120), wait_for_workers=False
    )
    with tempfile.TemporaryDirectory(prefix="sdcguard-work-") as scratch:
        outs = [str(Path(scratch) / f"rank-{r}.pkl") for r in range(world)]
        procs = [
            ctx.Process(target=_rank_main, args=(fn, r, world, store.port, outs[r], args))
            for r in range(world)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout_s)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        results = []
        failures = []
        for rank, out in enumerate(outs):
            if not Path(out).exists():
                failures.append(f"rank {rank}: no result (exit code {procs[rank].exitcode})")
                continue
            status, value = pickle.loads(Path(out).read_bytes())
            if status != "ok":
                failures.append(f"rank {rank} failed:\n{value}")
            results.append(value)
    if failures:
        raise RuntimeError("\n".join(failures))
    return results


def run_many(rank: int, world: int, works: list[Workload]) -> list[dict[str, Any]]:
    """Several workloads one after another in the same process group (one start-up)."""
    return [run_guarded(rank, world, w) for w in works]
