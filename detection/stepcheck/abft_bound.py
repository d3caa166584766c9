"""The checksums' tolerance from the arithmetic: a bound on the residual that rounding alone can
produce, so a checksum is armed from the first step with nothing learnt.

Every ratio of :mod:`detection.stepcheck.abft_layers` is ``|residual| / (u · √L · m)``: ``u``
the unit roundoff of the output's (or gradient's) dtype, ``L`` the length of the reduction the
identity sums (``K`` inputs for a Linear row, ``M`` rows for a gradient, ``d`` for an Embedding
row) and ``m`` an upper bound of ``Σ|terms|``, the sum of the magnitudes of the products
involved. Each note is divided by :func:`tolerance` of its shape and dtypes, so a ratio is
counted in units of its own rounding bound: a clean layer stays at or below 1, and anything
above was not rounding.

What the residual holds, relative to ``Σ|terms|`` (each worst case, for any summation order):

* the rounding of the layer's inputs to the compute type, twice (``x`` and ``W``, or ``x`` and
  ``dy``): ``u_c`` is the unit of bf16/fp16 under autocast, of TF32 (2⁻¹¹) for a float32 matmul
  on a GPU with ``torch.backends.cuda.matmul.allow_tf32`` or ``float32_matmul_precision``
  ``"high"``, of bf16 (2⁻⁸) for ``"medium"``, 0 otherwise; twice more for a GPU's reduced
  precision split-K reduction of a bf16/fp16 GEMM (its default): ``4 · u_c``;
* the rounding of the layer's outputs to their dtype: ``u`` (``Σ|y| ≤ Σ|terms|``);
* the recomputation of a normalisation's ``x̂`` (``|Δx̂| ≤ 4 u₃₂`` relative; the norm ratios'
  magnitude carries ``Σ|dy|`` for it): ``4 · u₃₂``;
* the accumulations: the layer's own over ``L``, ``gamma_a(L)`` — in float32 for a GEMM (a
  Linear's products and weight gradient: CPUs and GPUs accumulate bf16/fp16 products in float32,
  ``u_a = u₃₂``), in the gradient's own dtype for the other kernels' reductions (a
  normalisation's or an embedding's backward, which on a CPU sums bf16 in bf16: ``u_a = u``) —
  the checksum's own over ``L``, ``gamma(L)``, and its two sums across the other dimension ``W``
  (``N`` outputs of a Linear), ``gamma(W)`` each, with ``gamma(n) = n·u₃₂ / (1 - n·u₃₂)`` and
  ``gamma_a`` the same in ``u_a``.

So ``|residual| ≤ B_w · Σ|terms|`` with
``B_w = 4u_c + u + 4u₃₂ + gamma_a(L) + gamma(L) + 2gamma(W)``. That grows as ``L`` and ``W`` do;
the probabilistic analysis of rounding (Higham and Mary, 2019: independent, mean-zero errors)
replaces ``gamma(n)`` by ``λ·√n·u₃₂``, which holds except with probability below
``2n·exp(-λ²/2)`` — with ``λ = 10`` below 10⁻¹⁵ for ``n`` up to 10⁶:
``B_p = 4u_c + u + 4u₃₂ + λ·√L·u_a + λ·(√L + 2√W)·u₃₂``. The tolerance is
``min(B_w, B_p) / (u · √L)`` in the ratio's units.

Per dtype (``u``): float32 2⁻²⁴, bfloat16 2⁻⁸, float16 2⁻¹¹, float64 2⁻⁵³ (its checksums are
float32, so its tolerance is ``u₃₂/u₆₄`` larger), TF32 inputs 2⁻¹¹. For example a float32
Linear of ``K = N = 32``: ``B_w = (5 + 128)·u₃₂``, a tolerance of 23.5; the same under bf16
autocast: ``5·2⁻⁸ + 132·u₃₂``, a tolerance of 0.88; a LayerNorm's gradient over ``M = 96`` rows
in bf16 (summed in bf16): ``B_p ≈ (5 + 10·√96)·2⁻⁸``, a tolerance of 10.5.

What it costs: a flip of an output or gradient element ``e`` moves the residual by ``e`` (raising:
by ``e · (2^(2^(bit-23)) - 1)``), seen when that exceeds ``min(B_w, B_p) · Σ|terms|``: for a
raising bit 27+ flip (a factor 2¹⁶ or more) every element above ``2⁻¹⁶`` of that bound, for a
flip that shrinks an element the element itself — in float32 one above ~10⁻⁵ of ``Σ|terms|``.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["LAMBDA", "U32", "compute_unit", "tolerance"]

U32 = 2.0**-24
#: The probabilistic bound's confidence: a clean sum exceeds it with probability < 2n·e^(-λ²/2).
LAMBDA = 10.0
_TF32 = 2.0**-11
_BF16 = 2.0**-8


def _unit(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) / 2.0


def compute_unit(device_type: str, dtype: torch.dtype) -> float:
    """``u_c``: the unit of the rounding a layer's inputs suffer before its products, for a
    layer called now (a forward hook) on ``device_type`` with inputs of ``dtype``."""
    if torch.is_autocast_enabled(device_type):
        return _unit(torch.get_autocast_dtype(device_type))
    if device_type == "cuda" and dtype == torch.float32:
        precision = torch.get_float32_matmul_precision()
        if precision == "medium":
            return _BF16
        if precision == "high" or torch.backends.cuda.matmul.allow_tf32:
            return _TF32
        return 0.0
    if device_type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return _unit(dtype)  # a model in bf16/fp16: a GEMM's split-K may reduce in its dtype
    return 0.0


def _gamma(n: int, unit: float = U32) -> float:
    nu = n * unit
    return nu / (1.0 - nu) if nu < 0.5 else math.inf


@functools.lru_cache(maxsize=4096)
def tolerance(length: int, width: int, u: float, u_c: float, u_a: float = U32) -> float:
    """The rounding bound of a ratio ``|residual| / (u · √length · m)`` (module docstring):
    ``length`` the reduction the ratio is scaled by, ``width`` the checksum's sums across the
    other dimension, ``u`` the output's unit, ``u_c`` the inputs' (:func:`compute_unit`),
    ``u_a`` the unit the layer's own kernel accumulates in (float32 for a GEMM)."""
    length, width = max(length, 1), max(width, 1)
    u_a = max(u_a, U32)
    head = 4.0 * u_c + u + 4.0 * U32
    worst = head + _gamma(length, u_a) + _gamma(length) + 2.0 * _gamma(width)
    root = math.sqrt(length)
    likely = head + LAMBDA * (root * u_a + (root + 2.0 * math.sqrt(width)) * U32)
    return min(worst, likely) / (u * root)
