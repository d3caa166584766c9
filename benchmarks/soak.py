"""Clean soak of the per-step layer: many guarded steps with no fault, and the alarms they raised.

The statistical tests are only useful if they stay silent on clean training. This runs guarded
jobs of several seeds and models (the built-in transformer with dropout and BatchNorm, a plain
``torch.nn`` MLP with BatchNorm1d and dropout), with bf16 autocast and gradient accumulation,
at world sizes 4 and 2 (where only the temporal test can name a rank), and prints every job's
step and alarm count and the total. ``--scale`` multiplies every job's steps (1.0: 21,500
guarded steps in all). Beside each job's alarms it prints the statistics' headroom
(:mod:`detection.stepcheck.headroom`): the largest excess of a clean step over the cross-rank
median and over a rank's running mean, as a factor, against the floor ``F``; and at the end the
largest of all jobs — what the floor is set from (``docs/detection-design.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from detection.simulation.workloads import Workload, launch, run_many

JOBS: dict[int, list[Workload]] = {
    # The default configuration (ABFT checksums on) unless ``abft=False``: the statistics alone,
    # as a compiled model runs them.
    4: [
        Workload("tiny", seed=0, steps=2000),
        Workload("tiny", seed=1, steps=2000, autocast=True),
        Workload("tiny", seed=2, steps=1500, accumulate=2),
        Workload("mlp", seed=0, steps=2500),
        Workload("mlp", seed=1, steps=2000, autocast=True, accumulate=2),
        Workload("tiny", seed=3, steps=1500, abft=False),
        Workload("mlp", seed=2, steps=1500, autocast=True),
    ],
    2: [
        Workload("tiny", seed=4, steps=2500),
        Workload("mlp", seed=3, steps=2500, accumulate=3),
        Workload("tiny", seed=5, steps=2000, autocast=True, accumulate=2),
        Workload("mlp", seed=4, steps=1500, abft=False),
    ],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every job's steps")
    parser.add_argument("--out", type=Path, default=None, help="write the summary JSON here")
    parser.add_argument("--abft-only", action="store_true", help="only the jobs with ABFT on")
    parser.add_argument("--world-size", type=int, action="append", default=None)
    args = parser.parse_args(argv)
    started = time.monotonic()
    rows = []
    for world, works in JOBS.items():
        if args.world_size and world not in args.world_size:
            continue
        scaled = [
            Workload(**{**w.__dict__, "steps": max(1, int(w.steps * args.scale))})
            for w in works
            if w.abft is not False or not args.abft_only
        ]
        results = launch(run_many, world, scaled)[0]
        for work, result in zip(scaled, results, strict=True):
            rows.append(
                {
                    "world_size": world,
                    "job": work.label(),
                    "steps": result["steps"],
                    "alarms": result["alarms"],
                    "headroom": result["headroom"],
                }
            )
            print(
                f"world {world}  {work.label():40} {result['steps']:6d} steps  "
                f"{len(result['alarms'])} alarm(s)  {_headroom_line(result['headroom'])}",
                flush=True,
            )
            for alarm in result["alarms"]:
                print(f"    {json.dumps(alarm)[:300]}", flush=True)
    steps = sum(r["steps"] for r in rows)
    alarms = sum(len(r["alarms"]) for r in rows)
    print(
        f"clean soak: {steps:,} guarded steps in {len(rows)} jobs, {alarms} alarm(s), "
        f"{time.monotonic() - started:.0f} s"
    )
    peaks = {test: _largest(rows, test) for test in ("cross-rank", "temporal")}
    for test, (factor, job, statistic) in peaks.items():
        if not job:  # world size 2 only: no cross-rank test ran
            print(f"largest clean {test} excess: none measured", flush=True)
            continue
        print(f"largest clean {test} excess: x{factor:.2f} ({statistic}, {job})", flush=True)
    if args.out is not None:
        summary = {"jobs": rows, "steps": steps, "alarms": alarms, "largest": peaks}
        args.out.write_text(json.dumps(summary, indent=1))
    return 0 if alarms == 0 else 1


def _headroom_line(headroom: dict[str, Any]) -> str:
    """The largest clean excess of each test against the floor, and the steps past x4."""
    parts = []
    for test in ("cross-rank", "temporal"):
        peak = headroom[test]
        if peak["max_factor"] is None:
            continue
        parts.append(
            f"{test} max x{peak['max_factor']:.2f} ({peak['statistic']}; "
            f"{peak['steps_reaching']['x4']} step(s) past x4)"
        )
    return f"floor x{headroom['floor_factor']:g}: " + ", ".join(parts)


def _largest(rows: list[dict[str, Any]], test: str) -> tuple[float, str, str]:
    """The largest clean excess factor of ``test`` over every job, its job and statistic."""
    best = (0.0, "", "")
    for row in rows:
        peak = row["headroom"][test]
        if peak["max_factor"] is not None and peak["max_factor"] > best[0]:
            best = (
                peak["max_factor"],
                f"world {row['world_size']}, {row['job']}",
                peak["statistic"],
            )
    return best


if __name__ == "__main__":
    sys.exit(main())
