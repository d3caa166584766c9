"""``DDP(find_unused_parameters=True)`` with gradient audits, and a user's gradient hook.

A replay through ``loss.backward()`` fires DDP's reducer hooks outside DDP's own backward
(``RuntimeError: Encountered gradient which is undefined, but still allreduced by DDP
reducer``) and the user's post-accumulate-grad hooks a second time. The replay uses
``torch.autograd.grad``: no ``AccumulateGrad`` runs, no hook fires, ``.grad`` is untouched. The
branch this model skips on odd steps leaves parameters unused; DDP's bucket then holds zeros
for them, and so does the replay.
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
        self.trunk = nn.Sequential(nn.Linear(12, 32), nn.ReLU())
        self.detour = nn.Linear(32, 32)  # used on even steps only
        self.never = nn.Linear(32, 32)  # never used
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, detour: bool) -> torch.Tensor:
        h = self.trunk(x)
        if detour:
            h = torch.relu(self.detour(h)) + h
        return self.head(h)


def _data(step: int, rank: int) -> Any:
    inputs, labels = features(step, rank)
    return inputs, labels, step % 2 == 0


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, labels, detour = batch
    return F.cross_entropy(model(inputs, detour), labels)


def _train(rank: int, mode: str, steps: int, inject: tuple[str, ...] = ()) -> dict[str, Any]:
    net = _Net()
    model = DistributedDataParallel(net, find_unused_parameters=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    fired = [0]

    def count(_param: torch.Tensor) -> None:
        fired[0] += 1

    handle = net.head.weight.register_post_accumulate_grad_hook(count)
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
    for step in range(steps):
        with guard.step(step):
            optimizer.zero_grad(set_to_none=True)
            guard.backward(_loss(model, _data(step, rank)))
            optimizer.step()
    guard.close()
    handle.remove()
    return {**summary(guard), "hook_fired": fired[0]}


def _ranks(rank: int, world: int) -> dict[str, Any]:
    return {
        "loss": _train(rank, "loss", CLEAN_STEPS),
        "gradient": _train(rank, "gradient", CLEAN_STEPS),
        "fault": _train(rank, "gradient", FAULT_STEPS, node_fault("grad-flip")),
    }


def test_find_unused_parameters_with_gradient_audits() -> None:
    results = run_ranks(_ranks, 3, timeout_s=240)
    assert_clean(results, "loss")
    assert_clean(results, "gradient")
    for r in results:  # the user's hook fired once per step: never for a replay
        assert r["gradient"]["hook_fired"] == CLEAN_STEPS
    assert_caught(results, "fault", "audit", "gradient")
