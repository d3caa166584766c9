"""SDCGuard on FSDP2 and HSDP models, in real gloo ranks: a loop written as FSDP2's tutorial
writes it runs clean, and a fault is caught — a NaN gradient under FSDP2, a flipped weight bit
under HSDP (two replicas: detected, ambiguous; four: the rank named); what the guard does not
support is refused at construction, saying so."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.tensor import Shard

from detection.guard import GuardConfig, GuardConfigError, GuardHaltedError, SDCGuard
from detection.guard.trace_mode import REPLAY_END_ENV
from detection.stepcheck import StatsConfig
from detection.weights.load_check import LoadVerificationError
from detection.weights.sharded import sharded_fingerprint
from tests.detection.conftest import run_ranks
from tests.detection.sharded_models import CheckpointedNet, ResidualNet, mse_loss, shard_layers

FLIP_STEP = 3


def _sharded(mesh_shape: tuple[int, ...], net: type[ResidualNet] = ResidualNet) -> nn.Module:
    """FSDP2's tutorial: fully_shard each block, then the root."""
    torch.manual_seed(0)
    model = net()
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    return shard_layers(model, init_device_mesh("cpu", mesh_shape, mesh_dim_names=names))


_loss = mse_loss


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _flip_weight_on(rank: int, target: int) -> Any:
    """An optimizer post-hook that flips one exponent bit of the first weight shard of rank
    ``target`` at ``FLIP_STEP``: the weight-flip fault, after ``optimizer.step``."""
    calls = {"n": 0}

    def hook(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if calls["n"] == FLIP_STEP and rank == target:
            local = opt.param_groups[0]["params"][0].to_local()
            with torch.no_grad():
                local.view(torch.int32).reshape(-1)[0] ^= 1 << 27
        calls["n"] += 1

    return hook


class _FaultyReduceScatter(ReduceScatter):
    """The collective with a fault inside it: at one call, the shard one rank receives comes
    back with bit 30 (the exponent's top bit) of its first element flipped."""

    def __init__(self, rank: int, target: int, at_call: int) -> None:
        self.rank, self.target, self.at_call, self.calls = rank, target, at_call, 0

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        work: dist.Work | None = dist.reduce_scatter_single(
            output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
        )
        if self.calls == self.at_call and self.rank == self.target:
            output_tensor.view(torch.int32)[0] ^= 1 << 30
        self.calls += 1
        return work


class _FaultyAllGather(AllGather):
    """An all-gather whose result on one rank, once armed, comes back with bit 22 (the
    mantissa's top bit) of one element flipped: one rank computes with a wrong parameter."""

    def __init__(self, rank: int, target: int) -> None:
        self.rank, self.target, self.armed = rank, target, False

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        work: dist.Work | None = dist.all_gather_single(
            output_tensor, input_tensor, group=group, async_op=async_op
        )
        if self.armed and self.rank == self.target:
            if work is not None:
                work.wait()
            output_tensor.view(torch.int32)[1] ^= 1 << 22
        self.armed = False
        return work


def _train(
    rank: int, world: int, mesh_shape: tuple[int, ...], fault: str, target: int, steps: int
) -> dict[str, Any]:
    model = _sharded(mesh_shape)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    # three FSDP modules (two blocks and the root): three reduce-scatters a step
    comm: Any = None
    if fault == "reduced":
        comm = _FaultyReduceScatter(rank, target, 3 * FLIP_STEP)
    elif fault == "gathered":
        comm = _FaultyAllGather(rank, target)
    # the statistics speak after `warmup` clean steps: from step 2 on in the activation test
    stats = StatsConfig(warmup=2) if fault == "activation" else StatsConfig()
    config = GuardConfig(seed=1, stats=stats)
    guard = SDCGuard(model, optim, loss_fn=_loss, config=config, comm_hook=comm)
    if fault == "weight":
        optim.register_step_post_hook(_flip_weight_on(rank, target))
    outcomes = []
    for step in range(steps):
        if fault == "gathered" and step == FLIP_STEP:
            comm.armed = True
        try:
            with guard.step(step):
                x, y = _batch(step, rank)
                if fault == "nan" and step == FLIP_STEP and rank == target:
                    x[0, 0] = float("nan")
                if fault == "activation" and step == FLIP_STEP and rank == target:
                    x[0] *= 1e4  # a finite corruption upstream: this rank's gradient explodes
                guard.backward(_loss(model, (x, y)))
                optim.step()
                optim.zero_grad()
        except GuardHaltedError:
            break
        assert guard.last_outcome is not None
        outcomes.append((step, guard.last_outcome.vote_passed, guard.last_outcome.alarm))
    whole = sharded_fingerprint(model.parameters())
    assert guard.last_outcome is not None
    try:  # as after loading a checkpoint recorded with the first replica's weights
        guard.verify_loaded(guard.last_outcome.fingerprint)
        wrong_replicas: list[int] = []
    except LoadVerificationError as err:
        wrong_replicas = err.ranks
    return {
        "wrong_replicas": wrong_replicas,
        "outcomes": outcomes,
        "alarms": [a.to_report() for a in guard.alarms],
        "halted": guard.halted,
        "fingerprint_matches": guard.last_outcome.fingerprint == whole,
        "coverage": guard.coverage(),  # type: ignore[attr-defined]
    }


def _clean_steps(result: dict[str, Any]) -> list[tuple[int, bool, Any]]:
    return [o for o in result["outcomes"] if o[0] < FLIP_STEP]


@pytest.mark.slow
def test_fsdp2_runs_the_tutorial_loop_clean_and_names_the_rank_of_a_nan_gradient() -> None:
    results = run_ranks(_train, 2, (2,), "nan", 1, 5, timeout_s=120)
    for r in results:
        assert [o[2] for o in _clean_steps(r)] == [None] * FLIP_STEP  # silent while clean
        assert all(not o[1] for o in r["outcomes"])  # no replica: no vote ever verifies
        assert r["fingerprint_matches"]
        assert "no weight vote" in r["coverage"]
        assert r["halted"]
        (alarm,) = r["alarms"]
        # seen in rank 1's own gradient, before the reduce-scatter mixed it into the shards
        assert (alarm["step"], alarm["layer"], alarm["phase"]) == (3, "nonfinite", "pre-allreduce")
        assert alarm["suspect_ranks"] == [1]
        assert alarm["detail"]["ranks_holding_nonfinite_shards"] == [0, 1]
        assert r["wrong_replicas"] == []  # one copy: it holds what the guard recorded


@pytest.mark.slow
def test_a_rank_whose_gradient_stands_out_is_named_by_the_statistics() -> None:
    """Rank 1's input is scaled up at step 3 (finite): its own gradient, seen before the
    reduce-scatter, stands out against the other ranks' and its own history. Step 2, tested
    after two clean steps learnt, is silent."""
    results = run_ranks(_train, 4, (4,), "activation", 1, 5, timeout_s=120)
    for r in results:
        assert [o[2] for o in _clean_steps(r)] == [None] * FLIP_STEP
        (alarm,) = r["alarms"]
        assert (alarm["step"], alarm["layer"]) == (3, "gradstats")
        assert alarm["suspect_ranks"] == [1]
        assert "weaker" in alarm["detail"]["evidence"]


@pytest.mark.slow
def test_a_reduce_scatter_that_miscomputes_a_shard_fails_its_algebra() -> None:
    """A fault inside the collective (the user's own reduce-scatter, which the guard wraps):
    every rank's own gradient is finite and its shards are finite, but their sum is not the
    sum of the inputs beyond any rounding. Silent on the clean steps before."""
    results = run_ranks(_train, 2, (2,), "reduced", 0, 5, timeout_s=120)
    for r in results:
        assert [o[2] for o in _clean_steps(r)] == [None] * FLIP_STEP
        (alarm,) = r["alarms"]
        assert (alarm["step"], alarm["layer"], alarm["phase"]) == (3, "allreduce", "post-allreduce")
        assert alarm["suspect_ranks"] == []
        assert alarm["detail"]["residual"] > alarm["detail"]["bound"] > 0


@pytest.mark.slow
def test_a_rank_that_gathers_a_wrong_parameter_is_named() -> None:
    """Four ranks all-gather the same bytes; rank 2's copy of one parameter comes back with a
    bit flipped (the user's own all-gather, which the guard wraps): a strict majority of the
    four views names it."""
    results = run_ranks(_train, 4, (4,), "gathered", 2, 5, timeout_s=120)
    for r in results:
        assert [o[2] for o in _clean_steps(r)] == [None] * FLIP_STEP
        (alarm,) = r["alarms"]
        assert (alarm["step"], alarm["layer"], alarm["phase"]) == (3, "allreduce", "forward")
        assert alarm["suspect_ranks"] == [2]
        assert alarm["detail"]["collective"] == "all-gather"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mesh_shape", "named"), [((2, 2), []), ((4, 1), [2])], ids=["two-replicas", "four-replicas"]
)
def test_hsdp_votes_within_replicate_groups(mesh_shape: tuple[int, int], named: list[int]) -> None:
    """Rank 2's weight bit flips after step 3's update. On a 2x2 mesh its shard has one other
    copy (rank 0): detected, nobody named. On 4x1 four copies: rank 2 (and its node) named."""
    results = run_ranks(_train, 4, mesh_shape, "weight", 2, 5, timeout_s=120)
    for r in results:
        clean = _clean_steps(r)
        assert [o[2] for o in clean] == [None] * FLIP_STEP
        assert all(o[1] for o in clean)  # replicas agreed: the vote is the gate's evidence
        assert r["fingerprint_matches"]
        (alarm,) = r["alarms"]
        assert (alarm["step"], alarm["layer"], alarm["phase"]) == (3, "fingerprint", "weights")
        assert alarm["suspect_ranks"] == named
        assert alarm["detail"]["ambiguous"] is (not named)
        groups = alarm["detail"]["replica_groups_split"]
        assert groups == ([[0, 2]] if mesh_shape == (2, 2) else [[0, 1, 2, 3]])
        assert len(alarm["suspect_nodes"]) == len(named)
        # the load check compares every replica's weights: rank 2's replica differs
        assert r["wrong_replicas"] == ([2, 3] if mesh_shape == (2, 2) else [2])
        # a shard group of one rank runs no reduce-scatter: the start says what that costs
        one_rank_shards = "shard groups of one rank run neither" in r["coverage"]
        assert one_rank_shards is (mesh_shape == (4, 1)), r["coverage"]
        assert ("before and after the reduce-scatter" in r["coverage"]) is (not one_rank_shards)


