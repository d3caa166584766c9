"""Detection rate of the per-step layer by bit position: ``grad-flip`` and ``act-flip`` at
unaudited steps, bits 23-30, several ranks and steps, on the built-in model and on a model of
plain ``torch.nn`` parts; with the default configuration (statistics and ABFT checksums) and
with the statistics alone (``abft=False``, what a compiled model gets).

A flip counts as caught when the alarm of *its* step names exactly *its* rank. Each cell is one
guarded job (no audits, ``skip_update_on_alarm`` on, so a caught flip never reaches the weights
and the next fault meets a clean model): a warm-up, then one fault every few steps, rotating over
the ranks. For an exponent bit the direction matters: a bit that was 0 multiplies the value by
2^(2^(bit-23)) (a real corruption), one that was 1 divides it by as much (the element shrinks
towards zero, an error smaller than the element itself, below any threshold and harmless in the
same proportion); the table shows both, and the rate over the raising flips.

``--from-step S`` puts the first flip at step ``S`` (default 30; 1: from the job's first steps,
where the statistics' references are still young and the checksums are armed by their derived
bound). Beside the rate on the flip's own step, ``late`` counts flips whose rank an alarm named
within the next three steps instead (the latency).

Prints the table and writes a PNG plot (``--plot``, default ``detection_rate.png``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from detection.simulation.workloads import Workload, launch, run_many

BITS = tuple(range(23, 31))
KINDS = ("grad-flip", "act-flip")
MODELS = ("tiny", "mlp")


def cell_workloads(
    world: int,
    faults: int,
    abft: bool | None,
    models: tuple[str, ...] = MODELS,
    start: int = 30,
    abft_every: int | None = None,
) -> list[tuple[tuple[str, str, int], Workload]]:
    """One job per (model, kind, bit): ``faults`` flips from step ``start``, every 3 steps."""
    cells = []
    for model in models:
        for kind in KINDS:
            for bit in BITS:
                specs = tuple(f"{kind}@{i % world}:{start + 3 * i}:{bit}" for i in range(faults))
                work = Workload(
                    model,  # type: ignore[arg-type]
                    seed=bit,
                    steps=start + 3 * faults,
                    inject=specs,
                    skip_update=True,
                    abft=abft,
                    abft_every=abft_every,
                )
                cells.append(((model, kind, bit), work))
    return cells


def score(results: list[list[dict[str, Any]]], index: int) -> dict[str, int]:
    """Counts for one job: flips, raising flips, caught, caught among the raising ones."""
    alarms = {a["step"]: a["suspect_ranks"] for a in results[0][index]["alarms"]}
    out = {"flips": 0, "raised": 0, "caught": 0, "caught_raised": 0, "late": 0}
    for rank, per_rank in enumerate(results):
        for step, _spec, was_set in per_rank[index]["flips"]:
            caught = alarms.get(step) == [rank]
            out["flips"] += 1
            out["caught"] += caught
            out["late"] += not caught and any(
                rank in alarms.get(later, ()) for later in range(step + 1, step + 4)
            )
            if not was_set:
                out["raised"] += 1
                out["caught_raised"] += caught
    return out


def run_matrix(
    world: int, faults: int, abft: bool | None, start: int = 30, abft_every: int | None = None
) -> dict[tuple[str, str, int], dict[str, int]]:
    cells = cell_workloads(world, faults, abft, start=start, abft_every=abft_every)
    results = launch(run_many, world, [w for _, w in cells])
    return {key: score(results, i) for i, (key, _) in enumerate(cells)}


def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:5.1f}%" if b else "    - "


def table(matrix: dict[str, dict[tuple[str, str, int], dict[str, int]]]) -> str:
    lines = []
    for mode, cells in matrix.items():
        lines.append(f"\n== {mode} ==")
        lines.append(f"{'model / kind':24}" + "".join(f"  bit {b:2d}        " for b in BITS))
        for model in MODELS:
            for kind in KINDS:
                row = f"{model + ' ' + kind:24}"
                for bit in BITS:
                    c = cells.get((model, kind, bit))
                    if c is None:
                        row += " " * 19
                        continue
                    everything = _pct(c["caught"], c["flips"])
                    row += f"  {everything} r{_pct(c['caught_raised'], c['raised'])}"
                lines.append(row)
        for low, high in ((27, 30), (23, 26)):
            band = [c for (_, _, b), c in cells.items() if low <= b <= high]
            total = sum(c["flips"] for c in band)
            caught = sum(c["caught"] for c in band)
            raised = sum(c["raised"] for c in band)
            caught_raised = sum(c["caught_raised"] for c in band)
            late = sum(c.get("late", 0) for c in band)
            lines.append(
                f"bits {low}-{high}: {caught}/{total} flips caught on their step with their rank "
                f"({_pct(caught, total).strip()}); raising flips {caught_raised}/{raised} "
                f"({_pct(caught_raised, raised).strip()}); {late} more named 1-3 steps late"
            )
        for model in MODELS:
            for kind in KINDS:
                band = [c for (m, k, b), c in cells.items() if (m, k) == (model, kind) and b >= 27]
                if band:
                    got, total = sum(c["caught"] for c in band), sum(c["flips"] for c in band)
                    lines.append(
                        f"  {model} {kind}, bits 27-30: {got}/{total} ({_pct(got, total).strip()})"
                    )
    lines.append("\ncell: all flips caught %, r = caught % among flips that raised the value")
    return "\n".join(lines)


def plot(matrix: dict[str, dict[tuple[str, str, int], dict[str, int]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(matrix)
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.2), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        cells = matrix[mode]
        for model in MODELS:
            for kind in KINDS:
                rows = [cells.get((model, kind, b)) for b in BITS]
                if any(r is None for r in rows):
                    continue
                rate = [100 * r["caught"] / max(r["flips"], 1) for r in rows if r]
                up = [
                    100 * r["caught_raised"] / r["raised"] if r["raised"] else None
                    for r in rows
                    if r
                ]
                (line,) = ax.plot(BITS, rate, marker="o", label=f"{model} {kind}: all flips")
                ax.plot(
                    [b for b, v in zip(BITS, up, strict=True) if v is not None],
                    [v for v in up if v is not None],
                    linestyle="--",
                    marker="^",
                    color=line.get_color(),
                    label=f"{model} {kind}: raising flips",
                )
        ax.axhline(90, color="grey", linewidth=0.8, linestyle=":")
        ax.set_title(mode)
        ax.set_xlabel("flipped bit (float32 numbering)")
        ax.set_ylabel("caught on its step, right rank (%)")
        ax.set_ylim(-3, 103)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, action="append", default=None)
    parser.add_argument("--faults", type=int, default=16, help="flips per (model, kind, bit)")
    parser.add_argument("--plot", type=Path, default=Path("detection_rate.png"))
    parser.add_argument("--out", type=Path, default=None, help="write the counts as JSON")
    parser.add_argument("--no-abft", action="store_true", help="statistics only")
    parser.add_argument("--default-only", action="store_true", help="the default config only")
    parser.add_argument(
        "--from-step", type=int, default=30, help="step of the first flip (1: the first steps)"
    )
    parser.add_argument(
        "--abft-every",
        type=int,
        default=None,
        help="the checksums' budget (default: GuardConfig's rotation, each layer once every 8 "
        "steps, so a one-off flip meets its layer's checksum on 1 step in 8; 1: full coverage)",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    budget = "the default budget" if args.abft_every is None else f"abft_every={args.abft_every}"
    print(f"flips from step {args.from_step}, every 3 steps; checksums: {budget}", flush=True)
    matrix: dict[str, dict[tuple[str, str, int], dict[str, int]]] = defaultdict(dict)
    modes: tuple[bool | None, ...] = (None, False)
    if args.no_abft or args.default_only:
        modes = (False,) if args.no_abft else (None,)
    for world in args.world_size or [4, 2]:
        for abft in modes:
            label = "default (statistics + ABFT)" if abft is None else "statistics only"
            mode = f"world size {world}, {label}"
            matrix[mode] = run_matrix(
                world, args.faults, abft, start=args.from_step, abft_every=args.abft_every
            )
            print(f"{mode}: done after {time.monotonic() - started:.0f} s", flush=True)
    print(table(matrix))
    plot(matrix, args.plot)
    print(f"plot: {args.plot}  ({time.monotonic() - started:.0f} s)")
    if args.out is not None:
        body = {m: {"/".join(map(str, k)): v for k, v in c.items()} for m, c in matrix.items()}
        args.out.write_text(json.dumps(body, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
