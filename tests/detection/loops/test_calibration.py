"""Start-up agreement and calibration: what makes a loop's replays comparable, found before
the first alarm could accuse anyone.

* ranks that would compute differently (here: deterministic algorithms on one rank only)
  refuse to start, naming the setting, the ranks and the fix;
* a clean loop arms after ``calibrate`` clean audits;
* a forward that draws from a generator of its own (an unseeded ``torch.rand``) cannot be
  replayed: calibration refuses to arm and says so;
* a loss handed to ``guard.backward`` that is not ``loss_fn(model, batch)`` (divided outside
  it) is named as such, with the fix.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detection.audit.calibration import NotReplayableError
from detection.guard import GuardConfig, GuardConfigError, SDCGuard
from tests.detection.conftest import run_ranks
from tests.detection.loops._common import SEED, NodeIdentity, features, summary

CALIBRATE = 3


class _Noisy(nn.Module):
    """Input noise from a generator of its own: the guard cannot seed what it does not know."""

    def __init__(self, own_generator: bool) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.net = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4))
        self.generator = torch.Generator().manual_seed(1) if own_generator else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(x.shape, generator=self.generator)  # default generator: seeded
        return self.net(x + 0.01 * noise)


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


def _train(rank: int, *, own_generator: bool, divide: float = 1.0) -> dict[str, Any]:
    model = DistributedDataParallel(_Noisy(own_generator))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = SDCGuard(
        model,
        optimizer,
        microbatch=features,
        loss_fn=_loss,
        identity=NodeIdentity(rank),
        config=GuardConfig(audit_every=2, seed=SEED, calibrate=CALIBRATE),
    )
    refused = None
    armed_at = None
    try:
        for step in range(12):
            with guard.step(step):
                optimizer.zero_grad(set_to_none=True)
                guard.backward(_loss(model, features(step, rank)) / divide)
                optimizer.step()
            if guard.armed and armed_at is None:
                armed_at = step
    except NotReplayableError as err:
        refused = str(err)
    guard.close()
    return {**summary(guard), "refused": refused, "armed_at": armed_at}


def _disagree(rank: int) -> str:
    torch.use_deterministic_algorithms(rank == 1)
    try:
        model = DistributedDataParallel(_Noisy(False))
        SDCGuard(
            model, torch.optim.SGD(model.parameters(), lr=0.1), microbatch=features, loss_fn=_loss
        )
    except GuardConfigError as err:
        return str(err)
    finally:
        torch.use_deterministic_algorithms(False)
    return "started"


def _ranks(rank: int, world: int) -> dict[str, Any]:
    return {
        "disagree": _disagree(rank),
        "clean": _train(rank, own_generator=False),
        "own_generator": _train(rank, own_generator=True),
        "divided": _train(rank, own_generator=False, divide=4.0),
    }


def test_start_up_agreement_and_calibration() -> None:
    results = run_ranks(_ranks, 2, timeout_s=240)
    for r in results:
        said = r["disagree"]
        assert "deterministic differs" in said, said
        assert "ranks [1]" in said, said
        assert "torch.use_deterministic_algorithms" in said
        clean = r["clean"]
        assert clean["refused"] is None
        assert clean["alarms"] == []
        assert clean["armed_at"] == 2 * (CALIBRATE - 1)  # audits at steps 0, 2, 4
        assert clean["counters"]["calibration_audits"] == CALIBRATE
        assert clean["counters"]["audits"] == clean["counters"]["audits_passed"] == 6
        noisy = r["own_generator"]
        assert noisy["alarms"] == []  # not an alarm: a refusal, at the first audit
        assert noisy["refused"] is not None
        assert "refuses to arm" in noisy["refused"]
        assert "torch.Generator of your own" in noisy["refused"]
        assert noisy["counters"]["steps"] == 0
        divided = r["divided"]["refused"]
        assert divided is not None
        assert "scaled by 0.25" in divided
        assert "inside loss_fn" in divided
