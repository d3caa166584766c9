"""Activation checkpointing (``torch.utils.checkpoint``) in a user's model, as LLM loops use it.

The recomputation runs a block's forward again inside the backward. A BatchNorm in such a block
updates its running statistics a second time there — legitimately — and the buffer check took
that for a corruption after the forward on every rank, halting a clean job at its first step.
A gradient audit cannot run through reentrant checkpointing at all; the guard says so.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from detection import native
from detection.audit.calibration import NotReplayableError
from detection.faults.injector import flip_bit_
from detection.guard import GuardConfig, SDCGuard
from tests.detection.conftest import run_ranks

STEPS = 8


class _Block(nn.Module):
    def __init__(self, width: int, norm: str) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(width) if norm == "batch" else nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class _Checkpointed(nn.Module):
    """Two blocks, each recomputed in the backward while training."""

    def __init__(self, norm: str, reentrant: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([_Block(8, norm) for _ in range(2)])
        self.out = nn.Linear(8, 3)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant) if self.training else block(h)
        return self.out(h)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 17 + rank)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _flip_running_mean(model: nn.Module) -> None:
    norm = model.blocks[1].norm  # type: ignore[index]
    assert isinstance(norm, nn.BatchNorm1d)
    assert norm.running_mean is not None
    flip_bit_(norm.running_mean, 3, 30)


def _run(norm: str, rank: int, *, flip_at: int | None = None, **config: Any) -> list[Any]:
    torch.manual_seed(0)
    model = _Checkpointed(norm)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = SDCGuard(ddp, opt, microbatch=_batch, loss_fn=_loss, config=GuardConfig(**config))
    for step in range(STEPS):
        with guard.step(step):
            opt.zero_grad(set_to_none=True)
            guard.backward(_loss(ddp, _batch(step, rank)))
            opt.step()
            if step == flip_at and rank == 1:
                _flip_running_mean(model)  # after the recomputation, in the optimizer's part
        if step % 3 == 2:
            ddp.eval()  # an evaluation pass between steps: no recomputation there
            with torch.no_grad():
                ddp(_batch(step, rank)[0])
            ddp.train()
        if step == 4:  # one block's statistics refreshed on their own, between two steps
            with torch.no_grad():
                model.blocks[0](model.inp(_batch(step, rank)[0]))  # type: ignore[index]
    guard.close()
    return [
        (a.step, str(a.layer), str(a.phase), list(a.suspect_ranks), a.detail.get("diverged"))
        for a in guard.alarms
    ] + [dict(a.detail) for a in guard.alarms]


def _scenarios(rank: int, world: int, row: str) -> dict[str, Any]:
    native.set_enabled(row == "host")
    return {
        "batch_loss": _run("batch", rank, audit_every=2, audit_mode="loss", calibrate=1),
        "batch_gradient": _run("batch", rank, audit_every=2, audit_mode="gradient", calibrate=1),
        "layer_gradient": _run("layer", rank, audit_every=2, audit_mode="gradient"),
        "batch_deferred": _run("batch", rank, defer_decision=True),
        "flipped": _run("batch", rank, flip_at=3, halt_on_alarm=False),
    }


@pytest.mark.parametrize("row", ["host", "device"])
def test_a_checkpointed_batchnorm_model_runs_clean_and_a_flip_after_its_backward_is_caught(
    row: str,
) -> None:
    results = run_ranks(_scenarios, 2, row)
    assert results[0] == results[1]  # every rank decided the same
    r = results[0]
    for clean in ("batch_loss", "batch_gradient", "layer_gradient", "batch_deferred"):
        assert r[clean] == [], clean
    (found, detail) = r["flipped"]
    assert found == (3, "fingerprint", "weights", [1], "buffers")
    assert detail["buffers_changed_after_forward"] == [1]


def _reentrant(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = _Checkpointed("layer", reentrant=True)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = GuardConfig(audit_every=1, audit_mode="gradient")
    guard = SDCGuard(ddp, opt, microbatch=_batch, loss_fn=_loss, config=config)
    try:
        with guard.step(0):
            opt.zero_grad(set_to_none=True)
            guard.backward(_loss(ddp, _batch(0, rank)))
            opt.step()
    except NotReplayableError as err:
        return str(err)
    finally:
        guard.close()
    return "no error"


def test_a_gradient_audit_through_reentrant_checkpointing_says_what_to_change() -> None:
    for message in run_ranks(_reentrant, 2):
        assert "use_reentrant=False" in message
        assert "audit_mode='loss'" in message
