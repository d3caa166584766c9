"""Two optimizers (the guarded one stepped second), param groups, and ``static_graph=True``.

The replay runs right after the step's last backward — before any optimizer has touched a
weight — so the order in which the loop steps its optimizers does not matter.
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


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.body = nn.Sequential(nn.Linear(12, 32), nn.SiLU(), nn.Linear(32, 32), nn.SiLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


def _train(rank: int, mode: str, steps: int, inject: tuple[str, ...] = ()) -> dict[str, Any]:
    net = _Net()
    model = DistributedDataParallel(net, static_graph=True)
    body = torch.optim.SGD(
        [
            {"params": net.body[0].parameters(), "lr": 0.05},
            {"params": net.body[2].parameters(), "lr": 0.01, "weight_decay": 1e-4},
        ],
        momentum=0.9,
    )
    head = torch.optim.AdamW(net.head.parameters(), lr=1e-3)
    guard = SDCGuard(  # only the head's optimizer is handed over; the body's steps first
        model,
        head,
        microbatch=features,
        loss_fn=_loss,
        identity=NodeIdentity(rank),
        config=GuardConfig(
            audit_every=1, audit_mode=mode, seed=SEED, inject=inject, halt_on_alarm=False
        ),
    )
    for step in range(steps):
        with guard.step(step):
            body.zero_grad(set_to_none=True)
            head.zero_grad(set_to_none=True)
            guard.backward(_loss(model, features(step, rank)))
            body.step()
            head.step()
    guard.close()
    return summary(guard)


def _ranks(rank: int, world: int) -> dict[str, Any]:
    return {
        "loss": _train(rank, "loss", CLEAN_STEPS),
        "gradient": _train(rank, "gradient", CLEAN_STEPS),
        "fault": _train(rank, "loss", FAULT_STEPS, node_fault("act-flip")),
    }


def test_two_optimizers_the_guarded_one_stepped_second() -> None:
    results = run_ranks(_ranks, 3, timeout_s=240)
    assert_clean(results, "loss")
    assert_clean(results, "gradient")
    assert_caught(results, "fault", "audit", "loss")
