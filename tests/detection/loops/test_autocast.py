"""``torch.autocast`` written in the training loop, not inside ``loss_fn`` (bfloat16 on CPU).

The replay runs after the loop has left the autocast block; it must run under the autocast
state the original forward started under, or every audit compares a bfloat16 forward with a
float32 one.
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
    FAULT_STEPS,
    SEED,
    NodeIdentity,
    assert_caught,
    assert_clean,
    features,
    node_fault,
    summary,
)


def _net() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Linear(12, 32), nn.LayerNorm(32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 4)
    )


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


def _train(rank: int, mode: str, steps: int, inject: tuple[str, ...] = ()) -> dict[str, Any]:
    model = DistributedDataParallel(_net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = SDCGuard(
        model,
        optimizer,
        microbatch=features,
        loss_fn=_loss,
        identity=NodeIdentity(rank),
        config=GuardConfig(
            audit_every=1, audit_mode=mode, seed=SEED, inject=inject, halt_on_alarm=False
        ),
    )
    for step in range(steps):
        with guard.step(step):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                loss = _loss(model, features(step, rank))
            guard.backward(loss)
            optimizer.step()
    guard.close()
    return summary(guard)


def _ranks(rank: int, world: int) -> dict[str, Any]:
    return {
        "loss": _train(rank, "loss", CLEAN_STEPS),
        "gradient": _train(rank, "gradient", CLEAN_STEPS),
        "fault": _train(rank, "loss", FAULT_STEPS, node_fault("act-flip")),
    }


def test_autocast_in_the_loop_replays_under_the_same_autocast() -> None:
    results = run_ranks(_ranks, 3, timeout_s=240)
    assert_clean(results, "loss")
    assert_clean(results, "gradient")
    assert_caught(results, "fault", "audit", "loss")
