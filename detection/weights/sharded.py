"""The fingerprint of sharded weights (FSDP2, HSDP): the same bits as the unsharded model's.

:mod:`detection.weights.fingerprint` defines ``A`` and ``B`` over each element's *global*
position. Here that position is the element's place in the *unsharded* parameter: a rank
fingerprints only the shards it holds, each element at the position it has in the full tensor
(:func:`shard_runs`), and one all-reduce of the parts over the mesh gives the whole.

Why the parts add up to the whole (the proof the docstring of the definition extends)
------------------------------------------------------------------------------------------
*A shard is a set of global positions.* Let a DTensor have global shape ``G`` (row-major
strides ``S``) on a mesh with placements ``P``. For :class:`~torch.distributed.tensor.Shard`
and :class:`~torch.distributed.tensor.Replicate` placements, the local tensor on a rank is the
box ``[O_k, O_k + L_k)`` of the global tensor in every dim ``k`` (``L``: the local shape,
``O``: the global offset, both from ``compute_local_shape_and_global_offset``, whose chunking
is ``torch.chunk``'s: uneven dims give the last ranks fewer rows, possibly none). Local element
``j`` sits at global flat position ``Σ_k (j_k + O_k)·S_k``. With ``p`` the last dim where
``L_p < G_p``, the dims after ``p`` are whole, so for each prefix ``(j_0 … j_(p-1))`` the local
elements form one run of ``L_p·S_p`` consecutive global positions starting at
``Σ_(k<p) (j_k + O_k)·S_k + O_p·S_p``. ``Shard(0)`` (FSDP2's default) is one run a parameter
at ``O_0·S_0``; a whole tensor is one run at 0. Each run is a contiguous slice of the local
tensor's row-major order, so its words are read in place.

*Padding never counts.* FSDP2 pads each rank's shard to ``ceil(G_0 / world)`` rows in its
flat all-gather buffer; the DTensor's local tensor is the unpadded view, and its shape is
checked against ``L`` before any word is read (:class:`ShardLayoutError` otherwise), so a
padding word could never be given a position.

*Every position is counted exactly once.* The boxes of the ranks that differ in a ``Shard``
mesh coordinate partition the global tensor (``torch.chunk`` covers every row once); ranks
that differ only in a ``Replicate`` coordinate hold the same box. So only the ranks whose
coordinate is 0 on every mesh dim where the tensor is replicated contribute its words (the
*contributors*), and a tensor that is not a DTensor (a buffer, a parameter FSDP left whole) is
contributed by the mesh's first rank alone. Summing the contributors' parts is then summing
``A`` and ``B``'s terms over a partition of all positions, which by "concatenation is
addition" is the fingerprint of the unsharded list, whatever the mesh, the world size or the
unevenness of the shards. The same list under DDP (every tensor whole, one run at its offset)
gives the same terms, and so does any resharding through ``torch.distributed.checkpoint``:
it moves words between ranks, never between positions.

*The all-reduce is exact.* ``A`` and ``B`` are sums mod 2**64. The parts are sent as four
non-negative int64 words, the low and the high 32 bits of each; a sum of up to 2**31 such
words cannot overflow int64, so the all-reduce (gloo, NCCL, any backend) adds them exactly,
relying on no wrap-around in the communication library, and ``lo + hi·2**32`` taken mod 2**64
on the device is the sum of the parts mod 2**64.

*Not covered:* ``_StridedShard`` (FSDP over tensor parallelism, where a rank's rows of one
dim are not consecutive) and ``Partial`` (values not yet reduced) are refused with
:class:`ShardLayoutError`; :mod:`detection.guard` refuses those meshes before.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from detection.weights.fingerprint import (
    Fingerprint,
    fingerprint_from_tensor,
    fingerprint_on_device,
)
from detection.weights.fingerprint_kernels import FingerprintError

__all__ = [
    "ShardLayoutError",
    "ShardedParts",
    "local_parts",
    "shard_runs",
    "sharded_fingerprint",
    "sharded_fingerprint_on_device",
]

_LOW32 = (1 << 32) - 1


class ShardLayoutError(FingerprintError):
    """A tensor's placement has no place in the unsharded numbering this module supports
    (``_StridedShard``, ``Partial``), or its local shard is not the box its placement says."""


def shard_runs(
    local: torch.Tensor, global_shape: Sequence[int], global_offset: Sequence[int]
) -> tuple[list[torch.Tensor], list[int]]:
    """The local box ``local`` (placed at ``global_offset`` in a tensor of ``global_shape``) as
    runs of consecutive global flat positions: the 1-D views and where each starts."""
    shape = tuple(local.shape)
    if len(shape) != len(global_shape) or len(global_offset) != len(global_shape):
        raise ShardLayoutError(
            f"a local shard of shape {shape} in a tensor of shape {tuple(global_shape)}"
        )
    if any(o < 0 or o + n > g for o, n, g in zip(global_offset, shape, global_shape, strict=True)):
        raise ShardLayoutError(
            f"a shard of shape {shape} at {tuple(global_offset)} leaves {tuple(global_shape)}"
        )
    if local.numel() == 0:
        return [], []
    strides = [math.prod(global_shape[k + 1 :]) for k in range(len(global_shape))]
    cut = [k for k, (n, g) in enumerate(zip(shape, global_shape, strict=True)) if n < g]
    if not cut:
        return [local.reshape(-1)], [0]
    p = cut[-1]
    run = shape[p] * strides[p]
    first = global_offset[p] * strides[p]
    if p == 0:
        return [local.reshape(-1)], [first]
    rows = local.contiguous().reshape(-1, run)
    starts: list[int] = []
    for prefix in torch.cartesian_prod(*(torch.arange(n) for n in shape[:p])).reshape(-1, p):
        starts.append(
            first + sum((int(j) + global_offset[k]) * strides[k] for k, j in enumerate(prefix))
        )
    return list(rows.unbind(0)), starts


@dataclass
class ShardedParts:
    """One rank's share of a list's fingerprint: the runs it contributes, their global
    positions, and the mesh the list is sharded on (``None``: nothing is a DTensor)."""

    runs: list[torch.Tensor]
    offsets: list[int]
    mesh: DeviceMesh | None
    total: int  # elements of the unsharded list


def _mesh_of(tensors: Sequence[torch.Tensor]) -> DeviceMesh | None:
    meshes = {id(t.device_mesh): t.device_mesh for t in tensors if isinstance(t, DTensor)}
    if len(meshes) > 1:
        raise ShardLayoutError(
            f"tensors on {len(meshes)} device meshes: one fingerprint sums over one mesh"
        )
    return next(iter(meshes.values()), None)


def _contributes(mesh: DeviceMesh | None, replicated_dims: Iterable[int]) -> bool:
    """Whether this rank holds the copy that counts: coordinate 0 on every replicated dim."""
    if mesh is None:
        return True
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ShardLayoutError("this rank is not part of the tensors' device mesh")
    return all(coordinate[d] == 0 for d in replicated_dims)


def _dtensor_runs(t: DTensor) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """Runs and starts of a DTensor's local shard, and the mesh dims it is replicated on."""
    replicated: list[int] = []
    for dim, placement in enumerate(t.placements):
        if type(placement) is Replicate:
            replicated.append(dim)
        elif type(placement) is not Shard:
            raise ShardLayoutError(
                f"placement {placement!r} on mesh dim {dim}: only Shard and Replicate have a "
                "place in the unsharded numbering (_StridedShard and Partial do not)"
            )
    local = t.to_local()
    shape, offset = _local_box(t.shape, t.device_mesh, tuple(t.placements))
    if tuple(local.shape) != tuple(shape):
        raise ShardLayoutError(
            f"local shard of shape {tuple(local.shape)}, but its placement gives {tuple(shape)}"
            " (a padded or stale local tensor)"
        )
    runs, starts = shard_runs(local.detach(), t.shape, offset)
    return runs, starts, replicated


