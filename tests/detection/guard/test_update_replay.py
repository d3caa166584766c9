"""Under pure FSDP2, the owner's update replayed by its buddy and its shards kept in custody
(:mod:`detection.guard.update_replay`), in real gloo ranks at world sizes 2 and 4: clean runs
long enough for every shard to be replayed raise nothing (SGD with momentum, Adam, AdamW,
the latter also ``foreach`` and ``fused``), nor does a loop that writes the weights on purpose
and says so (``verify_loaded``, as after loading a checkpoint); a weight
flipped after ``optimizer.step`` (bit 30, and a low mantissa bit), or a flipped moment, is
caught at the next step, naming its rank; a parameter written between the snapshot and the
update is caught at that step, naming the owner and its buddy (at world size 4 the owner alone,
after a third replay).
Without processes: the replay of SGD, Adam and AdamW on plain tensors is bitwise the
optimizer's own update."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from detection.guard import GuardConfig, GuardConfigError, GuardHaltedError, SDCGuard
from detection.guard.update_payload import (
    AMP,
    amp_of,
    encode,
    fingerprint_one,
    replay_payload,
    replay_update,
    take_snapshots,
)
from detection.guard.update_replay import balanced_slices
from detection.weights.sharded import sharded_fingerprint
from tests.detection.conftest import run_ranks
from tests.detection.sharded_models import mse_loss as _loss
from tests.detection.sharded_models import two_linear as _model

K = 2  # replay every shard once every 2 steps
STEPS = 6
FAULT_STEP = 3

_OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, maximize=True),
    "foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int32 if t.element_size() == 4 else torch.int64)


@pytest.mark.parametrize("kind", sorted(_OPTIMIZERS))
def test_the_replay_of_one_parameter_is_bitwise_the_optimizers_update(kind: str) -> None:
    """The owner's optimizer updates three parameters for three steps; each step one of them
    is replayed alone from its snapshot (pre-update value, gradient, state, options) and comes
    out bitwise equal, state included; a gradient with one sign bit flipped comes out
    different."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n)) for n in (7, 33, 5)]
    opt = _OPTIMIZERS[kind](params)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        p = params[step % 3]
        before = p.detach().clone()
        grad = p.grad.detach().clone()  # type: ignore[union-attr]
        state = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
        options = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        opt.step()
        new, new_state = replay_update(type(opt), options, before, grad, state)
        assert torch.equal(_bits(new), _bits(p))
        assert sorted(new_state) == sorted(opt.state[p])
        for key, value in opt.state[p].items():
            assert torch.equal(_bits(new_state[key]), _bits(value)), key
        wrong = grad.clone()
        _bits(wrong)[0] ^= -(1 << 31)  # the sign bit
        off, _ = replay_update(type(opt), options, before, wrong, state)
        assert not torch.equal(_bits(off), _bits(p))


def test_a_fused_update_under_a_grad_scaler_replays_with_its_scale() -> None:
    """``scaler.step`` hands a fused AdamW its scale and overflow flag as attributes for the
    step: the replay takes them along (and a scaled gradient replayed without them would
    differ), and an overflow step is a no-op in both."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(17))
    opt = torch.optim.AdamW([p], lr=1e-2, eps=0.5, fused=True)  # eps: the scale matters
    for found in (0.0, 1.0, 0.0):
        p.grad = torch.randn_like(p) * 1024.0
        opt.grad_scale = torch.tensor(1024.0)  # type: ignore[attr-defined]
        opt.found_inf = torch.tensor(found)  # type: ignore[attr-defined]
        amp = amp_of(opt)
        options = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        before, grad = p.detach().clone(), p.grad.detach().clone()
        state = {k: v.clone() for k, v in opt.state[p].items()}
        opt.step()
        new, _ = replay_update(type(opt), {**options, AMP: amp}, before, grad, state)
        assert torch.equal(_bits(new), _bits(p))
        without, _ = replay_update(type(opt), options, before, grad, state)
        assert not torch.equal(_bits(without), _bits(p))  # scaled, or stepped over an overflow


@pytest.mark.parametrize("kind", ["plain-sgd", "sgd", "adamw"])
def test_a_snapshot_sent_as_one_buffer_replays_to_the_owners_fingerprints(kind: str) -> None:
    """The owner's snapshot, copied into one buffer as the buddy receives it: replayed, it
    matches what the update wrote — no state (plain SGD), state created by the first update,
    state carried — and a wrong fingerprint of the owner's is seen."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n)) for n in (9, 4)]
    make = _OPTIMIZERS.get(kind, lambda ps: torch.optim.SGD(ps, lr=0.1))
    opt = make(params)
    for step in range(2):
        items = []
        for i, p in enumerate(params):
            p.grad = torch.randn_like(p)
            options = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
            items.append((i, 0, options, p.detach(), p.grad, dict(opt.state[p])))
        snaps, buffer = take_snapshots(items, 0, torch.device("cpu"))
        assert buffer is not None
        opt.step()
        for snap, p in zip(snaps, params, strict=True):
            state = opt.state[p]
            snap.post_keys = sorted(k for k, v in state.items() if torch.is_tensor(v))
            snap.post = torch.stack(
                [fingerprint_one(p)] + [fingerprint_one(state[k]) for k in snap.post_keys]
            )
        if step == 1:
            snaps[1].post[0, 0] += 1  # type: ignore[index]
        package = encode(snaps, [buffer])
        results = replay_payload(package, [opt], torch.device("cpu"))
        assert [r.index for r in results] == [0, 1]
        assert [r.elements for r in results] == [9, 4]
        assert not any(r.state_differs for r in results)
        assert [r.param_differs for r in results] == [False, step == 1]


