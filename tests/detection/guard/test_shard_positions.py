"""Under pure FSDP2 the row's fingerprint is custody's record after the update
(:mod:`detection.guard.shard_positions`), in real gloo ranks at world size 2: with one optimizer
over every parameter, and with two that split them, the record is taken and the step's
fingerprint is the unsharded model's, bitwise, every step; with a parameter no optimizer holds,
the record is refused and the guard's own pass gives the same value. A weight flipped after the
update, which the record does not see, is caught at the next step (custody, naming the rank),
and the checkpoint value of the flipped step is the update's. Without processes: which
coverings are a partition."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from detection.guard import GuardConfig, GuardHaltedError, SDCGuard
from detection.guard.shard_positions import UnshardedPositions
from detection.weights.sharded import sharded_fingerprint
from tests.detection.conftest import run_ranks
from tests.detection.sharded_models import mse_loss as _loss
from tests.detection.sharded_models import two_linear as _model

STEPS = 4
FLIP_STEP = 2


def test_a_partition_holds_every_parameter_exactly_once() -> None:
    params = [nn.Parameter(torch.zeros(n)) for n in (3, 5, 2)]
    positions = UnshardedPositions(params)
    a, b, c = (id(p) for p in params)
    assert positions.start == {a: 0, b: 3, c: 8}
    assert positions.partition([[a, c], [b]])
    assert positions.partition([[b, a, c]])
    assert not positions.partition([[a], [b]])  # c in no optimizer
    assert not positions.partition([[a, b], [b, c]])  # b in two
    assert not positions.partition([[a, b, c, id(object())]])  # not a parameter of the model


def _optimizers(model: nn.Module, kind: str) -> list[torch.optim.Optimizer]:
    params = list(model.parameters())
    if kind == "split":  # the first layer's weights apart from the rest
        return [torch.optim.AdamW(params[:2], lr=1e-2), torch.optim.SGD(params[2:], lr=0.1)]
    if kind == "uncovered":  # the last bias in no optimizer: trained by nobody, still counted
        return [torch.optim.AdamW(params[:-1], lr=1e-2)]
    return [torch.optim.AdamW(params, lr=1e-2)]


def _flip_after(rank: int) -> Any:
    """A post-hook registered after the guard's: at FLIP_STEP rank 1 flips bit 30 of its first
    weight shard's first element, after custody took its record."""
    calls = {"n": 0}

    def hook(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if calls["n"] == FLIP_STEP and rank == 1:
            local = opt.param_groups[0]["params"][0].to_local()
            with torch.no_grad():
                local.reshape(-1).view(torch.int32)[0] ^= 1 << 30
        calls["n"] += 1

    return hook


def _run(rank: int, kind: str) -> dict[str, Any]:
    model = _model()
    opts = _optimizers(model, kind)
    config = GuardConfig(seed=1, update_replay_every=2)
    guard = SDCGuard(model, opts, loss_fn=_loss, config=config)
    if kind == "flip":
        opts[0].register_step_post_hook(_flip_after(rank))
    recorded, matches, values = [], [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        try:
            with guard.step(step):
                guard.backward(_loss(model, (x, y)))
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
                recorded.append(guard.replay.row_part() is not None)  # type: ignore[attr-defined]
        except GuardHaltedError:
            break
        assert guard.last_outcome is not None
        values.append(guard.last_outcome.fingerprint)
        matches.append(guard.last_outcome.fingerprint == sharded_fingerprint(model.parameters()))
    return {
        "recorded": recorded,
        "matches": matches,
        "values": values,
        "alarms": [a.to_report() for a in guard.alarms],
    }


def _scenarios(rank: int, world: int) -> dict[str, dict[str, Any]]:
    del world
    return {kind: _run(rank, kind) for kind in ("one", "split", "uncovered", "flip")}


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_scenarios, 2, timeout_s=120)


@pytest.mark.parametrize("kind", ["one", "split"])
def test_a_partition_of_the_parameters_makes_the_record_the_rows_fingerprint(
    results: list[dict[str, dict[str, Any]]], kind: str
) -> None:
    for r in results:
        assert r[kind]["alarms"] == []
        assert r[kind]["recorded"] == [True] * STEPS
        assert r[kind]["matches"] == [True] * STEPS


def test_a_parameter_in_no_optimizer_takes_the_guards_own_pass(
    results: list[dict[str, dict[str, Any]]],
) -> None:
    for r in results:
        assert r["uncovered"]["alarms"] == []
        assert r["uncovered"]["recorded"] == [False] * STEPS
        assert r["uncovered"]["matches"] == [True] * STEPS


def test_a_weight_flipped_after_the_record_is_caught_at_the_next_step(
    results: list[dict[str, dict[str, Any]]],
) -> None:
    clean = results[0]["one"]["values"]
    for r in results:
        flip = r["flip"]
        # the flipped step's value is the update's, the clean run's: what the update wrote
        assert flip["values"][: FLIP_STEP + 1] == clean[: FLIP_STEP + 1]
        assert flip["matches"][:FLIP_STEP] == [True] * FLIP_STEP
        assert flip["matches"][FLIP_STEP] is False  # the weights now differ from the record
        [alarm] = flip["alarms"]
        assert (alarm["step"], alarm["layer"], alarm["phase"]) == (
            FLIP_STEP + 1,
            "fingerprint",
            "weights",
        )
        assert alarm["suspect_ranks"] == [1]
