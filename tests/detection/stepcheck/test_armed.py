"""The per-step layer armed from the first step: flips at unaudited steps from step 1 on caught on
their own step with the right rank (bits 27-30, gradient and activation flips, several ranks,
the built-in model and a model of plain ``torch.nn`` parts), the same jobs without a fault
silent; and a flip in the first steps blinds no later check (a flip at step 3, another on the
same layer near step 40: both caught, with the checksums and with the statistics alone).

Full coverage: every checksum on every step (:func:`_full_coverage`; the default rotates the
checksums over the layers, ``GuardConfig.abft_every``).

The full matrix (bits 23-30, more flips) is ``benchmarks/detection_rate.py --from-step 1``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from detection.guard.state import read_state
from detection.harness import TrainConfig, run
from detection.simulation.workloads import Workload, run_many
from detection.stepcheck.gradstats import StatsConfig
from tests.detection.conftest import run_ranks

WORLD = 4
HIGH = (27, 28, 29, 30)


def _full_coverage() -> dict[str, Any]:
    """Every checksum on every step (``abft_every=1``, not the default's rotation): the
    coverage these tests claim their rates under."""
    return {"stats": StatsConfig(), "abft_every": 1}


def _caught(results: list[list[dict[str, Any]]], index: int) -> tuple[int, int]:
    """(flips caught on their step naming exactly their rank, flips) of job ``index``."""
    alarms = {a["step"]: a["suspect_ranks"] for a in results[0][index]["alarms"]}
    flips = [(rank, step) for rank, per in enumerate(results) for step, _, _ in per[index]["flips"]]
    return sum(alarms.get(step) == [rank] for rank, step in flips), len(flips)


def _from_step_one(kind: str) -> tuple[str, ...]:
    """Eight flips at steps 1, 3, ..., 15 — inside what used to be the warm-up — rotating over
    the ranks and over bits 27-30."""
    return tuple(f"{kind}@{i % WORLD}:{1 + 2 * i}:{HIGH[i % len(HIGH)]}" for i in range(8))


def test_flips_from_step_one_are_caught_on_their_step_and_clean_runs_stay_silent() -> None:
    coverage = _full_coverage()
    faulty = [
        Workload(
            model, seed=21, steps=17, inject=_from_step_one(kind), skip_update=True, **coverage
        )
        for model in ("tiny", "mlp")
        for kind in ("grad-flip", "act-flip")
    ]
    clean = [  # the same jobs without a fault, and the loop features the soak covers
        Workload("tiny", seed=21, steps=17, skip_update=True, **coverage),
        Workload("mlp", seed=21, steps=17, skip_update=True, **coverage),
        Workload("mlp", seed=22, steps=30, autocast=True, accumulate=2, **coverage),
        Workload("tiny", seed=23, steps=30, autocast=True, **coverage),
    ]
    # the checks that need no history, at steps 0 and 1: a flip in rank 2's reduced bucket (the
    # all-reduce algebra), a NaN in rank 1's local gradient (the non-finite check)
    first_steps = Workload(
        "mlp", seed=24, steps=3, inject=("reduced-flip@2:0:23", "grad-nan@1:1"), skip_update=True
    )
    results = run_ranks(run_many, WORLD, [*faulty, *clean, first_steps], timeout_s=600)
    caught = [_caught(results, i) for i in range(len(faulty))]
    hits, flips = sum(c for c, _ in caught), sum(n for _, n in caught)
    assert flips == 32
    assert hits >= 0.9 * flips, caught
    for i in range(len(faulty), len(faulty) + len(clean)):
        assert results[0][i]["alarms"] == [], (i, results[0][i]["alarms"])
        assert len({per[i]["fingerprint"] for per in results}) == 1
    alarms = [(a["step"], a["layer"], a["suspect_ranks"]) for a in results[0][-1]["alarms"]]
    assert alarms == [(0, "allreduce", [2]), (1, "nonfinite", [1])]


# (step 3, a later step whose grad-flip hits the same parameter: element (step * 7919) mod n)
_SAME_LAYER = {"tiny": 47, "mlp": 44}  # blocks.0.attn.proj.weight; the MLP's 4.weight


def _early_and_late(model: str, kind: str) -> tuple[str, ...]:
    late = _SAME_LAYER[model] if kind == "grad-flip" else 40  # act-flip: always the last Linear
    return (f"{kind}@1:3:30", f"{kind}@1:{late}:30")


def test_a_flip_in_the_first_steps_blinds_no_later_check_on_the_same_layer() -> None:
    coverage = _full_coverage()
    jobs = [
        # the default (checksums and statistics): both kinds, both models
        *(
            Workload(
                model,
                seed=31,
                steps=50,
                inject=_early_and_late(model, kind),
                skip_update=True,
                **coverage,
            )
            for model in ("tiny", "mlp")
            for kind in ("grad-flip", "act-flip")
        ),
        # the statistics alone (what a compiled model runs): a bit-30 gradient flip (x2^128)
        *(
            Workload(
                model,
                seed=31,
                steps=50,
                inject=_early_and_late(model, "grad-flip"),
                skip_update=True,
                abft=False,
                **coverage,
            )
            for model in ("tiny", "mlp")
        ),
        Workload("tiny", seed=31, steps=50, **coverage),  # clean
        Workload("mlp", seed=31, steps=50, abft=False, **coverage),  # clean
    ]
    results = run_ranks(run_many, WORLD, jobs, timeout_s=600)
    for i, work in enumerate(jobs[:6]):
        steps = sorted(step for step, _, _ in results[1][i]["flips"])
        alarms = [(a["step"], a["suspect_ranks"]) for a in results[0][i]["alarms"]]
        assert alarms == [(steps[0], [1]), (steps[1], [1])], (work.label(), work.inject, alarms)
    for i in (4, 5):  # the statistics: early floor at step 3, a learnt (tighter) one later
        first, second = (a["detail"] for a in results[0][i]["alarms"])
        assert first["threshold"] >= round(math.log(64.0), 6)
        assert second["threshold"] < first["threshold"]
    for i in (6, 7):
        assert results[0][i]["alarms"] == []


def test_sdcguard_train_resumes_armed_and_catches_a_flip_at_its_first_step(
    tmp_path: Path,
) -> None:
    """``sdcguard train`` writes the guard's state beside each checkpoint and ``--resume-from``
    loads it: the resumed job (a replaced node resumes from the job's checkpoint like every
    other rank) catches a flip at its first step naming its rank, and without a fault it
    raises nothing."""
    common = {"world_size": 3, "audit_every": 0, "seed": 5, "skip_update_on_alarm": True}
    first = run(
        TrainConfig(**common, steps=31, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=30)
    )
    assert first["alarms"] == []
    checkpoint = tmp_path / "ckpt" / "ckpt-000030.pt"
    state = read_state(checkpoint)
    assert state is not None
    assert state["step"] == 30
    assert state["fingerprint"] == first["checkpoints"][-1]["fingerprint"]
    clean = run(TrainConfig(**common, steps=36, resume_from=checkpoint))
    assert clean["alarms"] == []
    # a node's persistent fault from step 31 on: one that follows a resume (a transient one,
    # KIND@RANK:STEP, is not repeated by a run that recomputes steps)
    faulty = run(
        TrainConfig(
            **common, steps=32, resume_from=checkpoint, inject=["grad-flip@node=node-1:from=31"]
        )
    )
    assert [(a["step"], a["suspect_ranks"]) for a in faulty["alarms"]] == [(31, [1])]
