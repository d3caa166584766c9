"""The sharded fingerprint: the unsharded model's bits under DDP, FSDP2 at world 2 and 4,
HSDP 2x2 and across a reshard through ``torch.distributed.checkpoint`` — in real gloo ranks,
on a model whose dims do not divide by the world (uneven and empty shards)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from detection.weights.fingerprint import Fingerprint, fingerprint_on_device, weight_fingerprint
from detection.weights.sharded import ShardLayoutError, shard_runs, sharded_fingerprint
from tests.detection.conftest import run_ranks

MASK = (1 << 64) - 1


def _model(seed: int = 0) -> nn.Module:
    """Dims 7, 5 and 3: over 2 and 4 ranks the shards are uneven, over 4 the last is empty."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.ReLU(), nn.Linear(7, 3))


def _shard(model: nn.Module, mesh_shape: tuple[int, ...]) -> nn.Module:
    """The FSDP2 tutorial's wrapping: each block, then the root; a 2-D mesh is HSDP."""
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for block in (model[0], model[3]):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model: nn.Module, rank: int, steps: int = 2) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _flip(t: torch.Tensor, bit: int) -> None:
    """Flip ``bit`` of element 0 of a float32 tensor, in place."""
    words = t.view(torch.int32).reshape(-1)
    words[0] ^= 1 << bit


def _sharded_run(rank: int, world: int, mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    model = _model()
    unsharded = weight_fingerprint(model.parameters()).hex()
    _shard(model, mesh_shape)
    params = list(model.parameters())
    at_init = sharded_fingerprint(params).hex()
    _train(model, rank)
    trained = sharded_fingerprint(params).hex()
    full = weight_fingerprint([p.full_tensor() for p in params]).hex()  # type: ignore[attr-defined]
    # One bit of the first weight's shard on rank 1: rows 2-3 of 7 over 4, 4-6 over 2; under
    # HSDP 2x2 the first replica's copy of shard 1 (the copy the sum counts; the other copy
    # is the replica vote's to compare, detection.weights.replicas).
    local = params[0].to_local()  # type: ignore[attr-defined]
    owner = 1
    with torch.no_grad():
        if rank == owner:
            _flip(local, 7)
        flipped = sharded_fingerprint(params).hex()
        if rank == owner:
            _flip(local, 7)
    restored = sharded_fingerprint(params).hex()
    return {
        "unsharded": unsharded,
        "at_init": at_init,
        "trained": trained,
        "full": full,
        "flipped": flipped,
        "restored": restored,
        "local_numel": [p.to_local().numel() for p in params],  # type: ignore[attr-defined]
    }


def _ddp_run(rank: int, world: int) -> str:
    ddp = DistributedDataParallel(_model())
    return sharded_fingerprint(ddp.module.parameters()).hex()


REFERENCE = weight_fingerprint(_model().parameters()).hex()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "mesh_shape"), [(2, (2,)), (4, (4,)), (4, (2, 2))], ids=["fsdp2", "fsdp4", "hsdp2x2"]
)
def test_a_sharded_model_has_the_unsharded_fingerprint(
    world: int, mesh_shape: tuple[int, ...]
) -> None:
    results = run_ranks(_sharded_run, world, mesh_shape, timeout_s=120)
    first = results[0]
    for r in results:
        assert r["unsharded"] == r["at_init"] == REFERENCE
        # every rank reads the same whole value, and it is the gathered weights' fingerprint
        assert r["trained"] == r["full"] == first["trained"] != REFERENCE
        assert r["flipped"] != r["trained"]  # one bit in one rank's shard: every rank sees it
        assert r["flipped"] == first["flipped"]
        assert r["restored"] == r["trained"]
    if mesh_shape == (4,):
        # uneven: 7 rows as 2, 2, 2, 1; 3 rows as 1, 1, 1, 0 (rank 3 holds no row of it)
        assert [r["local_numel"][0] for r in results] == [10, 10, 10, 5]
        assert [r["local_numel"][4] for r in results] == [7, 7, 7, 0]


