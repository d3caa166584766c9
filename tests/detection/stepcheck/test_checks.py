"""The per-step layer in real gloo ranks: flips at unaudited steps caught on their own step with
the right rank, on the built-in model and on a model of plain ``torch.nn`` parts; a corrupted
reduction caught before ``optimizer.step`` and the update skipped on every rank; and clean runs
(dropout, BatchNorm, bf16 autocast, gradient accumulation) that raise nothing.

The full matrix (every bit 23-30, more faults) is ``benchmarks/detection_rate.py``; the long
clean soak is ``benchmarks/soak.py``. Faults strike from step 30, after the statistics' warm-up
(25 clean steps), one every 3 steps, rotating over the ranks.
"""

from __future__ import annotations

from typing import Any

from detection.simulation.workloads import Workload, run_many
from tests.detection.conftest import run_ranks


def _caught(results: list[list[dict[str, Any]]], index: int) -> tuple[int, int]:
    """(flips caught on their step naming exactly their rank, flips) of job ``index``."""
    alarms = {a["step"]: a["suspect_ranks"] for a in results[0][index]["alarms"]}
    flips = [(rank, step) for rank, per in enumerate(results) for step, _, _ in per[index]["flips"]]
    return sum(alarms.get(step) == [rank] for rank, step in flips), len(flips)


def _specs(kind: str, world: int, bits: list[int], count: int) -> tuple[str, ...]:
    return tuple(f"{kind}@{i % world}:{30 + 3 * i}:{bits[i % len(bits)]}" for i in range(count))


def test_four_ranks_catch_high_bit_flips_on_their_step_and_clean_runs_stay_silent() -> None:
    high = [27, 28, 29, 30]
    jobs = [
        # the matrix in small: bits 27-30 with the checksums on every layer at every step
        # (abft_every=1: full coverage, what they can see), both models, both kinds. The
        # default budget checks a layer on one step in abft_every, so there a one-off flip
        # meets its checksum with that probability (test_harness_flags: on the layer's turn)
        *(
            Workload(
                model,
                seed=1,
                steps=54,
                inject=_specs(kind, 4, high, 8),
                skip_update=True,
                abft_every=1,
            )
            for model in ("tiny", "mlp")
            for kind in ("grad-flip", "act-flip")
        ),
        # the statistics alone: every bit-30 gradient flip, both models
        *(
            Workload(
                model,
                seed=2,
                steps=42,
                inject=_specs("grad-flip", 4, [30], 4),
                skip_update=True,
                abft=False,
            )
            for model in ("tiny", "mlp")
        ),
        # clean: BatchNorm, dropout, bf16 autocast, accumulation, the default ABFT
        Workload("mlp", seed=3, steps=60, autocast=True, accumulate=2),
        Workload("tiny", seed=4, steps=60, accumulate=2),
    ]
    results = run_ranks(run_many, 4, jobs, timeout_s=600)
    caught = [_caught(results, i) for i in range(4)]
    hits, flips = sum(c for c, _ in caught), sum(n for _, n in caught)
    assert flips == 32
    assert hits >= 0.9 * flips, caught
    for i in (4, 5):
        assert _caught(results, i) == (4, 4)
        assert results[0][i]["skipped"] == [30, 33, 36, 39]
    for i in (6, 7):
        assert results[0][i]["alarms"] == []
        assert len({per[i]["fingerprint"] for per in results}) == 1


def test_two_ranks_the_temporal_test_names_the_rank() -> None:
    jobs = [
        Workload(  # the statistics alone (ABFT would lead these alarms)
            "tiny",
            seed=5,
            steps=40,
            inject=("grad-flip@1:30:30", "grad-flip@0:36:30"),
            abft=False,
        ),
        Workload("mlp", seed=6, steps=60, accumulate=3, autocast=True),
    ]
    results = run_ranks(run_many, 2, jobs, timeout_s=600)
    flagged = [
        (a["step"], a["layer"], a["suspect_ranks"], a["detail"]["test"])
        for a in results[0][0]["alarms"]
        if a["layer"] == "gradstats"
    ]
    assert flagged == [(30, "gradstats", [1], "temporal"), (36, "gradstats", [0], "temporal")]
    assert results[0][1]["alarms"] == []


def test_a_corrupted_reduction_is_caught_before_the_update_and_the_step_skipped() -> None:
    """A low mantissa-side flip (bit 23: one element x2 or /2) in rank 2's reduced bucket: the
    replicas' reduced sums differ, so the check names rank 2 before ``optimizer.step``; with
    ``skip_update_on_alarm`` no rank applies the step, and the replicas stay equal (the vote,
    after the step, has nothing to see)."""
    jobs = [
        Workload("tiny", seed=7, steps=34, inject=("reduced-flip@2:31:23",), skip_update=True),
        Workload("mlp", seed=8, steps=34, inject=("reduced-flip@1:5:23",), skip_update=True),
    ]
    results = run_ranks(run_many, 4, jobs, timeout_s=600)
    for i, (step, rank) in enumerate([(31, 2), (5, 1)]):
        alarms = results[0][i]["alarms"]
        assert [(a["step"], a["layer"], a["phase"], a["suspect_ranks"]) for a in alarms] == [
            (step, "allreduce", "post-allreduce", [rank])
        ]
        assert "also" not in alarms[0]["detail"]  # no divergence: nobody updated
        assert all(per[i]["skipped"] == [step] for per in results)
        assert len({per[i]["fingerprint"] for per in results}) == 1
