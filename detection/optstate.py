"""A non-finite value in the optimizer state, checked after every update.

A finite gradient element of 3·10³⁵ (one bit-30 flip) squares to ``inf`` in Adam's
``exp_avg_sq``; from then on that parameter's updates are ``0/inf`` or ``NaN`` on every replica,
the same on all of them, so no fingerprint vote sees it. The check is a float32 sum of each
floating-point state tensor (NaN and Inf propagate; one read of the state) — of all of them in
one pass over their concatenation while the state is small — folded to one flag on the device;
the guard all-gathers it with the step's row, so it costs no extra synchronisation.

Invariant: the flag is 1 when some state element is NaN or ±Inf (or a float32 sum of it overflows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from detection.vote import optimizer_state_tensors

__all__ = ["OptimizerStateCheck", "state_nonfinite_flag"]

_ONE_PASS_MAX = 1 << 20  # state elements summed through one concatenation (4 MiB in float32)


def state_nonfinite_flag(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], device: torch.device
) -> torch.Tensor:
    """``1`` (int64, on ``device``) if any floating-point state tensor holds a NaN or an Inf."""
    tensors = [
        t.detach() for t in optimizer_state_tensors(optimizer, params) if t.is_floating_point()
    ]
    if not tensors:
        return torch.zeros(1, dtype=torch.int64, device=device)
    if sum(t.numel() for t in tensors) <= _ONE_PASS_MAX:
        # Small state (where the per-tensor launches are the cost): one float32 sum over one
        # concatenation, a copy of at most _ONE_PASS_MAX elements.
        total = torch.cat([t.reshape(-1) for t in tensors]).sum(dtype=torch.float32)
    else:
        # One float32 sum per tensor (a NaN or an Inf anywhere makes it non-finite), folded in
        # float64 on the device: no copy of the state. Cheaper on CPU than a max-norm.
        total = torch.stack(
            [t.sum(dtype=torch.float32).to(device, torch.float64) for t in tensors]
        ).sum()
    # A finite state so large that a sum overflows float32 (|Σ| > 3.4e38) is corrupt in every
    # practical sense.
    return (~torch.isfinite(total)).to(device=device, dtype=torch.int64).reshape(1)


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
