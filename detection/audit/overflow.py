"""Overflow or SDC? Resolving a non-finite local gradient under a GradScaler.

Under a scaler a non-finite local gradient is normally an overflow: the scaler skips the step
and lowers the scale, and the replicas stay equal. When only some ranks went non-finite, that
is ambiguous — an overflow of those ranks' data, or a fault that produced the NaN. Recomputing
the rank's micro-batches on its auditor, at the very same scale, separates the two: an overflow
is a property of the data, weights and scale, so it happens there too; a fault does not.

Megatron turns NaN checks off under fp16; this keeps them on and pays one recomputation per
rank that alone went non-finite, only on such steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from detection.audit.batches import exchange_batches
from detection.audit.recompute import AutocastState
from detection.audit.ring import PartnerRecompute, auditors_of
from detection.row.gather import all_gather_rows

__all__ = ["recompute_flagged"]


def recompute_flagged(
    replay: PartnerRecompute,
    flagged: Sequence[int],
    *,
    step: int,
    partners: Sequence[int],
    micros: Sequence[int],
    own_batches: dict[int, Any] | None,
    positions: Sequence[int],
    autocast: dict[int, AutocastState],
    scale: torch.Tensor | None,
    group: dist.ProcessGroup | None,
) -> tuple[list[int], int]:
    """Collective. ``(finite, shipped)``: ``finite[r]`` is ``1`` when flagged rank ``r``'s local
    gradient, recomputed by its auditor at ``scale``, came out finite (only flagged entries
    mean anything); ``shipped`` the micro-batches this rank sent.

    ``own_batches``: this rank's micro-batches when the loop hands batches over (they are
    shipped to the auditor first); ``None`` when ``microbatch(step, rank)`` recomputes them.
    """
    rank = dist.get_rank(group)
    auditors = auditors_of(partners)
    target = partners[rank]
    batches: dict[int, Any] | None = None
    shipped = 0
    if own_batches is not None:
        outgoing = {auditors[rank]: [own_batches[m] for m in micros]} if rank in flagged else {}
        received = exchange_batches(outgoing, device=replay.device, group=group)
        shipped = sum(len(b) for b in outgoing.values())
        if target in received:
            batches = dict(zip(micros, received[target], strict=True))
    verdict = torch.zeros(1, dtype=torch.int64, device=replay.device)
    if target in flagged:
        verdict = replay.finite(
            step,
            target,
            [list(positions)],
            micros=micros,
            batches=batches,
            autocast=autocast,
            scale=scale,
        ).reshape(1)
    rows = all_gather_rows(verdict, group)
    return [rows[auditors[r]][0] for r in range(len(partners))], shipped
