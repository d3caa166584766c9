"""The operations a guarded step launches, counted: what the guard costs on a GPU, on any host.

On a GPU a step of a model that is not huge is the time the host takes to issue its kernels,
at some 5-10 µs each; what the guard adds to a step is then, first, the kernels it adds. This
script counts them deterministically on the CPU, on the torch path a GPU takes
(``SDCGUARD_NATIVE=0``: no C kernels, no host-read row): every aten operation dispatched
while a step runs, on the training thread and on the autograd engine's (DDP's reducer and the
comm hook included), except views and allocations, which launch nothing. Collectives count as
one operation each, and so does a multi-tensor ``torch._foreach_*`` call (one kernel a chunk of
tensors on a GPU). The calls a GPU replays as a CUDA graph (the weight and buffer fingerprint
plans, the optimizer-state flag: :mod:`detection.device_graph`) are counted op by op as they run
here, eagerly: the counts are an upper bound of a GPU's launches there, constant in depth.

The model is a stack of ``blocks`` blocks of plain ``torch.nn`` parts (``Linear`` then
``LayerNorm`` then ``GELU``) and a ``Linear`` head; DDP over gloo at world size 2; the guard in
one of the configurations of :data:`VARIANTS` (``default``: :class:`~detection.GuardConfig` as
it is, audits off). Steps are counted after a few warm-up steps, when the steady state is
reached (DDP's buckets rebuilt, the optimizer state made, every layer checked once). The
checksums' budget
(``GuardConfig.abft_every``) checks each layer once every ``abft_every`` steps, so steps differ
by phase: the counter takes two full periods, checks that the second repeats the first op for
op, and reports the mean per step over a period. It prints, per depth: a plain step's count,
a guarded step's, what the guard adds, and the increment per block between depths::

    python benchmarks/ops_per_step.py                       # default config, 2, 8 and 32 blocks
    python benchmarks/ops_per_step.py --variants default abft-full checks --blocks 2 32
    python benchmarks/ops_per_step.py --by-op --by-source   # what the guard adds, and where

The variants ``fsdp`` and ``hsdp`` count the sharded guard (its defaults) on the same layers,
each block ``fully_shard``-ed, then the root, over a mesh of 2 (FSDP2) or 2x1 (HSDP: two
replicas of one shard), against a plain step of the same layout::

    python benchmarks/ops_per_step.py --variants fsdp hsdp --blocks 2 8 32

``--by-op`` prints the operations the guard adds, by name, at the largest depth (``--by-source``
by the ``detection`` function that issued them, too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import types
from collections import Counter
from datetime import timedelta
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

WORLD = 2
WIDTH = 32
BATCH = 8
# steps before counting, and then a whole period more: DDP rebuilds its buckets after the first
# step, Adam makes its state at it, and a layer's first check makes its constant operands
WARM = 4
# Operations that launch no kernel: allocations (a caching allocator's bookkeeping) and
# metadata-only ones. Views are recognised by their schema (``func.is_view``).
_NO_LAUNCH = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "detach",
        "alias",
        "lift_fresh",
        "set_",
        "resize_",
        "_record_function_enter_new",
        "_record_function_exit",
        "record_stream",
        "is_same_size",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
    }
)

#: The guard's configurations, as ``GuardConfig`` keyword arguments. ``default`` is the
#: configuration a user gets; the audit variants audit every step (an audited job's mean is
#: ``((K - 1)·checks + audit) / K``, as ``benchmarks/overhead.py`` computes its rows).
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "abft-full": {"abft_every": 1},
    "checks": {"abft": False},
    "bare": {"abft": False, "step_checks": False},
    "defer": {"abft": False, "defer_decision": True},
    "state": {"abft": False, "vote_optimizer_state": True},
    "loss-audit": {"abft": False, "audit_every": 1, "audit_mode": "loss"},
    "gradient-audit": {"abft": False, "audit_every": 1, "audit_mode": "gradient"},
    # the sharded guard (FSDP2 on a 1-D mesh, HSDP on a 2x1 one): what it runs, as it is
    "fsdp": {},
    "hsdp": {},
}

#: The sharded variants' meshes (world size 2: HSDP has two replicas of one shard), and the
#: plain FSDP2 / HSDP job each is counted against (``None`` there: no guard, that layout).
MESHES: dict[str, tuple[int, ...]] = {"fsdp": (WORLD,), "hsdp": (WORLD, 1)}
PLAIN_OF: dict[str, str] = {"fsdp": "plain-fsdp", "hsdp": "plain-hsdp"}
_SHARDED_PLAIN = {plain: variant for variant, plain in PLAIN_OF.items()}


class KernelOps(TorchDispatchMode):
    """Counts, by operator name, the operations dispatched under it that launch work; with
    ``by_source``, by the ``detection`` function that issued each, too (``file:function`` of
    the innermost frame in ``detection/``; ``-`` for the model's, DDP's and the optimizer's)."""

    def __init__(self, by_source: bool = False) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.by_source = by_source

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _NO_LAUNCH:
            key = f"{func.namespace}.{name}"
            self.counts[f"{_source()} {key}" if self.by_source else key] += 1
        return func(*args, **(kwargs or {}))


def _source() -> str:
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if f"{os.sep}detection{os.sep}" in path:
            return f"{Path(path).name}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "-"


def build_model(blocks: int, width: int = WIDTH) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def build_sharded(blocks: int, mesh_shape: tuple[int, ...], width: int = WIDTH) -> nn.Module:
    """The same layers, each block (Linear, LayerNorm, GELU) ``fully_shard``-ed, then the
    root, as FSDP2's tutorial shards a model: one reduce-scatter and all-gather per block."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    parts = [
        nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
        for _ in range(blocks)
    ]
    model = nn.Sequential(*parts, nn.Linear(width, 1))
    for part in parts:
        fully_shard(part, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _layout(variant: str | None) -> tuple[int, ...] | None:
    """The mesh of a variant's job, ``None`` for DDP."""
    if variant is None:
        return None
    return MESHES.get(variant) or MESHES.get(_SHARDED_PLAIN.get(variant, ""))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def make_batch(step: int, rank: int, width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1009 + rank)
    return torch.randn(BATCH, width, generator=g), torch.randn(BATCH, 1, generator=g)


def period(variant: str | None) -> int:
    """Steps after which a variant's steps repeat: the checksums' rotation, when it checks."""
    if variant is None or variant in _SHARDED_PLAIN or variant in MESHES:
        return 1  # plain, or the sharded guard: no checksums, every step alike
    from detection import GuardConfig

    config = GuardConfig(**VARIANTS[variant])
    return config.abft_every if config.abft is not False and config.step_checks else 1


def _rank(
    rank: int, jobs: list[tuple[int, str | None]], warm: int, by_source: bool, out: str
) -> None:
    os.environ["SDCGUARD_NATIVE"] = "0"  # the torch path a GPU takes
    torch.set_num_threads(1)
    store = dist.FileStore(out + ".store", WORLD)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=120)
    )
    from detection import GuardConfig, SDCGuard, native

    # also when an importing parent (overhead.py) loaded detection before the variable was set:
    # the spawned rank re-imports that parent's modules first
    native.set_enabled(False)

    results = []
    for blocks, variant in jobs:
        torch.manual_seed(0)
        mesh = _layout(variant)
        ddp = (
            DistributedDataParallel(build_model(blocks))
            if mesh is None
            else build_sharded(blocks, mesh)
        )
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        guard = (
            SDCGuard(
                ddp,
                optimizer,
                loss_fn=loss_fn,
                microbatch=make_batch,
                config=GuardConfig(**VARIANTS[variant]),
            )
            if variant is not None and variant in VARIANTS
            else None
        )
        per_step: list[dict[str, int]] = []
        span = period(variant)
        first = warm + span  # a whole period first: each layer's first check makes constants
        for step in range(first + 2 * span):
            mode = KernelOps(by_source)
            with mode if step >= first else _Nothing():
                _step(ddp, optimizer, guard, step, rank)
            if step >= first:
                per_step.append(dict(mode.counts))
        if guard is not None:
            guard.close()
            assert not guard.alarms, guard.alarms
        results.append(per_step)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _step(
    ddp: nn.Module, optimizer: torch.optim.Optimizer, guard: Any, step: int, rank: int
) -> None:
    batch = make_batch(step, rank)
    if guard is None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(ddp, batch).backward()
        optimizer.step()
        return
    with guard.step(step):
        optimizer.zero_grad(set_to_none=True)
        guard.backward(loss_fn(ddp, batch))
        optimizer.step()


