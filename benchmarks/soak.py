"""Clean soak of the per-step layer: many guarded steps with no fault, and the alarms they raised.

The statistical tests are only useful if they stay silent on clean training. This runs guarded
jobs of several seeds and models (the built-in transformer with dropout and BatchNorm, a plain
``torch.nn`` MLP with BatchNorm1d and dropout), with bf16 autocast and gradient accumulation,
at world sizes 4 and 2 (where only the temporal test can name a rank), and prints every job's
step and alarm count and the total. ``--scale`` multiplies every job's steps (1.0: 21,500
guarded steps in all).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

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
                }
            )
            print(
                f"world {world}  {work.label():40} {result['steps']:6d} steps  "
                f"{len(result['alarms'])} alarm(s)",
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
    if args.out is not None:
        args.out.write_text(json.dumps({"jobs": rows, "steps": steps, "alarms": alarms}, indent=1))
    return 0 if alarms == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