def test_slices_are_balanced_by_element_count_and_cover_every_parameter() -> None:
    slices = balanced_slices([60, 10, 30, 3, 30], 3)
    assert slices == [0, 1, 1, 2, 2]  # loads 60, 40, 33: largest first into the lightest
    assert balanced_slices([5, 5], 4) == [0, 1]  # more slices than parameters: some empty


def _flip_after_step(rank: int, target: int, bit: int) -> Any:
    """An optimizer post-hook (registered after the guard's): at FAULT_STEP, flip ``bit`` of
    the first element of rank ``target``'s first weight shard — a stored weight that changes
    after its update."""
    calls = {"n": 0}

    def hook(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if calls["n"] == FAULT_STEP and rank == target:
            local = opt.param_groups[0]["params"][0].to_local()
            with torch.no_grad():
                _bits(local)[0] ^= 1 << bit
        calls["n"] += 1

    return hook


def _flip_state_after_step(rank: int, target: int) -> Any:
    """An optimizer post-hook (registered after the guard's): at FAULT_STEP, flip bit 30 of the
    first element of rank ``target``'s first moment (AdamW's ``exp_avg``) of its first shard."""
    calls = {"n": 0}

    def hook(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if calls["n"] == FAULT_STEP and rank == target:
            moment = opt.state[opt.param_groups[0]["params"][0]]["exp_avg"].to_local()
            _bits(moment)[0] ^= 1 << 30
        calls["n"] += 1

    return hook


def _write_before_update(rank: int, target: int, guard: Any) -> Any:
    """An optimizer pre-hook (registered after the guard's): at FAULT_STEP, rank ``target``
    flips bit 30 of a parameter of the slice replayed that step, after the guard's snapshot —
    its update computes from a wrong value (a fault inside the update)."""
    calls = {"n": 0}

    def hook(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if calls["n"] == FAULT_STEP and rank == target:
            due = FAULT_STEP % K
            index = next(
                i
                for i, p in enumerate(opt.param_groups[0]["params"])
                if guard.replay.slices[i] == due and p.to_local().numel()
            )
            with torch.no_grad():
                _bits(opt.param_groups[0]["params"][index].to_local())[0] ^= 1 << 30
        calls["n"] += 1

    return hook


def _run(rank: int, world: int, kind: str, fault: str, target: int) -> dict[str, Any]:
    model = _model()
    opt = _OPTIMIZERS[kind](model.parameters())
    config = GuardConfig(seed=1, update_replay_every=K, vote_optimizer_state=fault == "state")
    guard = SDCGuard(model, opt, loss_fn=_loss, config=config)
    if fault.startswith("flip"):
        opt.register_step_post_hook(_flip_after_step(rank, target, int(fault[4:])))
    elif fault == "state":
        opt.register_step_post_hook(_flip_state_after_step(rank, target))
    elif fault == "write":
        opt.register_step_pre_hook(_write_before_update(rank, target, guard))
    # a fused optimizer stepped through a GradScaler unscales inside its kernel
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if fault == "scaler" else None
    steps = 0
    for step in range(STEPS):
        if fault == "reload" and step == FAULT_STEP:
            with torch.no_grad():  # weights written on purpose, then declared
                for p in model.parameters():
                    p.mul_(0.5)
            guard.verify_loaded(sharded_fingerprint(model.parameters()))
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        try:
            with guard.step(step):
                guard.backward(_loss(model, (x, y)), scaler=scaler)
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                opt.zero_grad()
        except GuardHaltedError:
            break
        steps += 1
    replay = guard.replay  # type: ignore[attr-defined]
    owner = (rank - 1) % world
    owned = [i for i, p in enumerate(model.parameters()) if _shard_rows(p, owner, world)]
    return {
        "alarms": [a.to_report() for a in guard.alarms],
        "steps": steps,
        "replayed_all": replay.checked == set(owned),
        "coverage": guard.coverage(),  # type: ignore[attr-defined]
    }


def _shard_rows(p: torch.Tensor, rank: int, world: int) -> int:
    """Rows of ``p``'s ``Shard(0)`` that ``rank`` holds (torch.chunk's split)."""
    chunks = torch.empty(p.shape[0]).chunk(world)
    return chunks[rank].numel() if rank < len(chunks) else 0


def _scenarios(rank: int, world: int) -> dict[str, dict[str, Any]]:
    last = world - 1
    return {
        "sgd": _run(rank, world, "sgd", "none", 0),
        "adamw": _run(rank, world, "adamw", "none", 0),
        "adam": _run(rank, world, "adam", "none", 0),
        "foreach": _run(rank, world, "foreach", "none", 0),
        "fused": _run(rank, world, "fused", "none", 0),
        "reload": _run(rank, world, "adamw", "reload", 0),
        "scaler": _run(rank, world, "fused", "scaler", 0),
        "flip30": _run(rank, world, "adamw", "flip30", last),
        "flip1": _run(rank, world, "sgd", "flip1", last),
        "write": _run(rank, world, "adamw", "write", last),
        "state": _run(rank, world, "adamw", "state", last),
    }


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def runs(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, dict[str, Any]]]]:
    world: int = request.param
    return world, run_ranks(_scenarios, world, timeout_s=120)


@pytest.mark.slow
def test_clean_runs_replay_every_shard_and_raise_nothing(runs: Any) -> None:
    _, results = runs
    for r in results:
        for kind in ("sgd", "adamw", "adam", "foreach", "fused", "reload", "scaler"):
            assert r[kind]["alarms"] == [], kind
            assert r[kind]["steps"] == STEPS
            assert r[kind]["replayed_all"], kind  # every shard of its owner, within 2K steps
            assert "update replay by the next rank" in r[kind]["coverage"]


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["flip30", "flip1"])
def test_a_weight_flipped_after_its_update_is_caught_at_the_next_step(
    runs: Any, fault: str
) -> None:
    """Bit 30 (a huge weight) and bit 1 (a last-place change no statistic could see): the
    custody check names the flipped rank alone at the step after the flip."""
    world, results = runs
    for r in results:
        (alarm,) = r[fault]["alarms"]
        assert (alarm["step"], alarm["layer"], alarm["phase"]) == (
            FAULT_STEP + 1,
            "fingerprint",
            "weights",
        )
        assert alarm["suspect_ranks"] == [world - 1]
        assert alarm["detail"]["check"] == "custody"


