"""A non-finite value in the optimizer state, checked after every update.

A finite gradient element of 3·10³⁵ (one bit-30 flip) squares to ``inf`` in Adam's
``exp_avg_sq``; from then on that parameter's updates are ``0/inf`` or ``NaN`` on every replica,
the same on all of them, so no fingerprint vote sees it. The check is the largest magnitude of
each floating-point state tensor (``torch._foreach_norm`` with ``ord=inf``: one multi-tensor
reduction, no overflow for finite state, NaN and Inf propagate), folded to one flag on the
device; the guard all-gathers it with the step's row, so it costs no extra synchronisation.

Invariant: the flag is 1 exactly when some state element is NaN or ±Inf.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from detection.vote import optimizer_state_tensors

__all__ = ["OptimizerStateCheck", "state_nonfinite_flag"]


def state_nonfinite_flag(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], device: torch.device
) -> torch.Tensor:
    """``1`` (int64, on ``device``) if any floating-point state tensor holds a NaN or an Inf."""
    tensors = [
        t.detach() for t in optimizer_state_tensors(optimizer, params) if t.is_floating_point()
    ]
    if not tensors:
        return torch.zeros(1, dtype=torch.int64, device=device)
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault((t.device, t.dtype), []).append(t)
    peaks = []
    for group in by_device.values():
        norms = torch._foreach_norm(group, math.inf)
        peaks.append(torch.stack([n.to(torch.float64) for n in norms]).sum().to(device))
    total = torch.stack(peaks).sum()
    return (~torch.isfinite(total)).to(torch.int64).reshape(1)


class OptimizerStateCheck:
    """Raises once when the state turns non-finite; a state that stays non-finite is the same
    event (it cannot heal by itself), and a state that is finite again re-arms the check."""

    def __init__(self) -> None:
        self._open = False

    def observe(self, flags: Sequence[int]) -> tuple[int, ...] | None:
        """The ranks whose state just turned non-finite, or ``None``."""
        bad = tuple(r for r, f in enumerate(flags) if f)
        if not bad:
            self._open = False
            return None
        if self._open:
            return None
        self._open = True
        return bad
