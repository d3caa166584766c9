"""What a rank's model and optimizer state is, as lists of tensors in one fixed order.

A checkpoint holds parameters and persistent buffers; the replicas vote on parameters, buffers
and the optimizer's per-parameter state; a fault injector flips an element of that state. Each
of them needs the same list in the same order on every rank, so the listing lives here, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "model_state_tensors",
    "optimizer_state_slots",
    "optimizer_state_tensors",
    "persistent_buffers",
]


def persistent_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The module's persistent buffers (what ``state_dict`` saves), in ``buffers()`` order,
    each once."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for mod in module.modules():
        skip = mod._non_persistent_buffers_set
        for name, buf in mod._buffers.items():
            if buf is None or name in skip or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append(buf)
    return out


def model_state_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Parameters, then persistent buffers: the model state a checkpoint holds and
    :func:`verify_after_load` checks."""
    return list(module.parameters()) + persistent_buffers(module)


def optimizer_state_slots(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]
) -> list[tuple[dict[Any, Any], Any, torch.Tensor]]:
    """Where each voted state tensor lives: ``(the parameter's state dict, key, tensor)``, in
    the order of :func:`optimizer_state_tensors` (what a cache of them checks itself against)."""
    out: list[tuple[dict[Any, Any], Any, torch.Tensor]] = []
    for p in params:
        state = optimizer.state.get(p)
        if not state:
            continue
        for key in sorted(state, key=str):
            value = state[key]
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                out.append((state, key, value))
    return out


def optimizer_state_tensors(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """The optimizer state the replicas vote on: every state tensor of rank ≥ 1 (Adam's moments),
    in parameter order and sorted key order. Scalar step counters are left out: they would
    double the number of tensors to reduce for no information (a wrong counter shows in the
    weights at the next update)."""
    return [t for _, _, t in optimizer_state_slots(optimizer, params)]
