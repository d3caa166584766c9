"""A ``DataLoader`` with a ``DistributedSampler`` — no pure ``microbatch(step, rank)`` at all.

The loop hands each batch over with ``guard.backward(loss, batch=batch)``; on audited steps
every rank ships its batch to its auditor (one all-gather of layouts, then point-to-point
sends), which replays it. The loader, the sampler and the epochs are the tutorial's, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from detection.guard import GuardConfig, SDCGuard
from tests.detection.conftest import run_ranks
from tests.detection.loops._common import (
    CLEAN_STEPS,
    FAULT_STEPS,
    SEED,
    NodeIdentity,
    assert_caught,
    assert_clean,
    node_fault,
    summary,
)


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(SEED)
    inputs = torch.randn(480, 12, generator=g)
    return TensorDataset(inputs, (inputs[:, :4].sum(1) > 0).long() + 2 * (inputs[:, 4] > 0).long())


def _net() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


def _train(
    rank: int, world: int, mode: str, steps: int, inject: tuple[str, ...] = ()
) -> dict[str, Any]:
    dataset = _dataset()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(dataset, batch_size=10, sampler=sampler)
    model = DistributedDataParallel(_net())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = SDCGuard(
        model,
        optimizer,
        loss_fn=_loss,
        identity=NodeIdentity(rank),
        config=GuardConfig(
            audit_every=1, audit_mode=mode, seed=SEED, inject=inject, halt_on_alarm=False
        ),
    )
    step = 0
    epoch = 0
    while step < steps:
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            if step == steps:
                break
            with guard.step(step):
                optimizer.zero_grad(set_to_none=True)
                loss = _loss(model, (inputs, labels))
                guard.backward(loss, batch=(inputs, labels))
                optimizer.step()
            step += 1
        epoch += 1
    guard.close()
    return summary(guard)


def _ranks(rank: int, world: int) -> dict[str, Any]:
    return {
        "loss": _train(rank, world, "loss", CLEAN_STEPS),
        "gradient": _train(rank, world, "gradient", CLEAN_STEPS),
        "fault": _train(rank, world, "loss", FAULT_STEPS, node_fault("act-flip")),
    }


def test_dataloader_with_distributed_sampler_ships_the_batch_to_its_auditor() -> None:
    results = run_ranks(_ranks, 3, timeout_s=240)
    assert_clean(results, "loss")
    assert_clean(results, "gradient")
    for r in results:  # one batch a step went to the auditor
        assert r["loss"]["counters"]["batches_shipped"] == CLEAN_STEPS
    assert_caught(results, "fault", "audit", "loss")