class Counted:
    """One configuration's count at one depth: the operations of each step of one period
    (rank 0), and their mean per step."""

    def __init__(self, steps: list[Counter[str]]) -> None:
        self.steps = steps

    @property
    def mean(self) -> Fraction:
        return Fraction(sum(sum(c.values()) for c in self.steps), len(self.steps))

    def by_op(self) -> dict[str, Fraction]:
        total: Counter[str] = Counter()
        for c in self.steps:
            total.update(c)
        return {k: Fraction(v, len(self.steps)) for k, v in total.items()}


def count_all(
    jobs: list[tuple[int, str | None]], *, warm: int = WARM, by_source: bool = False
) -> list[Counted]:
    """Each job's count, ``(blocks, variant)`` (``None``: plain DDP), all in one pair of
    ranks. A job's steps must repeat with its period, op for op, or ValueError (the count is
    meant to be deterministic)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "counts.json")
        mp.start_processes(
            _rank, args=(jobs, warm, by_source, out), nprocs=WORLD, start_method="spawn"
        )
        raw = json.loads(Path(out).read_text())
    counted = []
    for (blocks, variant), steps in zip(jobs, raw, strict=True):
        span = len(steps) // 2
        first, second = steps[:span], steps[span:]
        if first != second:
            totals = [sum(c.values()) for c in steps]
            raise ValueError(f"{blocks} blocks, {variant}: steps do not repeat: {totals}")
        counted.append(Counted([Counter(c) for c in first]))
    return counted


def count(blocks: int, variant: str | None = "default", *, warm: int = WARM) -> Counted:
    """One configuration's count at one depth (see :func:`count_all`)."""
    return count_all([(blocks, variant)], warm=warm)[0]


