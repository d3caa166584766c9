"""Which sharded models the guard takes, and which it refuses at construction (saying why).

Taken: a model the loop calls that FSDP2's ``fully_shard`` wrapped (an ``FSDPModule``, or
``torch.compile`` of one), every parameter a DTensor on one device mesh spanning the whole
job, placed

* ``(Shard(0),)`` on a 1-D mesh — FSDP2: one copy of each shard, no replica;
* ``(Replicate(), Shard(0))`` on a 2-D mesh — HSDP: shards within a row, replicas across.

Refused, each with a :class:`~detection.guard.config.GuardConfigError` that names the reason:
FSDP1 (``FullyShardedDataParallel``) anywhere in the model; a root that ``fully_shard`` did not
wrap; parameters ``fully_shard`` left whole (``ignored_params``); parameters on several meshes;
a mesh that covers only part of the job (pipeline stages) or has a third dim; any other
placement — ``Shard(d)`` for ``d > 0`` (``shard_placement_fn``), ``_StridedShard`` or a second
``Shard`` (tensor parallelism composed with FSDP), ``Partial``. Each refused layout would need
a fingerprint numbering or a vote this first cut does not have; see ``docs/guide.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from detection.guard.config import GuardConfig, GuardConfigError
from detection.weights.replicas import ReplicaGroups

__all__ = ["ShardedLayout", "adopt_sharded", "is_sharded", "refuse_unsupported", "user_comms"]


@dataclass(frozen=True)
class ShardedLayout:
    """A sharded model the guard takes: the module the loop calls, its parameters (all
    DTensors) in ``parameters()`` order, their mesh, and which ranks hold the same shard."""

    module: nn.Module
    params: list[nn.Parameter]
    mesh: DeviceMesh
    replicas: ReplicaGroups
    gatherers: ReplicaGroups  # the all-gather groups: the ranks of one replica of the model

    @property
    def hsdp(self) -> bool:
        return self.mesh.ndim == 2

    @property
    def device(self) -> torch.device:
        first = self.params[0]
        local = first.to_local() if isinstance(first, DTensor) else first
        return local.device


def _root(model: nn.Module) -> nn.Module:
    inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
    return inner if isinstance(inner, nn.Module) else model


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is (or holds) a sharded model rather than a DDP one: the guard then
    adopts it here, or refuses it with a reason."""
    root = _root(model)
    if isinstance(root, FSDPModule | FullyShardedDataParallel):
        return True
    return any(isinstance(m, FullyShardedDataParallel) for m in root.modules()) or any(
        isinstance(p, DTensor) for p in root.parameters()
    )


def _refuse_placements(mesh: DeviceMesh, placements: tuple[Placement, ...], name: str) -> None:
    if mesh.ndim == 1:
        expected: tuple[type, ...] = (Shard,)
        shape = "FSDP2 on a 1-D mesh places every parameter as (Shard(0),)"
    else:
        expected = (Replicate, Shard)
        shape = (
            "HSDP on a 2-D (replicate, shard) mesh places every parameter as "
            "(Replicate(), Shard(0))"
        )
    kinds = tuple(type(p) for p in placements)
    dims = [p.dim for p in placements if type(p) is Shard]
    if kinds != expected or dims != [0]:
        raise GuardConfigError(
            f"parameter {name!r} is placed {placements}: {shape}; other placements (tensor "
            "parallelism, _StridedShard, Shard(d > 0) from shard_placement_fn, Partial) are not "
            "supported by the guard"
        )


def adopt_sharded(model: nn.Module) -> ShardedLayout:
    """The layout of an FSDP2 or HSDP model, or :class:`GuardConfigError` saying why not."""
    root = _root(model)
    if any(isinstance(m, FullyShardedDataParallel) for m in root.modules()):
        raise GuardConfigError(
            "FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) is not supported: shard "
            "with FSDP2's fully_shard, or use DistributedDataParallel"
        )
    if not isinstance(root, FSDPModule):
        raise GuardConfigError(
            "the model has DTensor parameters but its root is not fully_shard-ed: call "
            "fully_shard on the module the loop calls (tensor or pipeline parallelism without "
            "FSDP2 is not supported)"
        )
    params: list[nn.Parameter] = []
    mesh: DeviceMesh | None = None
    for name, p in root.named_parameters():
        if not isinstance(p, DTensor):
            raise GuardConfigError(
                f"parameter {name!r} is not sharded (fully_shard's ignored_params): every "
                "parameter must be sharded by fully_shard for the guard's fingerprint and vote"
            )
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh != mesh:
            raise GuardConfigError(
                f"parameter {name!r} is on another device mesh: the guard takes one mesh"
            )
        if p.device_mesh.ndim > 2:
            raise GuardConfigError(
                f"a {p.device_mesh.ndim}-D device mesh: the guard takes FSDP2 (1-D) or HSDP "
                "(2-D replicate x shard); tensor, context or pipeline parallel dims are not "
                "supported"
            )
        _refuse_placements(p.device_mesh, tuple(p.placements), name)
        params.append(p)
    if mesh is None:
        raise GuardConfigError("the model has no parameters")
    world = dist.get_world_size()
    if mesh.size() != world:
        raise GuardConfigError(
            f"the device mesh spans {mesh.size()} of {world} ranks: a mesh over part of the job "
            "(pipeline stages, a sub-mesh) is not supported"
        )
    table = mesh.mesh.tolist()
    rows = table if mesh.ndim == 2 else [table]
    return ShardedLayout(
        module=root,
        params=params,
        mesh=mesh,
        replicas=ReplicaGroups.of_mesh(rows),
        gatherers=ReplicaGroups(tuple(tuple(row) for row in rows)),
    )


def refuse_unsupported(config: GuardConfig, comm_hook: Any) -> None:
    """What a sharded model's guard does not run, refused when asked for (never ignored)."""
    refused = {
        "abft=True": config.abft is True,
        "skip_update_on_alarm=True": config.skip_update_on_alarm,
        "defer_decision=True": config.defer_decision,
        "inject (fault injection)": bool(config.inject),
        "comm_hook that is not an FSDP2 ReduceScatter, AllGather or one of each": comm_hook
        is not None
        and user_comms(comm_hook) is None,
    }
    asked = [what for what, on in refused.items() if on]
    if asked:
        raise GuardConfigError(
            "not available on an FSDP2/HSDP model in this version: "
            + ", ".join(asked)
            + " (docs/guide.md, 'Sharded models', lists what runs)"
        )


def user_comms(hook: Any) -> tuple[ReduceScatter | None, AllGather | None] | None:
    """A user's FSDP2 comms as (reduce-scatter, all-gather), or ``None`` if ``hook`` is not
    one of them or a pair of one each."""
    items = list(hook) if isinstance(hook, list | tuple) else [hook]
    rs = [c for c in items if isinstance(c, ReduceScatter)]
    ag = [c for c in items if isinstance(c, AllGather)]
    if len(rs) > 1 or len(ag) > 1 or len(rs) + len(ag) != len(items) or not items:
        return None
    return (rs[0] if rs else None, ag[0] if ag else None)
