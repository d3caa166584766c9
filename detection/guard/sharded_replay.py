"""One loss replay through an FSDP2 / HSDP model that leaves FSDP2 as it found it.

The ring audit of a sharded model (:mod:`detection.guard.sharded_audit`) recomputes a
micro-batch's loss through the sharded module itself: no rank holds the whole model, so the
forward all-gathers every FSDP module's parameters as the original forward did. Those
all-gathers are collectives — every rank of an all-gather group must issue them together — so
every rank replays at the same moment, each its own ring partner's micro-batch, and all of them
run the same number of forwards.

What the replay must not disturb (its invariant: after :func:`replay_loss` FSDP2 is in the
state the step's last backward left it in, and the training step goes on as if no replay had
run):

* gradients — the forward runs under ``torch.no_grad()``: FSDP2 registers no pre- or
  post-backward hook on its inputs or outputs, builds no autograd graph, and issues no
  reduce-scatter; ``.grad`` is not touched;
* sharding — FSDP2 keeps the root module's parameters unsharded after its forward (a
  heuristic for training: the backward needs them at once). After a replay no backward
  follows: every parameter group sharded before the replay is resharded (as
  :meth:`FSDPModule.reshard` does), so the next step's forward all-gathers the updated shards
  instead of reading a stale unsharded copy;
* backward prefetch order — each FSDP forward records its module's position for the next
  backward's prefetching; the replay's records are dropped again, so the next step's backward
  prefetches exactly what it would have without the replay;
* RNG and buffers — the caller's RNG state is restored (:func:`rng_preserved`) and the
  buffers the original forward saw are swapped in by reference for the replay
  (:class:`~detection.audit.recompute.BufferSnapshot`), so running statistics see one update.

The all-gathers the replay issues go through the guard's checked all-gather like any other
(:class:`~detection.guard.sharded_hook.CheckedAllGather`): every rank of a group issues the same
ones, so their views stay comparable and are compared with the step's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from detection.audit.recompute import AutocastState, BufferSnapshot, rng_preserved
from detection.audit.ring import encode_loss, seed_rng

__all__ = ["fsdp_modules", "fsdp_untouched", "replay_loss"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    """Every module ``fully_shard`` wrapped inside ``module`` (the root included)."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def fsdp_untouched(modules: Sequence[FSDPModule]) -> Iterator[None]:
    """Run a forward through FSDP2 modules and leave them as found: the parameter groups
    sharded before sharded again, the forward-order records the backward prefetch reads cut
    back to their length before. (A group the loop kept unsharded — ``reshard_after_backward``
    off — may come back sharded: FSDP2 gathers it again when next needed.)"""
    groups = [g for m in modules for g in m._get_fsdp_state()._fsdp_param_groups]
    sharded = [g for g in groups if g.is_sharded]
    indices = [(g._post_forward_indices, len(g._post_forward_indices)) for g in groups]
    orders = {id(g.comm_ctx): g.comm_ctx.post_forward_order for g in groups}
    lengths = [(order, len(order)) for order in orders.values()]
    try:
        yield
    finally:
        for group in sharded:
            group.reshard()  # FSDPModule.reshard, per group: the root stays unsharded otherwise
        for recorded, n in indices:
            del recorded[n:]
        for order, n in lengths:
            del order[n:]


def replay_loss(
    model: nn.Module,
    modules: Sequence[FSDPModule],
    loss_fn: LossFn,
    batch: Any,
    *,
    seed: int,
    autocast: AutocastState,
    buffers: BufferSnapshot,
    device: torch.device,
    on_seed: Callable[[int | None], None],
) -> torch.Tensor:
    """The bits of ``loss_fn(model, batch)`` (one int64 word, on the device), recomputed
    with the RNG seeded ``seed`` where the original forward was, under ``autocast``, with the
    buffers of ``buffers``' snapshot (consumed). Collective: every rank calls it together.

    ``on_seed(seed)`` tells the forward pre-hook to seed again when the model's forward starts
    (the original was seeded there, after whatever ``loss_fn`` drew before calling the model);
    ``on_seed(None)`` ends that."""
    with (
        rng_preserved(device),
        buffers.swapped_in(),
        fsdp_untouched(modules),
        torch.no_grad(),
    ):
        seed_rng(seed, device)
        on_seed(seed)
        try:
            with autocast.applied():
                loss = loss_fn(model, batch)
        finally:
            on_seed(None)
        return encode_loss(loss)
