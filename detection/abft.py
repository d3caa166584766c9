"""Algorithm-based fault tolerance (ABFT): checksums of the layers' own arithmetic, on by default.

For ``y = x Wᵀ + b`` (``nn.Linear``; ``x``: rows x K, ``W``: N x K) two identities hold exactly
in real arithmetic and cost one matrix-vector product each instead of a matrix product:

* forward row checksum: ``y.sum(-1) = x @ W.sum(0) + b.sum()``;
* weight-gradient checksum: with ``dy`` the gradient of the output, ``dW = dyᵀ x`` so
  ``dW.sum(0) = x.T @ dy.sum(-1)`` and ``db.sum() = dy.sum()``.

The layers a Linear checksum misses get their own (:mod:`detection.abft_layers`):
``nn.Embedding`` (forward ``y.sum(-1) = W.sum(1)[idx]``, gradient ``dW.sum(0) = dy.sum(0)``) and
the affine normalisations, ``nn.LayerNorm`` and ``nn.BatchNorm*`` (gradient ``dw = Σ dy ⊙ x̂``,
``db = Σ dy``, per channel, with ``x̂`` recomputed from the saved input). Together they cover
every parameter of the usual transformer and CNN/MLP parts, so a flip in any local gradient
element, or in a Linear or Embedding output, moves a checksum by that element.

In floating point they hold up to rounding, which scales with the magnitudes involved, so the
tolerance is magnitude-scaled: a Linear row's residual is divided by ``u · √K · m`` with
``m = ‖x_row‖₂ · ‖|W|.sum(0)‖₂ + |b|.sum()`` — by Cauchy-Schwarz an upper bound of
``|x| @ |W|.sum(0) + |b|.sum()``, the sum of the products' magnitudes, taken from one norm pass
instead of an ``|x|`` temporary — (``u`` the unit roundoff of the output's dtype: bf16 under
autocast) and compared with ``τ``; the gradient residual likewise by ``u · √M`` times
``‖x‖_F · √N · ‖(‖dy_row‖₂)‖₂`` (a bound of every ``|x|.T @ |dy|.sum(-1)``) over the ``M`` rows;
the other layers by the sum of their terms' magnitudes. ``τ`` is calibrated per layer on the
first clean steps: ``τ = max(margin · max clean ratio, τ_min)``. Clean ratios stay far below 1;
a flipped exponent bit of one element moves the residual by that element — a bit that goes
1 → 0 as well as 0 → 1, which is what no norm test can see.

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

from detection.abft_layers import TINY, Expectation, LayerCheck, make_checks

__all__ = ["LinearChecksums"]


class LinearChecksums:
    """The forward and gradient checksums of every checkable layer of ``module`` (``nn.Linear``,
    ``nn.Embedding``, ``nn.LayerNorm``, ``nn.BatchNorm*``).

    ``open()``/``close()`` bracket the window in which the rank's own step is checked (a replay
    for an audit partner, an evaluation pass, are not). ``ratios()`` returns, per layer,
    ``[forward ratio, gradient ratio]`` as float64 on the device.
    """

    def __init__(self, module: nn.Module, params: Sequence[torch.Tensor]) -> None:
        self.device = params[0].device
        self._open = False
        self.layers: list[LayerCheck] = make_checks(module, self)
        n = len(self.layers)
        self._ratio = torch.zeros(max(n, 1), 2, dtype=torch.float64, device=self.device)
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

    def open(self) -> None:
        self._ratio.zero_()
        for layer in self.layers:
            layer.begin()
        self._open = True

    def close(self) -> None:
        self._open = False

    def ratios(self) -> torch.Tensor:
        return self._ratio[: len(self.layers)].reshape(-1)

    def on_local_gradient(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """(parameter, local gradient) pairs of one bucket, before all-reduce."""
        if not self._open:
            return
        with torch.no_grad():
            for p, g in pairs:
                entry = self._by_param.get(id(p))
                if entry is None:
                    continue
                layer, is_weight = entry
                expected: Expectation | None = layer.expected(is_weight)
                if expected is None:
                    continue
                got = layer.reduce(g.detach().float(), is_weight)
                ratio = ((got - expected.value).abs() / (expected.scale() + TINY)).amax()
                self.note(layer.index, 1, ratio)

    def note(self, index: int, column: int, ratio: torch.Tensor) -> None:
        cell = self._ratio[index, column]
        # NaN (a non-finite output) counts as the largest ratio there is.
        value = torch.nan_to_num(ratio.to(torch.float64), nan=math.inf)
        cell.copy_(torch.maximum(cell, value))