def table(
    depths: list[int], variants: list[str], *, warm: int = WARM, by_source: bool = False
) -> dict[str, list[dict[str, Any]]]:
    """Per variant, per depth: plain, guarded and added operations per step (means over a
    period), and the added ones by operation."""
    depths = sorted(depths)
    plains = sorted({PLAIN_OF.get(v) for v in variants}, key=str)
    jobs: list[tuple[int, str | None]] = [(b, p) for p in plains for b in depths]
    jobs += [(b, v) for v in variants for b in depths]
    counted = dict(zip(jobs, count_all(jobs, warm=warm, by_source=by_source), strict=True))
    out: dict[str, list[dict[str, Any]]] = {}
    for variant in variants:
        rows = []
        for blocks in depths:
            plain = counted[(blocks, PLAIN_OF.get(variant))]
            guarded = counted[(blocks, variant)]
            mine, theirs = guarded.by_op(), plain.by_op()
            added_by_op = {k: mine.get(k, 0) - theirs.get(k, 0) for k in {*mine, *theirs}}
            rows.append(
                {
                    "blocks": blocks,
                    "plain": float(plain.mean),
                    "guarded": float(guarded.mean),
                    "added": float(guarded.mean - plain.mean),
                    "period": len(guarded.steps),
                    "added_by_op": {
                        k: float(v)
                        for k, v in sorted(added_by_op.items(), key=lambda kv: -kv[1])
                        if v
                    },
                }
            )
        out[variant] = rows
    return out


def per_block(rows: list[dict[str, Any]]) -> float:
    """Operations the guard adds per block, from the shallowest depth to the deepest."""
    first, last = rows[0], rows[-1]
    return float((last["added"] - first["added"]) / (last["blocks"] - first["blocks"]))


def format_rows(variant: str, rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        f"{variant} (GuardConfig({_kwargs(variant)}); mean per step over a period of "
        f"{rows[0]['period']} step(s))",
        f"{'blocks':>6} {'plain':>7} {'guarded':>8} {'added':>7} {'added/plain':>12} "
        f"{'per block':>10}",
    ]
    previous: dict[str, Any] | None = None
    for row in rows:
        step = (
            f"{(row['added'] - previous['added']) / (row['blocks'] - previous['blocks']):10.1f}"
            if previous
            else f"{'':>10}"
        )
        lines.append(
            f"{row['blocks']:>6} {row['plain']:>7.1f} {row['guarded']:>8.1f} {row['added']:>7.1f} "
            f"{row['added'] / row['plain']:>11.0%} {step}"
        )
        previous = row
    return lines


def _kwargs(variant: str) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in VARIANTS[variant].items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--variants", nargs="+", default=["default"], choices=list(VARIANTS))
    parser.add_argument("--warm", type=int, default=WARM, help="steps before counting")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    parser.add_argument("--by-op", action="store_true", help="the added operations, by name")
    parser.add_argument(
        "--by-source",
        action="store_true",
        help="with --by-op: by the detection function that issued them",
    )
    args = parser.parse_args(argv)
    tables = table(args.blocks, args.variants, warm=args.warm, by_source=args.by_source)
    print(
        f"operations per step (world {WORLD}: DDP, FSDP2 for fsdp, HSDP 2x1 for hsdp; blocks "
        f"of Linear+LayerNorm+GELU width {WIDTH}, audits off unless named, torch "
        f"{torch.__version__}, the GPU path: SDCGUARD_NATIVE=0)"
    )
    for variant, rows in tables.items():
        print()
        print("\n".join(format_rows(variant, rows)))
        if len(rows) > 1:
            print(
                f"  per block, {rows[0]['blocks']} to {rows[-1]['blocks']} blocks: "
                f"{per_block(rows):.2f}"
            )
        if args.by_op:
            print(f"  added at {rows[-1]['blocks']} blocks, by operation (mean per step):")
            for name, n in rows[-1]["added_by_op"].items():
                print(f"    {n:8.2f}  {name}")
    if args.json:
        args.json.write_text(json.dumps(tables, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
