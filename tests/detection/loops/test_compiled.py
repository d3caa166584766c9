"""``torch.compile``: around the module inside DDP, and around the DDP model itself.

The loop trains through compiled code; a replay through the eager module would run other
kernels. The guard hooks the module the loop calls outside the compiled region and replays
through compiled code too: the compiled inner module for ``DDP(torch.compile(net))``, a
compiled copy of the inner module for ``torch.compile(DDP(net))``. Two ranks keep the compile
cost down (each rank compiles once per graph; the inductor cache serves the rest).
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
    assert_clean,
    features,
    summary,
)


def _net() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 4))


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


def _train(
    rank: int,
    where: str,
    mode: str,
    steps: int,
    inject: tuple[str, ...] = (),
    defer: bool = False,
) -> dict[str, Any]:
    if where == "inside":
        model: nn.Module = DistributedDataParallel(torch.compile(_net()))
    else:
        model = torch.compile(DistributedDataParallel(_net()))  # type: ignore[assignment]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = SDCGuard(
        model,
        optimizer,
        microbatch=features,
        loss_fn=_loss,
        identity=NodeIdentity(rank),
        config=GuardConfig(
            audit_every=1,
            audit_mode=mode,
            seed=SEED,
            inject=inject,
            halt_on_alarm=False,
            defer_decision=defer,
        ),
    )
    for step in range(steps):
        with guard.step(step):
            optimizer.zero_grad(set_to_none=True)
            guard.backward(_loss(model, features(step, rank)))
            optimizer.step()
    guard.close()
    return summary(guard)


def _ranks(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for where in ("inside", "outside"):
        for mode in ("loss", "gradient"):
            out[f"{where}-{mode}"] = _train(rank, where, mode, CLEAN_STEPS)
    out["nan"] = _train(rank, "outside", "loss", FAULT_STEPS, ("grad-nan@1:4",))
    out["flip"] = _train(rank, "outside", "gradient", FAULT_STEPS, ("grad-flip@1:4",))
    # decided a step later, the row carried in the compiled DDP's gradient all-reduce
    out["outside-deferred"] = _train(rank, "outside", "loss", CLEAN_STEPS, defer=True)
    out["nan-deferred"] = _train(rank, "outside", "loss", FAULT_STEPS, ("grad-nan@1:4",), True)
    return out


def test_compiled_models_replay_through_compiled_code() -> None:
    results = run_ranks(_ranks, 2, timeout_s=480)
    for key in (
        "inside-loss",
        "inside-gradient",
        "outside-loss",
        "outside-gradient",
        "outside-deferred",
    ):
        assert_clean(results, key)
    for r in results:
        # a NaN in rank 1's local gradient: named by the non-finite check, deferred or not
        assert r["nan"]["alarms"][0] == (4, "nonfinite", "pre-allreduce", [1])
        assert r["nan-deferred"]["alarms"] == r["nan"]["alarms"]
        # a finite flip (bit 30): the per-step statistics, armed from the first step (a
        # compiled model runs no checksums), name rank 1; the gradient audit's lone
        # disagreeing pair, rank 1 audited by rank 0, rides along in the same alarm
        assert r["flip"]["alarms"] == [(4, "gradstats", "pre-allreduce", [1])]
        [audit] = [a for a in r["flip"]["details"][0]["also"] if a["layer"] == "audit"]
        assert (audit["phase"], audit["suspect_ranks"]) == ("gradient", [0, 1])
        assert audit["mismatched_pairs"] == [{"auditor": 0, "audited": 1}]
