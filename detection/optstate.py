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

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from detection.nonfinite import nonfinite_flag
from detection.vote import optimizer_state_slots

__all__ = ["OptimizerStateCheck", "StateFlag", "state_nonfinite_flag"]

_ONE_PASS_MAX = 1 << 20  # state elements summed through one concatenation (4 MiB in float32)


class StateFlag:
    """The non-finite flag of one optimizer's state, taken every step.

    The floating-point state tensors, their flat views and (for a small state) the buffer
    they are concatenated into are kept between steps: walking the state and reshaping each
    tensor cost more than the sum itself on a small model. Before each use the cache is checked
    against the live optimizer — the same state mapping, the same per-parameter dicts with the
    same number of entries, each cached tensor still the one its dict holds, at the same
    address — and rebuilt when anything changed (the first step creating the state, a
    ``load_state_dict``, a new key), so the flag is always that of the state as it is.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], device: torch.device
    ) -> None:
        self.optimizer = optimizer
        self.params = list(params)
        self.device = device
        self._state: object = None
        self._entries = -1
        # every parameter's state dict and its size, then per floating-point state tensor:
        # its dict's ``get``, its key, the tensor and its address (columns, checked with map()
        # in _valid)
        self._dict_list: list[dict[Any, Any]] = []
        self._dict_sizes: list[int] = []
        self._getters: list[Callable[[Any], Any]] = []
        self._keys: list[Any] = []
        self._tensors: list[torch.Tensor] = []
        self._ptrs: list[int] = []
        self._flat: list[torch.Tensor] = []
        self._buffer: torch.Tensor | None = None

    def _valid(self) -> bool:
        # map() over the cached columns: the loop runs in C, a per-step cost on small models
        state = self.optimizer.state
        return (
            state is self._state
            and len(state) == self._entries
            and list(map(len, self._dict_list)) == self._dict_sizes
            and all(map(operator.is_, map(operator.call, self._getters, self._keys), self._tensors))
            and list(map(torch.Tensor.data_ptr, self._tensors)) == self._ptrs
        )

    def _rebuild(self) -> None:
        state = self.optimizer.state
        self._state, self._entries = state, len(state)
        slots = optimizer_state_slots(self.optimizer, self.params)
        # every parameter's state dict, also one holding only scalars yet (a new key shows)
        self._dict_list = [d for d in (state.get(p) for p in self.params) if d]
        self._dict_sizes = [len(d) for d in self._dict_list]
        floating = [(d, k, t) for d, k, t in slots if t.is_floating_point()]
        self._getters = [d.get for d, _, _ in floating]
        self._keys = [k for _, k, _ in floating]
        self._tensors = [t for _, _, t in floating]
        self._ptrs = [t.data_ptr() for t in self._tensors]
        self._flat = [t.detach().reshape(-1) for t in self._tensors]
        numel = sum(t.numel() for t in self._flat)
        dtypes = {t.dtype for t in self._flat}
        devices = {t.device for t in self._flat}
        self._buffer = None
        if self._flat and numel <= _ONE_PASS_MAX and len(dtypes) == 1 and len(devices) == 1:
            with torch.inference_mode(False):  # writable outside inference mode too
                self._buffer = torch.empty(numel, dtype=dtypes.pop(), device=devices.pop())

    def __call__(self) -> torch.Tensor:
        """``1`` (int64, on ``device``) if any floating-point state tensor holds a NaN or an
        Inf."""
        if not self._valid():
            self._rebuild()
        flat = self._flat
        if not flat:
            return torch.zeros(1, dtype=torch.int64, device=self.device)
        if self._buffer is not None:
            # Small state (where the per-tensor launches are the cost): one float32 sum over
            # one concatenation into the kept buffer, a copy of at most _ONE_PASS_MAX elements.
            source = flat[0] if len(flat) == 1 else torch.cat(flat, out=self._buffer)
            total = source.sum(dtype=torch.float32)
        else:
            # One float32 sum per tensor (a NaN or an Inf anywhere makes it non-finite), folded
            # in float64 on the device: no copy of the state. Cheaper on CPU than a max-norm.
            total = torch.stack(
                [t.sum(dtype=torch.float32).to(self.device, torch.float64) for t in flat]
            ).sum()
        # A finite state so large that a sum overflows float32 (|Σ| > 3.4e38) is corrupt in
        # every practical sense.
        return nonfinite_flag(total).to(self.device).reshape(1)


def state_nonfinite_flag(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], device: torch.device
) -> torch.Tensor:
    """``1`` (int64, on ``device``) if any floating-point state tensor holds a NaN or an Inf
    (one look; a guard keeps a :class:`StateFlag` per optimizer instead)."""
    return StateFlag(optimizer, params, device)()


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