def _refusals(rank: int, world: int) -> dict[str, str]:
    out: dict[str, str] = {}

    def refused(what: str, build: Any, **config: Any) -> None:
        model = build()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            SDCGuard(model, optim, loss_fn=_loss, config=GuardConfig(**config))
        except GuardConfigError as err:
            out[what] = str(err)
        else:
            out[what] = "accepted"

    refused("audit", lambda: _sharded((world,)), audit_every=2)
    refused("gradient-audit", lambda: _sharded((world,)), audit_every=2, audit_mode="gradient")
    refused("inject", lambda: _sharded((world,)), inject=("weight-flip@0:1",))
    refused("fsdp1", lambda: FullyShardedDataParallel(ResidualNet(), device_id=torch.device("cpu")))

    def dim1() -> nn.Module:
        mesh = init_device_mesh("cpu", (world,))

        def last_dim(p: nn.Parameter) -> Shard:
            return Shard(p.dim() - 1)

        model = ResidualNet()
        fully_shard(model, mesh=mesh, shard_placement_fn=last_dim)
        return model

    refused("shard-dim-1", dim1)

    def blocks_only() -> nn.Module:
        model = ResidualNet()
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        return model

    refused("root-not-sharded", blocks_only)
    os.environ[REPLAY_END_ENV] = "3"  # inside a diagnostic run
    try:
        refused("trace-mode", lambda: _sharded((world,)))
    finally:
        del os.environ[REPLAY_END_ENV]
    dist.barrier()
    return out


