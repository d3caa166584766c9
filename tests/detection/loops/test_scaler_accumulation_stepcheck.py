"""The three detection paths together: a GradScaler loop with gradient accumulation, ring audits
on and the per-step layer on.

The per-step layer sees scaled gradients in the comm hook, and only those of the synchronised
backward (the accumulated gradient): divided by the scale, its statistics do not move when the
scaler halves or doubles the scale, and the steps the scaler skips (non-finite) are neither
tested nor learnt from. So a clean run that overflows often — a high initial scale and a
growth probe every 8 steps — raises nothing, audits included. A bit-30 flip of one local
gradient element at an unaudited step is finite, is averaged into every replica and no audit
replays it; the per-step layer names the rank on that step.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detection.guard import GuardConfig, SDCGuard
from tests.detection.conftest import run_ranks
from tests.detection.loops._common import (
    FAULTY_RANK,
    SEED,
    NodeIdentity,
    assert_caught,
    features,
    summary,
)

ACCUM = 2
AUDIT_EVERY = 4
CLEAN = 120
FLIP_STEP = 41  # 41 % AUDIT_EVERY != 0: no audit on that step; after the 25-step warm-up


def _net() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Linear(12, 48), nn.LayerNorm(48), nn.GELU(), nn.Linear(48, 48), nn.Tanh(),
        nn.Linear(48, 4),
    )  # fmt: skip


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels) / ACCUM


def _train(
    rank: int,
    mode: str,
    steps: int,
    scaler: torch.amp.GradScaler,
    inject: tuple[str, ...] = (),
    abft: bool | None = None,
) -> dict[str, Any]:
    model = DistributedDataParallel(_net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = SDCGuard(
        model,
        optimizer,
        microbatch=features,  # features(step, rank, micro)
        loss_fn=_loss,
        identity=NodeIdentity(rank),
        config=GuardConfig(
            audit_every=AUDIT_EVERY,
            audit_mode=mode,
            seed=SEED,
            inject=inject,
            micro_batches=ACCUM,
            step_checks=True,
            abft=abft,
            halt_on_alarm=False,  # the fault run goes on: nothing else may be raised after
        ),
    )
    scales: set[float] = set()
    for step in range(steps):
        with guard.step(step):
            optimizer.zero_grad(set_to_none=True)
            for micro in range(ACCUM):
                sync = micro == ACCUM - 1
                with contextlib.nullcontext() if sync else model.no_sync():
                    with torch.autocast(device_type="cpu", dtype=torch.float16):
                        loss = _loss(model, features(step, rank, micro))
                    guard.backward(loss, scaler=scaler)
            scales.add(scaler.get_scale())
            scaler.step(optimizer)
            scaler.update()
    guard.close()
    flips = list(guard.injector.flips) if guard.injector is not None else []
    return {**summary(guard), "scales": len(scales), "flips": flips}


def _ranks(rank: int, world: int) -> dict[str, Any]:
    def overflowing() -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=8)

    # A small scale keeps the scaled gradients below 2, so bit 30 (the top exponent bit) is
    # clear and the flip multiplies the element by 2**128: finite, and huge.
    calm = torch.amp.GradScaler("cpu", init_scale=2.0**2, growth_interval=10_000)
    return {
        "loss": _train(rank, "loss", CLEAN, overflowing()),
        "gradient": _train(rank, "gradient", CLEAN, overflowing()),
        # statistics alone (ABFT, on by default in the clean runs, would lead the alarm)
        "fault": _train(
            rank, "loss", 48, calm, (f"grad-flip@{FAULTY_RANK}:{FLIP_STEP}:30",), abft=False
        ),
    }


def test_scaler_accumulation_audits_and_the_per_step_layer_together() -> None:
    results = run_ranks(_ranks, 3, timeout_s=600)
    for key in ("loss", "gradient"):
        for r in results:
            run = r[key]
            counters = run["counters"]
            assert run["alarms"] == [], (key, run["alarms"], run["details"])
            assert counters["steps"] == CLEAN, counters
            assert counters["audits"] == CLEAN // AUDIT_EVERY, counters
            # the scaler overflowed and changed its scale several times ...
            assert counters["overflow_steps"] > 0, counters
            assert run["scales"] > 2, run["scales"]
            # ... and the per-step layer tested every step the scaler did not skip
            assert counters["step_checks"] == CLEAN - counters["overflow_steps"], counters
    [(step, _spec, was_set)] = results[FAULTY_RANK]["fault"]["flips"]
    assert (step, was_set) == (FLIP_STEP, False)  # the flip raised the element
    assert assert_caught(results, "fault", "gradstats", "pre-allreduce") == FLIP_STEP
    fault = results[0]["fault"]
    assert fault["counters"]["audits"] == 48 // AUDIT_EVERY
    detail = fault["details"][0]
    assert detail["per_rank"][0]["rank"] == FAULTY_RANK
    assert detail["deviation"] > detail["threshold"]
