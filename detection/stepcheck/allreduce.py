"""An algebraic check of the all-reduce: the sum of the reduced bucket must be the average of the
ranks' local sums, within a rounding bound derived here — a corrupted reduction is caught before
``optimizer.step`` uses it.

Notation, per bucket of ``n`` elements: ``g[s, i]`` rank ``s``'s local gradient, ``a[i]`` the
reduced (averaged) bucket a rank received, ``W`` the world size, ``u`` the unit roundoff of the
bucket's dtype (2⁻²⁴ for float32), ``v = 2⁻⁵³`` that of float64, ``gamma(k) = k·u / (1 - k·u)``.
The comm hook takes ``S[s] = Σ_i g[s, i]`` and ``N[s] = ‖g[s]‖₂`` before all-reduce and
``P[r] = Σ_i a[i]`` after, with :func:`chunked_sum`: float32 sums of consecutive chunks of
``C = 64`` elements (any order inside a chunk: error at most ``gamma(C - 1)`` times the chunk's
absolute sum), added up in float64 (exact conversions). A plain float64 accumulation would be
tighter but costs 20x a float32 pass on CPU over a large bucket; a float32 sum of the whole
bucket has no bound worth having (``gamma(n)``). A bucket of at most ``WIDE_MAX`` elements, and
every bucket on a GPU, is summed in float64 outright: there the cost is the number of ops (kernel
launches on a GPU), not the pass (one instead of six), and its error, at most
``gamma_v(n - 1)`` times the absolute sum in any order, is below the chunked one's
``gamma(C - 1) + gamma_v(n/C + 1)``, so the bound ``B`` below holds for it unchanged.
``N[s]`` is float32 ``vector_norm``, whatever its order within
``(1 - u)^-1 (1 - gamma(n))^-1/2`` of the truth (used as an inflation factor ``rho``).

DDP's all-reduce divides each element by ``W`` (one rounding, none when ``W`` is a power of two)
and then sums ``W`` values in float32 in some order, so for every element

    |a[i] - Σ_s g[s, i] / W|  ≤  (u + gamma(W - 1)·(1 + u)) · Σ_s |g[s, i]| / W.

Summing over ``i`` and writing ``A = Σ_s ‖g[s]‖₁ ≤ √n · Σ_s N[s]`` (Cauchy-Schwarz, so the
bound needs no extra pass over the bucket), and adding the accumulation errors of ``P`` and of
every ``S[s]`` (``gamma(C - 1)`` for the float32 chunks and ``gamma_v(n/C + 1)`` for their
float64 total, times their absolute sums), of the host sum over ranks (``gamma_v(W)``) and of the
product by ``W`` (``v``):

    |W · P[r] - Σ_s S[s]|  ≤  B = (u + gamma(W - 1)(1 + u)
                                   + (gamma(C - 1) + gamma_v(n/C + 1))(2 + W·u)
                                   + gamma_v(W) + v(1 + W·u)) · rho · √n · Σ_s N[s] · (1 + 10⁻⁶)

(the last factor covers the float64 rounding of the norms and of ``B`` itself). This holds for
any summation order, so for any ring or tree algorithm. A difference larger than ``B`` cannot be
rounding: a value was corrupted between the local buckets and the reduced one. If it shows on
some ranks only, those ranks' reduced buckets are wrong (named); if on every rank alike, the
reduction itself went wrong and no single rank can be named from sums.

What it costs in sensitivity: a corruption of size ``δ`` in one reduced element is caught when
``W·|δ| > B``, i.e. roughly ``|δ| > 2·gamma(63)·√n·N``: for ``n = 10⁶`` a change above ~1 % of
the bucket's norm, about 8 typical elements — a flip of exponent bit 26 or higher that raises one.

Before the bound, an exact test: every replica receives the same reduced bucket, bit for bit
(DDP's equal weights rest on it), so reduced sums that differ at all between ranks name the
minority (with 3+ ranks and a strict majority; two ranks can only say that they differ). This
catches a flip in one rank's reduced bucket at any bit, not only above the bound.

The check assumes DDP's own averaging all-reduce; the guard runs it only when no user comm hook
replaces that (a compression hook rounds to fp16 and changes the bound).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from detection import native

__all__ = [
    "ARRAY_MIN",
    "CHUNK",
    "WIDE_MAX",
    "ReductionFinding",
    "bucket_norm",
    "check_reduction",
    "chunked_sum",
    "native_chunk",
    "reduction_bound",
    "unit_roundoff",
]


CHUNK = 64
#: Buckets of at most this many elements are summed in float64 in one op (see the module).
WIDE_MAX = 1 << 15


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def native_chunk(numel: int) -> int:
    """The chunk :mod:`detection.native` sums a bucket of ``numel`` elements by, as
    :func:`chunked_sum` does: ``0`` (float64 outright) up to :data:`WIDE_MAX`, else
    :data:`CHUNK`."""
    return 0 if numel <= WIDE_MAX else CHUNK


def chunked_sum(flat: torch.Tensor) -> torch.Tensor:
    """Σ of a 1-D tensor as a float64 scalar on its device: float32 chunks of :data:`CHUNK`
    elements added in float64 (the error model of :func:`reduction_bound`); a bucket of at most
    :data:`WIDE_MAX` elements, and any bucket on a GPU, in float64 outright, which that model
    covers too (its error is below the chunked one's). On a GPU the pass is memory-bound
    whatever the accumulator, and one op is one kernel launch where the chunks take six. A
    contiguous float32 bucket on a CPU with :mod:`detection.native` takes its one-pass kernel,
    which sums the same chunks (in a fixed lane order; any order is within the bound)."""
    if native.stats_kind_ok(flat) and native.available():
        return native.sum_f32(flat, native_chunk(flat.numel()))
    if flat.numel() <= WIDE_MAX or flat.device.type != "cpu":
        return flat.sum(dtype=torch.float64)
    acc = _accumulation(flat.dtype)
    head = flat.numel() - flat.numel() % CHUNK
    total = flat[head:].sum(dtype=acc).to(torch.float64)
    if head:
        total = total + flat[:head].view(-1, CHUNK).sum(1, dtype=acc).to(torch.float64).sum()
    return total


def bucket_norm(flat: torch.Tensor) -> torch.Tensor:
    """‖flat‖₂ in the accumulation dtype, as float64 (inflated in :func:`reduction_bound`)."""
    return torch.linalg.vector_norm(flat, 2, dtype=_accumulation(flat.dtype)).to(torch.float64)


@functools.cache
def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1.0 to the next representable value (round to nearest)."""
    return float(torch.finfo(dtype).eps) / 2.0


def _gamma(k: float, u: float) -> float:
    return k * u / (1.0 - k * u)


def reduction_bound(world: int, numel: int, norms: Sequence[float], u: float) -> float:
    """``B`` of the module docstring for one bucket."""
    scale = _bound_scale(world, numel, u)
    if scale == math.inf:
        return math.inf  # the float32 norm is no bound any more: the check passes this bucket
    return scale * math.fsum(norms) * (1.0 + 1e-6)


@functools.lru_cache(maxsize=64)
def _bound_scale(world: int, numel: int, u: float) -> float:
    """``B`` over ``Σ‖g‖`` for a bucket of ``numel`` elements (a step's buckets keep their
    sizes: computed once per size), or ``inf`` where no bound holds. The product is taken in
    :func:`reduction_bound`'s order, so the bound is the same bits as computed in one line."""
    v = 2.0**-53
    acc = min(u, 2.0**-24)  # float32 accumulation, float64 for float64 buckets
    if numel * acc >= 0.5:
        return math.inf
    coefficient = (
        u
        + _gamma(world - 1, u) * (1.0 + u)
        + (_gamma(CHUNK - 1, acc) + _gamma(numel // CHUNK + 1, v)) * (2.0 + world * u)
        + _gamma(world, v)
        + v * (1.0 + world * u)
    )
    inflation = 1.0 / ((1.0 - acc) * math.sqrt(1.0 - _gamma(numel, acc)))
    return coefficient * inflation * math.sqrt(numel)


@dataclass(frozen=True)
class ReductionFinding:
    """Ranks whose reduced bucket sum broke the bound (empty: all of them, the reduction)."""

    suspects: tuple[int, ...]
    bucket: int
    expected: float | None
    got: dict[int, float]
    bound: float
    exact: bool = False

    def to_detail(self) -> dict[str, Any]:
        return {
            "check": "reduced sums differ between replicas"
            if self.exact
            else "sum of the reduced bucket vs the ranks' local sums",
            "bucket": self.bucket,
            "expected_sum": self.expected,
            "world_times_reduced_sum": {str(r): v for r, v in self.got.items()},
            "statistic": None
            if self.expected is None
            else max(abs(v - self.expected) for v in self.got.values()),
            "threshold": self.bound,
            "mismatched_ranks": sorted(self.got),
        }


#: Tables of more than this many values (ranks by buckets) are screened with array ops first.
ARRAY_MIN = 256

_Table = Sequence[Sequence[float]] | npt.NDArray[np.float64]


def check_reduction(
    local_sums: _Table,
    local_norms: _Table,
    reduced_sums: _Table,
    numel: Sequence[int],
    u: float,
) -> ReductionFinding | None:
    """The worst bucket whose reduced sum breaks the bound on some rank, or ``None``.

    Arguments are indexed ``[rank][bucket]`` (lists or arrays). Buckets with a non-finite value
    anywhere are the non-finite check's business and skipped here. A large table (hundreds of
    buckets on many ranks) is first screened with array ops (:func:`_screen`), which keeps
    every bucket the per-bucket definitions below could flag; only those are looked at one by
    one, so the finding is the same either way.
    """
    world, n_buckets = len(local_sums), len(numel)
    differing: Sequence[int] = range(n_buckets)
    near: Sequence[int] = differing
    if world * n_buckets > ARRAY_MIN or isinstance(local_sums, np.ndarray):
        sums, norms, reduced = (
            np.asarray(t, dtype=np.float64) for t in (local_sums, local_norms, reduced_sums)
        )
        local_sums, local_norms, reduced_sums = sums, norms, reduced
        differing, near = _screen(sums, norms, reduced, numel, u)
    for b in differing:
        exact = _differing_replicas(_column(reduced_sums, b), b)
        if exact is not None:
            return exact
    worst: tuple[float, ReductionFinding] | None = None
    for b in near:
        scored = _bound_finding(
            _column(local_sums, b),
            _column(local_norms, b),
            _column(reduced_sums, b),
            numel[b],
            u,
            b,
        )
        if scored is not None and (worst is None or scored[0] > worst[0]):
            worst = scored
    return worst[1] if worst is not None else None


def _column(table: _Table, b: int) -> list[float]:
    if isinstance(table, np.ndarray):
        column: list[float] = table[:, b].tolist()
        return column
    return [row[b] for row in table]


def _bound_finding(
    column: list[float], norms: list[float], reduced: list[float], n: int, u: float, b: int
) -> tuple[float, ReductionFinding] | None:
    """Bucket ``b`` against the bound ``B``: the ranks it breaks on, scored by the excess."""
    if not all(math.isfinite(x) for x in (*column, *norms, *reduced)):
        return None
    world = len(column)
    expected = math.fsum(column)
    bound = reduction_bound(world, n, norms, u)
    bad = {r: world * p for r, p in enumerate(reduced) if abs(world * p - expected) > bound}
    if not bad:
        return None
    excess = max(abs(v - expected) for v in bad.values()) / max(bound, 1e-300)
    suspects = tuple(sorted(bad)) if len(bad) < world else ()
    return excess, ReductionFinding(suspects, b, expected, bad, bound)


def _differing_replicas(values: list[float], b: int) -> ReductionFinding | None:
    """Bucket ``b``'s reduced sums, one per replica, if they are not all the same."""
    world = len(values)
    if len({v for v in values if not math.isnan(v)}) <= 1:
        return None
    counts = Counter(values)
    top, count = counts.most_common(1)[0]
    majority = world >= 3 and 2 * count > world
    suspects = tuple(r for r, v in enumerate(values) if v != top) if majority else ()
    return ReductionFinding(
        suspects,
        b,
        world * top if majority else None,
        {r: world * v for r, v in enumerate(values) if not majority or v != top},
        0.0,
        exact=True,
    )


def _screen(
    sums: npt.NDArray[np.float64],
    norms: npt.NDArray[np.float64],
    reduced: npt.NDArray[np.float64],
    numel: Sequence[int],
    u: float,
) -> tuple[list[int], list[int]]:
    """The buckets :func:`check_reduction` must look at one by one: those whose reduced sums
    differ between replicas, and the finite ones whose residual comes near the bound.

    Why no bucket the definitions would flag is left out:

    * *Differing*: ``fmin``/``fmax`` over the ranks skip NaN as the set in
      :func:`_differing_replicas` does, and ``-0.0 == 0.0`` there as in a set.
    * *Near*: the definition flags ``|W·P - E| > B`` with ``E`` the exact ``fsum``. Here ``E'``
      is numpy's float64 sum, within ``gamma_v(W)·Σ|S|`` of ``E`` (any order; ``fsum`` is
      correctly rounded), and ``B'`` the same bound from a float64 sum of the norms (non-negative
      terms: within ``gamma_v(W)`` relative, ~10⁻¹³, of ``B``). A flagged bucket therefore has
      ``|W·P - E'| + gamma_v(W)·Σ|S| > B``, kept here with slack for the rounding of the
      screen's own arithmetic (10⁻¹² up, 10⁻⁹ down). A bucket too large for any bound has
      ``B = inf``: the definition passes it, and here ``inf`` (or ``inf · 0``, NaN) keeps it
      out.
    """
    world = sums.shape[0]
    with np.errstate(all="ignore"):
        low = np.fmin.reduce(reduced, axis=0)
        high = np.fmax.reduce(reduced, axis=0)
        differing = np.flatnonzero((low != high) & ~np.isnan(low))
        finite = np.isfinite(sums).all(0) & np.isfinite(norms).all(0) & np.isfinite(reduced).all(0)
        residual = np.abs(world * reduced - sums.sum(0)).max(0)
        slack = _gamma(world, 2.0**-53) * np.abs(sums).sum(0)
        bound = _bound_factors(world, tuple(numel), u) * norms.sum(0)
        near = finite & ((residual + slack) * (1 + 1e-12) > bound * (1 - 1e-9))
    return differing.tolist(), np.flatnonzero(near).tolist()


@functools.lru_cache(maxsize=8)
def _bound_factors(world: int, numel: tuple[int, ...], u: float) -> npt.NDArray[np.float64]:
    """Per bucket, ``B`` for norms summing to one (``B`` is linear in ``Σ N``)."""
    return np.array([reduction_bound(world, n, [1.0], u) for n in numel], dtype=np.float64)
