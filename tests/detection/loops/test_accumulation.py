"""Gradient accumulation: four micro-batches per step, ``ddp.no_sync()`` around all but the last.

A loss audit replays one micro-batch (a different one each audit) with the buffers, seed and
autocast state that micro-batch's forward saw; a gradient audit replays the group and compares
the summed local gradient DDP reduced. A fifth ``guard.backward`` in a step, or a forgotten
``no_sync``, is a ``GuardUsageError`` saying what to change, not a silent mismatch.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detection.guard import GuardConfig, GuardUsageError, SDCGuard
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

ACCUM = 4


def _net() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Linear(12, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Dropout(0.2), nn.Linear(24, 4)
    )


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels) / ACCUM  # the division belongs in loss_fn


def _guard(rank: int, mode: str, inject: tuple[str, ...] = ()) -> tuple[Any, Any, SDCGuard]:
    model = DistributedDataParallel(_net())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = SDCGuard(
        model,
        optimizer,
        microbatch=features,  # features(step, rank, micro)
        loss_fn=_loss,
        identity=NodeIdentity(rank),
        config=GuardConfig(
            audit_every=1,
            audit_mode=mode,
            seed=SEED,
            inject=inject,
            micro_batches=ACCUM,
            halt_on_alarm=False,
        ),
    )
    return model, optimizer, guard


def _train(rank: int, mode: str, steps: int, inject: tuple[str, ...] = ()) -> dict[str, Any]:
    model, optimizer, guard = _guard(rank, mode, inject)
    for step in range(steps):
        with guard.step(step):
            optimizer.zero_grad(set_to_none=True)
            for micro in range(ACCUM):
                sync = micro == ACCUM - 1
                with contextlib.nullcontext() if sync else model.no_sync():
                    loss = _loss(model, features(step, rank, micro))
                    guard.backward(loss)
            optimizer.step()
    guard.close()
    return summary(guard)


def _misuse(rank: int) -> dict[str, str]:
    model, _optimizer, guard = _guard(rank, "loss")
    said: dict[str, str] = {}
    for name, backwards, forget_no_sync in (
        ("fifth_backward", ACCUM + 1, False),
        ("no_sync", 1, True),
    ):
        try:
            with guard.step(0):
                for micro in range(backwards):
                    sync = forget_no_sync or micro >= ACCUM - 1
                    with contextlib.nullcontext() if sync else model.no_sync():
                        guard.backward(_loss(model, features(0, rank, micro)))
        except GuardUsageError as err:
            said[name] = str(err)
    guard.close()
    return said


def _ranks(rank: int, world: int) -> dict[str, Any]:
    return {
        "loss": _train(rank, "loss", CLEAN_STEPS),
        "gradient": _train(rank, "gradient", CLEAN_STEPS),
        "fault": _train(rank, "gradient", FAULT_STEPS, node_fault("act-flip")),
        "misuse": _misuse(rank),
    }


def test_accumulation_with_no_sync_audits_like_with_like() -> None:
    results = run_ranks(_ranks, 3, timeout_s=300)
    assert_clean(results, "loss")
    assert_clean(results, "gradient")
    assert_caught(results, "fault", "audit", "gradient")
    for r in results:
        said = r["misuse"]
        assert "called 5 times" in said["fifth_backward"]
        assert "micro_batches=4" in said["fifth_backward"]
        assert "no_sync" in said["no_sync"]
