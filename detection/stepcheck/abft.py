"""Algorithm-based fault tolerance (ABFT): checksums of the layers' own arithmetic, on by default.

For ``y = x Wᵀ + b`` (``nn.Linear``; ``x``: rows x K, ``W``: N x K) two identities hold exactly
in real arithmetic and cost one matrix-vector product each instead of a matrix product:

* forward row checksum: ``y.sum(-1) = x @ W.sum(0) + b.sum()``;
* weight-gradient checksum: with ``dy`` the gradient of the output, ``dW = dyᵀ x`` so
  ``dW.sum(0) = x.T @ dy.sum(-1)`` and ``db.sum() = dy.sum()``.

The layers a Linear checksum misses get their own (:mod:`detection.stepcheck.abft_layers`):
``nn.Embedding`` (forward ``y.sum(-1) = W.sum(1)[idx]``, gradient ``dW.sum(0) = dy.sum(0)``) and
the affine normalisations, ``nn.LayerNorm`` and ``nn.BatchNorm*`` (gradient ``dw = Σ dy ⊙ x̂``,
``db = Σ dy``, per channel, with ``x̂`` recomputed from the saved input). Together they cover
every parameter of the usual transformer and CNN/MLP parts, so a flip in any local gradient
element, or in a Linear or Embedding output, moves a checksum by that element.

In floating point they hold up to rounding, which scales with the magnitudes involved, so the
tolerance is magnitude-scaled: a Linear row's residual is divided by ``u · √K · m`` with
``m = ‖x_row‖₂ · √N · ‖W‖_F + |b|.sum()`` — by Cauchy-Schwarz, per column
(``Σ_n |W_nk| ≤ √N · ‖W_:k‖₂``) and then over the row, an upper bound of
``|x| @ |W|.sum(0) + |b|.sum()``, the sum of the products' magnitudes, taken from norm passes
instead of ``|x|`` and ``|W|`` temporaries (a quarter looser for a dense ``W``) — (``u`` the
unit roundoff of the output's dtype: bf16 under autocast) and compared with ``τ``; the gradient
residual likewise by ``u · √M`` times ``‖x‖_F · √N · ‖dy‖_F`` (a bound of every
``|x|.T @ |dy|.sum(-1)``, from one whole-tensor norm of ``dy``) over the ``M`` rows, the bias
residual by ``u · √M · √(N·M) · ‖dy‖_F ≥ u · √M · ‖dy‖₁``; the other layers by the sum of their
terms' magnitudes. The expectations themselves are computed in float32 even inside the loop's
autocast. ``τ`` is calibrated per layer on the first clean steps:
``τ = max(margin · max clean ratio, τ_min)``. Clean ratios stay far below 1; a flipped exponent
bit of one element moves the residual by that element — a bit that goes 1 → 0 as well as
0 → 1, which is what no norm test can see.

The checks read the actual output (after every forward hook that ran before, as corrupt
hardware would have produced it) and the actual local gradient in the comm hook, before
all-reduce. Weights shared with another module (tied embeddings) get no gradient check: their
gradient holds other terms. The gradient check assumes the gradient was zeroed before the
step's first backward (``zero_grad``), as DDP training does.

Results stay on the device: one max ratio per layer and direction, all-gathered with the
statistics row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from detection.stepcheck.abft_layers import (
    TINY,
    Expectation,
    LayerCheck,
    LinearCheck,
    WeightPass,
    make_checks,
    scheduled,
)

__all__ = ["LinearChecksums"]

_KEPT_LAYOUTS = 64  # distinct note and bucket layouts kept on the device


class LinearChecksums:
    """The forward and gradient checksums of every checkable layer of ``module`` (``nn.Linear``,
    ``nn.Embedding``, ``nn.LayerNorm``, ``nn.BatchNorm*``).

    ``open()``/``close()`` bracket the window in which the rank's own step is checked (a replay
    for an audit partner, an evaluation pass, are not). ``ratios()`` returns, per layer,
    ``[forward ratio, gradient ratio]`` as float64 on the device.
    """

    def __init__(
        self, module: nn.Module, params: Sequence[torch.Tensor], *, every: int = 1
    ) -> None:
        self.device = params[0].device
        self._open = False
        # The checksum budget: layer i is checked on the steps with i % every == step % every
        # (abft_layers.scheduled); 1: every layer on every step.
        self.every = max(int(every), 1)
        self.layers: list[LayerCheck] = make_checks(module, self)
        n = len(self.layers)
        self._ratio = torch.zeros(max(n, 1), 2, dtype=torch.float64, device=self.device)
        # Ratios noted this step, folded into ``_ratio`` in one scatter when read: a note is a
        # list append, not four launches. The cells (``index * 2 + column``) are kept as a
        # device tensor per distinct sequence: after the first step nothing is copied to the
        # device (a host-to-device copy of a new tensor would synchronise on CUDA).
        self._notes: list[torch.Tensor] = []
        self._cells: list[int] = []
        self._cell_index: dict[tuple[int, ...], torch.Tensor] = {}
        self._by_param: dict[int, tuple[LayerCheck, bool]] = {}
        for layer in self.layers:
            for param, is_weight in layer.checked_parameters():
                self._by_param[id(param)] = (layer, is_weight)
        self._handles = [layer.install() for layer in self.layers]

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    @property
    def is_open(self) -> bool:
        return self._open

    def close_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def open(self, step: int = 0) -> None:
        """Begin checking ``step``: the layers its place in the rotation names (all of them
        with ``every=1``); the others report a ratio of 0 this step."""
        self._ratio.zero_()
        self._notes.clear()
        self._cells.clear()
        linear: list[LinearCheck] = []
        for layer in self.layers:
            layer.begin()
            layer.active = scheduled(layer.index, step, self.every)
            if layer.active and isinstance(layer, LinearCheck):
                linear.append(layer)
        # the weight-side terms of this step's Linears, taken together at the first forward
        weights = WeightPass(linear)
        for layer in linear:
            layer.weight_pass = weights
        self._open = True

    def checked(self) -> list[str]:
        """The layers checked on the step now open (all of them with ``every=1``)."""
        return [layer.name for layer in self.layers if layer.active]

    def close(self) -> None:
        self._open = False

    def ratios(self) -> torch.Tensor:
        """Per layer ``[forward ratio, gradient ratio]``: the largest noted this step (float64,
        on the device; NaN — a non-finite output or gradient — counts as ``inf``)."""
        if self._notes:
            cells = tuple(self._cells)
            index = self._cell_index.get(cells)
            if index is None:
                index = self._keep(cells)
            values = torch.cat(self._notes).to(torch.float64).nan_to_num_(nan=math.inf)
            self._ratio.view(-1).scatter_reduce_(0, index, values, reduce="amax")
            self._notes.clear()
            self._cells.clear()
        return self._ratio[: len(self.layers)].reshape(-1)

    def on_local_gradient(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """(parameter, local gradient) pairs of one bucket, before all-reduce. Every checked
        parameter's reduction is compared with its expectation in one pass over the bucket's
        concatenation: ``max |got - expected| / tolerance`` per parameter (the tolerance one
        number or one per element), a segment maximum instead of a handful of launches each."""
        if not self._open:
            return
        got: list[torch.Tensor] = []
        want: list[torch.Tensor] = []
        magnitudes: list[torch.Tensor] = []
        factors: list[float] = []
        lengths: list[int] = []
        layers: list[int] = []
        with torch.no_grad():
            for p, g in pairs:
                entry = self._by_param.get(id(p))
                if entry is None:
                    continue
                layer, is_weight = entry
                expected: Expectation | None = layer.expected(is_weight)
                if expected is None:
                    continue
                value = layer.reduce(g.detach().float(), is_weight).reshape(-1)
                if value.numel() == 0:
                    continue
                magnitude = expected.magnitude.reshape(-1)
                got.append(value)
                want.append(expected.value.reshape(-1))
                magnitudes.append(
                    magnitude.expand(value.numel()) if magnitude.numel() == 1 else magnitude
                )
                factors.append(expected.factor())
                lengths.append(value.numel())
                layers.append(layer.index)
            if not got:
                return
            # the tolerance scale: magnitude times factor, one multiplication for the bucket when
            # the factors agree (the same rows and dtype in every layer: the usual case)
            if len(set(factors)) > 1:
                magnitudes = [m * f for m, f in zip(magnitudes, factors, strict=True)]
                factors = [1.0]
            if len(got) == 1:
                scale = torch.add(TINY, magnitudes[0], alpha=factors[0])
                ratio = (got[0] - want[0]).abs_().div_(scale)
                self._notes.append(ratio.amax().reshape(1))
            else:
                scale = torch.cat(magnitudes).mul_(factors[0]).add_(TINY)
                ratio = (torch.cat(got) - torch.cat(want)).abs_().div_(scale)
                lengths_kept = self._lengths(lengths)
                # unsafe: the lengths are ours and sum to the data's length by construction;
                # the default validates them on the host (``min().item()``, then ``all()``),
                # two device synchronisations a bucket on CUDA
                segments = torch.segment_reduce(ratio, "max", lengths=lengths_kept, unsafe=True)
                self._notes.append(segments)
            self._cells.extend(index * 2 + 1 for index in layers)

    def _lengths(self, lengths: list[int]) -> torch.Tensor:
        """The segment lengths of one bucket's comparison, kept on the device per layout."""
        key = (-1, *lengths)  # negative first: apart from the note cells' keys
        kept = self._cell_index.get(key)
        return kept[1:] if kept is not None else self._keep(key)[1:]

    def _keep(self, key: tuple[int, ...]) -> torch.Tensor:
        if len(self._cell_index) >= _KEPT_LAYOUTS:  # a loop whose calls vary without end
            self._cell_index.clear()
        kept = torch.tensor(key, dtype=torch.int64).to(self.device)
        self._cell_index[key] = kept
        return kept

    def note(self, index: int, column: int, ratio: torch.Tensor) -> None:
        """Layer ``index``'s ratio for ``column`` (0: forward, 1: gradient), a 0-dim tensor."""
        self._notes.append(ratio.reshape(1))
        self._cells.append(index * 2 + column)
