"""``torch.amp.GradScaler`` with float16 autocast, on CPU (``GradScaler("cpu")``).

The loss recorded is the unscaled one; a gradient replay multiplies by the scale the step's
backward used. Overflows are the scaler's business: a clean run here is made to overflow
often — a high initial scale, a growth probe every 8 steps, and rank 2's inputs ten times
larger than rank 0's, so at some scales only some ranks overflow — and raises no alarm: a
rank that alone went non-finite is recomputed by its auditor at the same scale, overflows
there too, and the step is an overflow. A NaN injected into one rank's local gradient is
finite when recomputed, and is named.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detection.guard import GuardConfig, SDCGuard
from tests.detection.conftest import run_ranks
from tests.detection.loops._common import (
    CLEAN_STEPS,
    FAULTY_RANK,
    SEED,
    NodeIdentity,
    assert_caught,
    assert_clean,
    features,
    summary,
)


def _net() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 4)
    )


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


def _data(step: int, rank: int) -> Any:
    inputs, labels = features(step, rank)
    return inputs * (1.0 + 4.5 * rank), labels


def _train(
    rank: int, mode: str, steps: int, scaler: torch.amp.GradScaler, inject: tuple[str, ...] = ()
) -> dict[str, Any]:
    model = DistributedDataParallel(_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    guard = SDCGuard(
        model,
        optimizer,
        microbatch=_data,
        loss_fn=_loss,
        identity=NodeIdentity(rank),
        config=GuardConfig(
            audit_every=1, audit_mode=mode, seed=SEED, inject=inject, halt_on_alarm=False
        ),
    )
    skipped = 0
    for step in range(steps):
        with guard.step(step):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type="cpu", dtype=torch.float16):
                loss = _loss(model, _data(step, rank))
            guard.backward(loss, scaler=scaler)  # scaler.scale(loss).backward()
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped += int(scaler.get_scale() < scale)
    guard.close()
    return {**summary(guard), "skipped": skipped}


def _ranks(rank: int, world: int) -> dict[str, Any]:
    def overflowing() -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=8)

    calm = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=10_000)
    return {
        "loss": _train(rank, "loss", CLEAN_STEPS, overflowing()),
        "gradient": _train(rank, "gradient", CLEAN_STEPS, overflowing()),
        "fault": _train(rank, "loss", 8, calm, (f"grad-nan@{FAULTY_RANK}:5",)),
    }


def test_grad_scaler_overflows_are_not_alarms_and_a_lone_nan_is_named() -> None:
    results = run_ranks(_ranks, 3, timeout_s=240)
    assert_clean(results, "loss")
    assert_clean(results, "gradient")
    for key in ("loss", "gradient"):
        counters = results[0][key]["counters"]
        # the scaler skipped steps, each accounted for as an overflow — some of them on some
        # ranks only, told apart from SDC by recomputing on the auditor
        assert results[0][key]["skipped"] == counters["overflow_steps"] > 0, counters
        assert counters["overflow_resolutions"] > 0, counters
        # an audit over an overflowed step is inconclusive, never a pass
        assert counters["audits_passed"] + counters["audits_inconclusive"] == CLEAN_STEPS
    assert assert_caught(results, "fault", "nonfinite", "pre-allreduce") == 5
    detail = results[0]["fault"]["details"][0]
    assert "not an overflow" in detail["scaler"]
