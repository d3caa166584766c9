"""A non-finite value in the optimizer state, checked after every update.

A finite gradient element of 3·10³⁵ (one bit-30 flip) squares to ``inf`` in Adam's
``exp_avg_sq``; from then on that parameter's updates are ``0/inf`` or ``NaN`` on every replica,
the same on all of them, so no fingerprint vote sees it. The check is a float32 sum of each
floating-point state tensor (NaN and Inf propagate; one read of the state) — of the small ones
in one pass over their concatenation, where each op, not the bytes, is the cost — folded to one
flag on the device; the guard all-gathers it with the step's row, so it costs no extra
synchronisation. A model's state has two or three tensors a parameter, most of them biases and
norms, so the ops are many: 2.7M parameters in 30 tensors gave 60 state tensors and took about
125 ops a step (a sum and a widening each); the small ones joined and the sums folded as they
are, about 25. On a GPU each op is a kernel launch, so there they are captured once as a CUDA
graph and replayed, one launch a step (:mod:`detection.weights.device_graph`).

On a CPU with :mod:`detection.native` the whole state is one call instead: a pass over each
tensor's bit patterns, an exact test of the exponent (no sum, so no overflow either).

Invariant: the flag is 1 when some state element is NaN or ±Inf (on the torch path, also when a
float32 sum of finite elements overflows).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from detection import native
from detection.row.words import nonfinite_flag
from detection.weights.device_graph import GraphedCall
from detection.weights.state import optimizer_state_slots

__all__ = ["OptimizerStateCheck", "StateFlag", "state_nonfinite_flag"]

_ONE_PASS_MAX = 1 << 20  # state elements summed through one concatenation (4 MiB in float32)
_JOIN_MAX = 1 << 16  # a state tensor larger than this is summed on its own: no copy of it


class StateFlag:
    """The non-finite flag of one optimizer's state, taken every step.

    The floating-point state tensors, their flat views and the buffer the small ones are
    concatenated into are kept between steps: walking the state and reshaping each
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
        self._joined: list[torch.Tensor] = []  # summed through one concatenation into _buffer
        self._alone: list[torch.Tensor] = []  # summed one by one
        self._buffer: torch.Tensor | None = None
        self._one_device = True
        self._native: native.PointerList | None = None  # the CPU kernel's list, when it runs
        # On a GPU the sums and the fold, captured once as a CUDA graph: one launch a step.
        self._graphed = GraphedCall(self._compute, what="optimizer-state flag")

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
        self._graphed.reset()  # a graph reads the old tensors and buffer
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
        # The small tensors of the first one's dtype and device join one concatenation, up to
        # _ONE_PASS_MAX elements; every other tensor is summed on its own.
        self._joined, self._alone, total = [], [], 0
        for t in self._flat:
            n = t.numel()
            fits = n <= _JOIN_MAX and total + n <= _ONE_PASS_MAX
            alike = not self._joined or (t.dtype, t.device) == (
                self._joined[0].dtype,
                self._joined[0].device,
            )
            if fits and alike:
                self._joined.append(t)
                total += n
            else:
                self._alone.append(t)
        self._buffer = None
        if len(self._joined) > 1:
            with torch.inference_mode(False):  # writable outside inference mode too
                first = self._joined[0]
                self._buffer = torch.empty(total, dtype=first.dtype, device=first.device)
        self._one_device = len({t.device for t in self._flat}) <= 1
        # On a CPU, one native call over every tensor: no concatenation, no per-tensor ops.
        self._native = None
        kinds = [native.nonfinite_kind(t) for t in self._flat]
        if (
            self._flat
            and all(t.device.type == "cpu" and t.is_contiguous() for t in self._flat)
            and all(k is not None for k in kinds)
            and native.available()
        ):
            self._native = native.PointerList(self._flat, [k for k in kinds if k is not None])

    def __call__(self) -> torch.Tensor:
        """``1`` (int64, on ``device``) if any floating-point state tensor holds a NaN or an
        Inf."""
        if not self._valid():
            self._rebuild()
        # a state spread over several devices is summed op by op: one graph runs on one device
        return self._graphed() if self._one_device else self._compute()

    def on_host(self) -> int:
        """:meth:`__call__` as a host int, for a CPU job's row (:mod:`detection.row.words`)."""
        if not self._valid():
            self._rebuild()
        if self._native is not None:
            return int(native.nonfinite(self._native))
        return int(self())

    def _compute(self) -> torch.Tensor:
        if not self._flat:
            return torch.zeros(1, dtype=torch.int64, device=self.device)
        if self._native is not None:
            bad = native.nonfinite(self._native)
            return torch.full((1,), int(bad), dtype=torch.int64, device=self.device)
        # Float32 sums (a NaN or an Inf anywhere makes its sum non-finite; cheaper on CPU than a
        # max-norm): one over the small tensors' concatenation into the kept buffer, one per
        # other tensor, without a copy of it. A finite state so large that a sum overflows
        # float32 (|Σ| > 3.4e38) is corrupt in every practical sense.
        joined = self._joined
        sums = []
        if joined:
            source = joined[0] if self._buffer is None else torch.cat(joined, out=self._buffer)
            sums.append(source.sum(dtype=torch.float32))
        sums.extend(t.sum(dtype=torch.float32) for t in self._alone)
        if len(sums) == 1:
            return nonfinite_flag(sums[0]).to(self.device).reshape(1)
        if not self._one_device:
            sums = [s.to(self.device) for s in sums]
        # flagged as they are (no widened total, which could overflow): any one non-finite sum
        return nonfinite_flag(torch.stack(sums)).amax().reshape(1).to(self.device)


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
