"""Ship a rank's micro-batch to the rank that audits it, for loops with an ordinary data loader.

A ``DataLoader`` with a ``DistributedSampler`` hands each rank its own samples; no rank can
recompute another's batch from ``(step, rank)``. On audited steps (and when a scaler overflow
must be resolved) each rank therefore sends the batch it trained on to its auditor: one small
``all_gather_object`` of the batch *layouts* (nesting, shapes, dtypes, non-tensor leaves), then
point-to-point sends of the tensors themselves in one ``batch_isend_irecv`` — every send
matched by a receive posted at the same time, so the ring cannot deadlock.

Invariant: what an auditor receives is bitwise what the sender trained on — tensors travel as
raw data, in their own dtype, onto the receiver's device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from detection.row.held_works import hold

__all__ = ["BatchShipError", "exchange_batches"]


class BatchShipError(RuntimeError):
    """A batch could not be shipped (a structure this module cannot carry)."""


@dataclass(frozen=True)
class _Slot:
    """Where a tensor sat in the batch: its position in the flat list, shape and dtype."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _flatten(value: Any, out: list[torch.Tensor]) -> Any:
    """The batch with every tensor replaced by a :class:`_Slot` (tensors appended to ``out``)."""
    if isinstance(value, torch.Tensor):
        out.append(value.detach().contiguous())
        return _Slot(len(out) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
        return type(value)(*(_flatten(v, out) for v in value))
    if isinstance(value, tuple | list):
        return type(value)(_flatten(v, out) for v in value)
    if isinstance(value, Mapping):
        return {k: _flatten(v, out) for k, v in value.items()}
    return value


def _unflatten(layout: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if isinstance(layout, _Slot):
        return tensors[layout.index]
    if isinstance(layout, tuple) and hasattr(layout, "_fields"):
        return type(layout)(*(_unflatten(v, tensors) for v in layout))
    if isinstance(layout, tuple | list):
        return type(layout)(_unflatten(v, tensors) for v in layout)
    if isinstance(layout, Mapping):
        return {k: _unflatten(v, tensors) for k, v in layout.items()}
    return layout


def _slots(layout: Any) -> list[_Slot]:
    found: list[_Slot] = []

    def walk(value: Any) -> None:
        if isinstance(value, _Slot):
            found.append(value)
        elif isinstance(value, tuple | list):
            for v in value:
                walk(v)
        elif isinstance(value, Mapping):
            for v in value.values():
                walk(v)

    walk(layout)
    return sorted(found, key=lambda s: s.index)


def exchange_batches(
    outgoing: Mapping[int, Sequence[Any]],
    *,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> dict[int, list[Any]]:
    """Collective: every rank calls it, with ``outgoing[dest]`` the batches it sends to rank
    ``dest`` (none: an empty mapping). Returns ``{source: batches}`` of what it received.

    One ``all_gather_object`` of layouts (everyone learns who sends what to whom, so every
    rank posts exactly the receives that match) and one ``batch_isend_irecv``.
    """
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    mine: dict[int, list[Any]] = {}
    send_tensors: dict[int, list[torch.Tensor]] = {}
    for dest, batches in outgoing.items():
        flat: list[torch.Tensor] = []
        mine[dest] = [_flatten(b, flat) for b in batches]
        send_tensors[dest] = [t.to(device) for t in flat]
    layouts: list[Any] = [None] * world
    dist.all_gather_object(layouts, mine, group=group)

    ops: list[dist.P2POp] = []
    received: dict[int, tuple[list[Any], list[torch.Tensor]]] = {}
    for source in range(world):
        plan = layouts[source] or {}
        if source == rank or rank not in plan:
            continue
        slots = [s for layout in plan[rank] for s in _slots(layout)]
        buffers = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in slots]
        received[source] = (plan[rank], buffers)
        peer = _global_rank(group, source)
        ops.extend(dist.P2POp(dist.irecv, b, peer, group) for b in buffers)
    for dest, tensors in send_tensors.items():
        if dest == rank:
            raise BatchShipError("a rank cannot audit itself")
        peer = _global_rank(group, dest)
        ops.extend(dist.P2POp(dist.isend, t, peer, group) for t in tensors)
    if ops:
        for work in dist.batch_isend_irecv(ops):
            hold(work).wait()
    return {
        source: [_unflatten(layout, buffers) for layout in plan]
        for source, (plan, buffers) in received.items()
    }


def _global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)