@pytest.mark.slow
def test_what_the_sharded_guard_does_not_run_is_refused_with_the_reason() -> None:
    out = run_ranks(_refusals, 2, timeout_s=120)[0]
    assert out["audit"] == "accepted"  # the ring audit runs in loss mode (test_sharded_audit)
    assert "audit_mode='gradient'" in out["gradient-audit"]
    assert "reduce-scatter" in out["gradient-audit"]
    assert "fault injection" in out["inject"]
    assert "FSDP1" in out["fsdp1"]
    assert "Shard(d > 0)" in out["shard-dim-1"]
    assert "root is not fully_shard-ed" in out["root-not-sharded"]
    assert "trace mode" in out["trace-mode"]


def _recipes(rank: int, world: int) -> dict[str, Any]:
    """Clean runs of the DDP recipes that carry over: accumulation with FSDP2's own switch,
    autocast (bfloat16 on CPU), activation checkpointing, a GradScaler — and a GradScaler
    whose scale overflows every gradient: the scaler skips those steps, no alarm."""
    out: dict[str, Any] = {}
    for recipe in ("accumulation", "autocast", "checkpointing", "scaler", "overflow"):
        model = _sharded((world,), CheckpointedNet if recipe == "checkpointing" else ResidualNet)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        micro = 2 if recipe == "accumulation" else 1
        # statistics tested from step 1 on: every recipe's clean steps go through them
        config = GuardConfig(micro_batches=micro, stats=StatsConfig(warmup=1))
        guard = SDCGuard(model, optim, loss_fn=_loss, config=config)
        scaled = recipe in ("scaler", "overflow")
        scale = 2.0**127 if recipe == "overflow" else 2.0**10
        scaler = torch.amp.GradScaler("cpu", init_scale=scale, enabled=scaled)
        before = sharded_fingerprint(model.parameters())
        for step in range(3):
            with guard.step(step):
                for m in range(micro):
                    model.set_requires_gradient_sync(m == micro - 1)  # type: ignore[operator]
                    with torch.autocast("cpu", torch.bfloat16, enabled=recipe == "autocast"):
                        loss = _loss(model, _batch(step, 10 * rank + m))
                    if recipe == "overflow":
                        loss = loss * 1e6  # times 2**127: infinite on every rank
                    guard.backward(loss, scaler=scaler if scaled else None)
                scaler.step(optim)
                scaler.update()
                optim.zero_grad()
        assert guard.last_outcome is not None
        out[recipe] = {
            "steps": guard.counters.steps,
            "alarms": [a.to_report() for a in guard.alarms],
            "fingerprint_matches": guard.last_outcome.fingerprint
            == sharded_fingerprint(model.parameters()),
            "updated": guard.last_outcome.fingerprint != before,
        }
        guard.close()
    return out


@pytest.mark.slow
def test_the_ddp_recipes_that_carry_over_run_clean_on_fsdp2() -> None:
    for result in run_ranks(_recipes, 2, timeout_s=120):
        for recipe, r in result.items():
            updated = recipe != "overflow"  # every step overflowed: the scaler skipped them all
            want = {"steps": 3, "alarms": [], "fingerprint_matches": True, "updated": updated}
            assert r == want, recipe
