"""Recipe: the guard's learnt state in a loop's own checkpoint (docs/guide.md, "Resuming").

A job checkpoints at step ``SAVED`` with ``"sdcguard": guard.state_dict()`` beside the model and
optimizer; every rank holds the same state (checked). A resumed job loads it before its first
step and is armed at once: it decides its steps exactly as the uninterrupted job does (the same
learnt state after the same steps, bit for bit), and a flip at its first step is caught on that
step, naming the faulty rank, against the *learnt* threshold (not the early one). A state of
another world size or model is refused with ``GuardConfigError``.

The per-step statistics carry these runs alone (``abft=False``): the checksums learn nothing and
are armed from the first step with or without a saved state.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detection.guard import GuardConfig, GuardConfigError, GuardUsageError, SDCGuard
from tests.detection.conftest import run_ranks
from tests.detection.loops._common import FAULTY_RANK, SEED, features

SAVED = 30  # the checkpoint holds the state after this step
AFTER = 4  # steps run after it


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(12, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


def _train(guard: SDCGuard, ddp: nn.Module, optimizer: Any, rank: int, steps: range) -> None:
    for step in steps:
        with guard.step(step):
            optimizer.zero_grad(set_to_none=True)
            guard.backward(loss_fn(ddp, features(step, rank)))
            optimizer.step()


def _job(
    rank: int, config: GuardConfig, checkpoint: Path | None
) -> tuple[SDCGuard, nn.Module, torch.optim.Optimizer]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = None
    if checkpoint is not None:  # the recipe: model, optimizer, then the guard's state
        state = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    ddp = DistributedDataParallel(model)
    # Not part of the recipe: one bucket layout from the first step on, so the straight and the
    # resumed job reduce every step in the same order and can be compared bit for bit.
    ddp.reducer._push_all_rebuilt_params()
    guard = SDCGuard(ddp, optimizer, microbatch=features, loss_fn=loss_fn, config=config)
    if state is not None:
        guard.load_state_dict(state["sdcguard"])
    return guard, ddp, optimizer


def _resume_rank(rank: int, world: int, directory: str) -> dict[str, Any]:
    checkpoint = Path(directory) / "ckpt.pt"
    config = GuardConfig(seed=SEED, abft=False, halt_on_alarm=False)
    guard, ddp, optimizer = _job(rank, config, None)
    _train(guard, ddp, optimizer, rank, range(SAVED + 1))
    state = guard.state_dict()
    if rank == 0:
        torch.save(
            {
                "model": ddp.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "sdcguard": state,
            },
            checkpoint,
        )
    states: list[Any] = [None] * world
    dist.all_gather_object(states, state)
    dist.barrier()
    _train(guard, ddp, optimizer, rank, range(SAVED + 1, SAVED + 1 + AFTER))
    straight = (guard.state_dict(), [a.to_report() for a in guard.alarms])
    guard.close()

    guard, ddp, optimizer = _job(rank, config, checkpoint)
    _train(guard, ddp, optimizer, rank, range(SAVED + 1, SAVED + 1 + AFTER))
    resumed = (guard.state_dict(), [a.to_report() for a in guard.alarms])
    guard.close()

    flip = f"grad-flip@{FAULTY_RANK}:{SAVED + 1}:30"
    guard, ddp, optimizer = _job(rank, replace(config, inject=(flip,)), checkpoint)
    _train(guard, ddp, optimizer, rank, range(SAVED + 1, SAVED + 2))
    faulty = [a.to_report() for a in guard.alarms]
    refused = []
    for change in ({"world_size": world + 1}, {"parameters": [1, 2, 3]}):
        try:
            guard.load_state_dict({**state, **change})
        except GuardConfigError as err:
            refused.append(str(err))
    guard.close()
    return {
        "same_on_every_rank": all(s == states[0] for s in states),
        "straight": straight,
        "resumed": resumed,
        "faulty": faulty,
        "refused": refused,
    }


def test_a_resumed_job_is_armed_with_the_saved_state_at_its_first_step(
    tmp_path: Path,
) -> None:
    results = run_ranks(_resume_rank, 3, str(tmp_path), timeout_s=600)
    for r in results:
        assert r["same_on_every_rank"]
        assert r["straight"][1] == []
        assert r["resumed"] == r["straight"]  # the same decisions and state, bit for bit
        assert len(r["refused"]) == 2
    assert "world size" in results[0]["refused"][0]
    [alarm] = results[0]["faulty"]
    assert (alarm["step"], alarm["layer"], alarm["suspect_ranks"]) == (
        SAVED + 1,
        "gradstats",
        [FAULTY_RANK],
    )
    # tested against the learnt threshold: the early floor (x64) is not what named it
    assert alarm["detail"]["threshold"] < math.log(64.0)
    assert all(r["faulty"] == results[0]["faulty"] for r in results)


def test_state_dict_inside_a_step_is_refused_saying_when_to_call_it() -> None:
    results = run_ranks(_inside_rank, 3, timeout_s=300)
    assert all("between steps" in r for r in results)


def _inside_rank(rank: int, world: int) -> str:
    guard, ddp, optimizer = _job(rank, GuardConfig(seed=SEED, abft=False), None)
    message = "no error"
    try:
        with guard.step(0):
            optimizer.zero_grad(set_to_none=True)
            guard.backward(loss_fn(ddp, features(0, rank)))
            optimizer.step()
            try:
                guard.state_dict()
            except GuardUsageError as err:
                message = str(err)
    finally:
        guard.close()
    return message
