"""Algorithm-based fault tolerance (ABFT) checksums on ``nn.Linear``, opt-in.

For ``y = x Wᵀ + b`` (``x``: rows x K, ``W``: N x K) two identities hold exactly in real
arithmetic and cost one matrix-vector product each instead of a matrix product:

* forward row checksum: ``y.sum(-1) = x @ W.sum(0) + b.sum()``;
* weight-gradient checksum: with ``dy`` the gradient of the output, ``dW = dyᵀ x`` so
  ``dW.sum(0) = x.T @ dy.sum(-1)`` and ``db.sum() = dy.sum()``.

In floating point they hold up to rounding, which scales with the magnitudes involved, so the
tolerance is magnitude-scaled: a row's residual is divided by ``u · √K · m`` with
``m = ‖x_row‖₂ · ‖|W|.sum(0)‖₂ + |b|.sum()`` — by Cauchy-Schwarz an upper bound of
``|x| @ |W|.sum(0) + |b|.sum()``, the sum of the products' magnitudes, taken from one norm pass
instead of an ``|x|`` temporary — (``u`` the unit roundoff of the output's dtype: bf16 under
autocast) and compared with ``τ``; the gradient residual likewise by ``u · √M`` times
``‖x‖_F · √N · ‖(‖dy_row‖₂)‖₂`` (a bound of every ``|x|.T @ |dy|.sum(-1)``) over the ``M`` rows.
``τ`` is calibrated per layer on the first clean steps: ``τ = max(margin · max clean ratio,
τ_min)``. Clean ratios stay far below 1; a flipped exponent bit of one output element moves the
residual by that element.

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
from typing import Any

import torch
from torch import nn

__all__ = ["LinearChecksums"]

_TINY = 1e-30


def _u(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) / 2.0 if dtype.is_floating_point else 2.0**-24


class _Layer:
    def __init__(self, index: int, name: str, module: nn.Linear, shared: bool) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.shared = shared
        self.col: torch.Tensor | None = None  # W.sum(0), |W|.sum(0), per step
        self.col_abs: torch.Tensor | None = None
        self.exp_w: torch.Tensor | None = None
        self.mag_w: torch.Tensor | None = None
        self.exp_b: torch.Tensor | None = None
        self.mag_b: torch.Tensor | None = None
        self.rows = 0
        self.grad_u = 2.0**-24


class LinearChecksums:
    """The forward and weight-gradient checksums of every ``nn.Linear`` of ``module``.

    ``open()``/``close()`` bracket the window in which the rank's own step is checked (a replay
    for an audit partner, an evaluation pass, are not). ``ratios()`` returns, per layer,
    ``[forward ratio, gradient ratio]`` as float64 on the device.
    """

    def __init__(self, module: nn.Module, params: Sequence[torch.Tensor]) -> None:
        counts: dict[int, int] = {}
        for _, p in module.named_parameters(remove_duplicate=False):
            counts[id(p)] = counts.get(id(p), 0) + 1
        linears = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)]
        self.layers = [
            _Layer(i, name, m, counts.get(id(m.weight), 0) > 1)
            for i, (name, m) in enumerate(linears)
        ]
        self.device = params[0].device
        self._by_param: dict[int, tuple[_Layer, bool]] = {}
        for layer in self.layers:
            if not layer.shared:
                self._by_param[id(layer.module.weight)] = (layer, True)
                if layer.module.bias is not None:
                    self._by_param[id(layer.module.bias)] = (layer, False)
        n = len(self.layers)
        self._ratio = torch.zeros(max(n, 1), 2, dtype=torch.float64, device=self.device)
        self._open = False
        self._handles = [
            layer.module.register_forward_hook(self._forward_hook(layer)) for layer in self.layers
        ]

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def close_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def open(self) -> None:
        self._ratio.zero_()
        for layer in self.layers:
            layer.col = layer.col_abs = None
            layer.exp_w = layer.mag_w = layer.exp_b = layer.mag_b = None
            layer.rows = 0
        self._open = True

    def close(self) -> None:
        self._open = False

    def ratios(self) -> torch.Tensor:
        return self._ratio[: len(self.layers)].reshape(-1)

    # -- forward ------------------------------------------------------------------------------
    def _forward_hook(self, layer: _Layer) -> Any:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if not self._open or not isinstance(output, torch.Tensor):
                return
            x = inputs[0]
            self._check_forward(layer, x, output)
            if output.requires_grad:
                x2 = x.detach().reshape(-1, x.shape[-1])
                output.register_hook(self._grad_hook(layer, x2))

        return hook

    def _columns(self, layer: _Layer) -> tuple[torch.Tensor, torch.Tensor]:
        if layer.col is None or layer.col_abs is None:
            w = layer.module.weight.detach().float()
            layer.col, layer.col_abs = w.sum(0), w.abs().sum(0)
        return layer.col, layer.col_abs

    def _check_forward(self, layer: _Layer, x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.no_grad():
            k = x.shape[-1]
            x2 = x.detach().reshape(-1, k).float()
            y2 = y.detach().reshape(-1, y.shape[-1]).float()
            col, col_abs = self._columns(layer)
            bias = layer.module.bias
            b_sum = bias.detach().float().sum() if bias is not None else 0.0
            b_abs = bias.detach().float().abs().sum() if bias is not None else 0.0
            residual = (y2.sum(-1) - (x2 @ col + b_sum)).abs()
            magnitude = torch.linalg.vector_norm(x2, dim=-1) * torch.linalg.vector_norm(col_abs)
            scale = (magnitude + b_abs) * (_u(y.dtype) * math.sqrt(k)) + _TINY
            self._note(layer, 0, (residual / scale).amax())

    # -- backward -----------------------------------------------------------------------------
    def _grad_hook(self, layer: _Layer, x2: torch.Tensor) -> Any:
        def hook(dy: torch.Tensor) -> None:
            if not self._open or layer.shared:
                return
            with torch.no_grad():
                d2 = dy.detach().reshape(-1, dy.shape[-1]).float()
                xf = x2.float()
                r = d2.sum(-1)
                ra = torch.linalg.vector_norm(d2, dim=-1) * math.sqrt(d2.shape[-1])  # ≥ |dy_row|₁
                exp_w = xf.T @ r
                # ‖x‖_F bounds every column norm; a per-column norm is a strided reduction, 50x
                # slower on CPU than the whole-tensor norm.
                mag_w = torch.linalg.vector_norm(xf) * torch.linalg.vector_norm(ra)
                layer.exp_w = exp_w if layer.exp_w is None else layer.exp_w + exp_w
                layer.mag_w = mag_w if layer.mag_w is None else layer.mag_w + mag_w
                exp_b, mag_b = r.sum(), ra.sum()
                layer.exp_b = exp_b if layer.exp_b is None else layer.exp_b + exp_b
                layer.mag_b = mag_b if layer.mag_b is None else layer.mag_b + mag_b
                layer.rows += d2.shape[0]
                layer.grad_u = max(layer.grad_u, _u(dy.dtype))

        return hook

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
                if layer.exp_w is None or layer.mag_w is None or not layer.rows:
                    continue
                unit = layer.grad_u * math.sqrt(layer.rows)
                if is_weight:
                    got = g.detach().float().sum(0)
                    ratio = ((got - layer.exp_w).abs() / (layer.mag_w * unit + _TINY)).amax()
                else:
                    assert layer.exp_b is not None
                    assert layer.mag_b is not None
                    got_b = g.detach().float().sum()
                    ratio = (got_b - layer.exp_b).abs() / (layer.mag_b * unit + _TINY)
                self._note(layer, 1, ratio)

    def _note(self, layer: _Layer, column: int, ratio: torch.Tensor) -> None:
        cell = self._ratio[layer.index, column]
        # NaN (a non-finite output) counts as the largest ratio there is.
        value = torch.nan_to_num(ratio.to(torch.float64), nan=math.inf)
        cell.copy_(torch.maximum(cell, value))