@pytest.mark.slow
def test_a_moment_flipped_after_its_update_is_caught_at_the_next_step(runs: Any) -> None:
    """AdamW's first moment, bit 30, between two updates: a replay from it would reproduce it;
    custody of the state (``vote_optimizer_state=True``) names the rank at the next step, as a
    change of the optimizer state alone."""
    world, results = runs
    for r in results:
        (alarm,) = r["state"]["alarms"]
        assert (alarm["step"], alarm["layer"], alarm["phase"]) == (
            FAULT_STEP + 1,
            "fingerprint",
            "optimizer-state",
        )
        assert alarm["suspect_ranks"] == [world - 1]
        assert alarm["detail"]["state_changed"] == [world - 1]
        assert alarm["detail"]["weights_changed"] == []


@pytest.mark.slow
def test_a_wrong_update_in_the_replayed_slice_is_caught_at_its_step(runs: Any) -> None:
    """The owner's update computes from a parameter written after the snapshot: the buddy's
    replay from the snapshot differs at that step. Two ranks: owner and buddy named, the pair
    cannot be split. Four: the rank after the buddy replays a third time, agrees with the
    buddy, and the owner alone is named."""
    world, results = runs
    owner, buddy = world - 1, 0
    for r in results:
        (alarm,) = r["write"]["alarms"]
        assert (alarm["step"], alarm["layer"], alarm["phase"]) == (FAULT_STEP, "audit", "weights")
        assert alarm["detail"]["pairs"] == [[owner, buddy]]
        if world == 2:
            assert alarm["suspect_ranks"] == [0, 1]
            assert alarm["detail"]["ambiguous"]
            assert "referees" not in alarm["detail"]
        else:
            assert alarm["suspect_ranks"] == [owner]
            assert not alarm["detail"]["ambiguous"]
            assert alarm["detail"]["referees"] == [
                {"owner": owner, "buddy": buddy, "referee": 1, "agrees_with": "buddy"}
            ]


def _refused(rank: int, world: int) -> list[str]:
    messages = []
    for optim, config in (
        (torch.optim.Adagrad, GuardConfig()),
        (torch.optim.Adam, GuardConfig(update_replay_every=0, vote_optimizer_state=True)),
    ):
        model = _model()
        try:
            SDCGuard(model, optim(model.parameters()), loss_fn=_loss, config=config)
            messages.append("")
        except GuardConfigError as err:
            messages.append(str(err))
    return messages


@pytest.mark.slow
def test_what_the_replay_cannot_do_is_refused_at_start() -> None:
    """An optimizer whose replay is not known exact; the state's custody without the replay."""
    for optimizer, state in run_ranks(_refused, 2, timeout_s=60):
        assert "Adagrad" in optimizer
        assert "update_replay_every=0" in optimizer
        assert "vote_optimizer_state=True" in state