@pytest.mark.slow
def test_ddp_replicas_have_the_same_fingerprint_with_no_collective() -> None:
    assert run_ranks(_ddp_run, 2, timeout_s=60) == [REFERENCE, REFERENCE]


def _save_then_reshard(rank: int, world: int, where: str) -> dict[str, str]:
    """Train under a 1-D mesh of 4, save; load into an HSDP 2x2 model started elsewhere."""
    model = _shard(_model(), (world,))
    _train(model, rank)
    saved = sharded_fingerprint(model.parameters()).hex()
    dcp.save({"model": model.state_dict()}, checkpoint_id=where)
    other = _shard(_model(seed=1), (2, 2))
    before = sharded_fingerprint(other.parameters()).hex()
    state = {"model": other.state_dict()}
    dcp.load(state, checkpoint_id=where)
    other.load_state_dict(state["model"])
    return {
        "saved": saved,
        "before": before,
        "loaded": sharded_fingerprint(other.parameters()).hex(),
    }


def _load_on_two(rank: int, world: int, where: str) -> str:
    model = _shard(_model(seed=2), (world,))
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=where)
    model.load_state_dict(state["model"])
    return sharded_fingerprint(model.parameters()).hex()


@pytest.mark.slow
def test_a_reshard_through_distributed_checkpoint_keeps_the_fingerprint(tmp_path: Path) -> None:
    where = str(tmp_path / "ckpt")
    four = run_ranks(_save_then_reshard, 4, where, timeout_s=120)
    saved = four[0]["saved"]
    assert all(r["saved"] == saved != r["before"] for r in four)
    assert all(r["loaded"] == saved for r in four)  # FSDP 4 → HSDP 2x2
    assert run_ranks(_load_on_two, 2, where, timeout_s=60) == [saved, saved]  # → FSDP 2


# -- single process: the runs of a box ------------------------------------------------------------
def _add(parts: list[Fingerprint]) -> Fingerprint:
    return Fingerprint(sum(p.a for p in parts) & MASK, sum(p.b for p in parts) & MASK)


def _fp(runs: list[torch.Tensor], offsets: list[int]) -> Fingerprint:
    if not runs:
        return Fingerprint(0, 0)
    a, b = fingerprint_on_device(runs, offsets=offsets).tolist()
    return Fingerprint(a & MASK, b & MASK)


@pytest.mark.parametrize("dims", [(0,), (1,), (2,), (0, 2), (1, 2)], ids=str)
def test_the_runs_of_every_box_add_up_to_the_whole(dims: tuple[int, ...]) -> None:
    """Any sharding into ``torch.chunk`` boxes along ``dims``, uneven and with empty boxes:
    the boxes' runs, fingerprinted at their global positions, sum to the whole tensor's."""
    whole = torch.randn(5, 3, 7)
    chunks = {d: (2 if d == 0 else 4) for d in dims}
    ranges = []
    for d in range(whole.dim()):
        n = whole.shape[d]
        if d in chunks:
            size = -(-n // chunks[d])
            ranges.append([(min(i * size, n), min((i + 1) * size, n)) for i in range(chunks[d])])
        else:
            ranges.append([(0, n)])
    parts = []
    for box in itertools.product(*ranges):
        local = whole[tuple(slice(lo, hi) for lo, hi in box)].clone()
        runs, starts = shard_runs(local, whole.shape, [lo for lo, _ in box])
        assert sum(r.numel() for r in runs) == local.numel()
        parts.append(_fp(runs, starts))
    assert _add(parts) == weight_fingerprint([whole])


def test_a_shard_that_is_not_its_box_is_refused() -> None:
    with pytest.raises(ShardLayoutError, match="leaves"):
        shard_runs(torch.zeros(3, 2), (4, 2), (2, 0))
    with pytest.raises(ShardLayoutError, match="shape"):
        shard_runs(torch.zeros(3), (4, 2), (0, 0))
