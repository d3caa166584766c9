"""Parameters DDP was told to ignore, next to a frozen one.

DDP never synchronises an ignored parameter: here an ``offset`` whose gradient the loop
averages itself, outside DDP. The vote leaves ignored parameters out (DDP does not keep them
equal, so they prove nothing about DDP's replicas), and the gradient audit compares what DDP's
buckets hold. A frozen (``requires_grad=False``) layer is in no bucket and is never
differentiated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
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
        self.frozen = nn.Linear(12, 12)
        self.frozen.requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4))
        self.offset = nn.Parameter(torch.zeros(4))  # ignored by DDP; synchronised by the loop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.frozen(x)) + self.offset


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


def _train(rank: int, mode: str, steps: int, inject: tuple[str, ...] = ()) -> dict[str, Any]:
    net = _Net()
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, ["offset"])
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.05)
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
            guard.backward(_loss(model, features(step, rank)))
            assert net.offset.grad is not None
            dist.all_reduce(net.offset.grad)  # the loop's own synchronisation of "offset"
            net.offset.grad /= dist.get_world_size()
            optimizer.step()
    guard.close()
    return summary(guard)


def _ranks(rank: int, world: int) -> dict[str, Any]:
    return {
        "loss": _train(rank, "loss", CLEAN_STEPS),
        "gradient": _train(rank, "gradient", CLEAN_STEPS),
        "fault": _train(rank, "gradient", FAULT_STEPS, node_fault("grad-flip")),
    }


def test_ignored_and_frozen_parameters() -> None:
    results = run_ranks(_ranks, 3, timeout_s=240)
    assert_clean(results, "loss")
    assert_clean(results, "gradient")
    assert_caught(results, "fault", "audit", "gradient")