@functools.lru_cache(maxsize=4096)
def _local_box(
    shape: torch.Size, mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's box of a tensor of ``shape`` placed so on ``mesh``: its local shape and its
    global offset. A function of its (hashable) arguments and of this rank's place in the
    mesh, which a process never changes: computed once per layout, not on every step (it
    dispatches a tensor operation and reads a scalar back, a host synchronisation on a GPU)."""
    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(local), tuple(offset)


def local_parts(
    tensors: Iterable[torch.Tensor], *, start: int = 0, every_copy: bool = False
) -> ShardedParts:
    """This rank's runs of ``tensors`` (DTensors or plain tensors, numbered in order from
    ``start``, each tensor at its unsharded place): only the copies that count towards the
    sum, or with ``every_copy`` whatever this rank holds (what replicas of a shard compare)."""
    ts = list(tensors)
    mesh = _mesh_of(ts)
    everything = tuple(range(mesh.ndim)) if mesh is not None else ()
    runs: list[torch.Tensor] = []
    offsets: list[int] = []
    at = start
    for t in ts:
        if isinstance(t, DTensor):
            pieces, starts, replicated = _dtensor_runs(t)
        else:
            pieces, starts, replicated = [t.detach().reshape(-1)], [0], list(everything)
        if every_copy or _contributes(mesh, replicated):
            runs.extend(pieces)
            offsets.extend(at + s for s in starts)
        at += t.numel()  # a DTensor's numel is its global one
    return ShardedParts(runs=runs, offsets=offsets, mesh=mesh, total=at - start)


def _on_device(parts: ShardedParts, device: torch.device) -> torch.Tensor:
    if not parts.runs:
        return torch.zeros(2, dtype=torch.int64, device=device)
    return fingerprint_on_device(parts.runs, offsets=parts.offsets).to(device)


def sharded_fingerprint_on_device(
    tensors: Iterable[torch.Tensor],
    *,
    start: int = 0,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The fingerprint of the unsharded ``tensors`` as a 2-element int64 device tensor, on
    every rank of ``group`` (default: the world; collective over it when any tensor is a
    DTensor, whose mesh must span exactly ``group``). No DTensor: the local fingerprint, no
    collective. See the module for why the parts add up."""
    ts = list(tensors)
    parts = local_parts(ts, start=start)
    device = _device_of(ts, parts.mesh)
    mine = _on_device(parts, device)
    if parts.mesh is None:
        return mine
    size = dist.get_world_size(group)
    if parts.mesh.size() != size:
        raise ShardLayoutError(
            f"the device mesh has {parts.mesh.size()} ranks, the group {size}: the sum "
            "over the mesh needs a group of exactly its ranks"
        )
    halves = torch.stack([mine & _LOW32, (mine >> 32) & _LOW32]).T.reshape(-1).contiguous()
    dist.all_reduce(halves, group=group)
    lo, hi = halves.reshape(2, 2).T
    return lo + (hi << 32)


def sharded_fingerprint(
    tensors: Iterable[torch.Tensor],
    *,
    start: int = 0,
    group: dist.ProcessGroup | None = None,
) -> Fingerprint:
    """:func:`sharded_fingerprint_on_device` as host integers (one synchronisation)."""
    return fingerprint_from_tensor(
        sharded_fingerprint_on_device(tensors, start=start, group=group).cpu()
    )


def _device_of(ts: Sequence[torch.Tensor], mesh: DeviceMesh | None) -> torch.device:
    """Where the parts are summed: the tensors' device, or the mesh's for a rank with no run
    (its part is zeros, and the all-reduce needs a tensor its backend takes)."""
    if ts:
        first = ts[0].to_local() if isinstance(ts[0], DTensor) else ts[0]
        return first.device
    if mesh is not None:
        return torch.device(mesh.device_type)
    return torch.device("cpu")
