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
bucket has no bound worth having (``gamma(n)``). A bucket of at most ``WIDE_MAX`` elements is
summed in float64 outright: there the cost is the number of ops, not the pass (one instead of
eight), and its error, at most ``gamma_v(n - 1)`` times the absolute sum, is below the chunked
one's ``gamma(C - 1) + gamma_v(n/C + 1)``, so the bound ``B`` below holds for it unchanged.
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

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "CHUNK",
    "WIDE_MAX",
    "ReductionFinding",
    "bucket_norm",
    "check_reduction",
    "chunked_sum",
    "reduction_bound",
    "unit_roundoff",
]


CHUNK = 64
#: Buckets of at most this many elements are summed in float64 in one op (see the module).
WIDE_MAX = 1 << 15


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunked_sum(flat: torch.Tensor) -> torch.Tensor:
    """Σ of a 1-D tensor as a float64 scalar on its device: float32 chunks of :data:`CHUNK`
    elements added in float64 (the error model of :func:`reduction_bound`); a bucket of at most
    :data:`WIDE_MAX` elements in float64 outright, which that model covers too."""
    if flat.numel() <= WIDE_MAX:
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


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1.0 to the next representable value (round to nearest)."""
    return float(torch.finfo(dtype).eps) / 2.0


def _gamma(k: float, u: float) -> float:
    return k * u / (1.0 - k * u)


def reduction_bound(world: int, numel: int, norms: Sequence[float], u: float) -> float:
    """``B`` of the module docstring for one bucket."""
    v = 2.0**-53
    acc = min(u, 2.0**-24)  # float32 accumulation, float64 for float64 buckets
    if numel * acc >= 0.5:
        return math.inf  # the float32 norm is no bound any more: the check passes this bucket
    coefficient = (
        u
        + _gamma(world - 1, u) * (1.0 + u)
        + (_gamma(CHUNK - 1, acc) + _gamma(numel // CHUNK + 1, v)) * (2.0 + world * u)
        + _gamma(world, v)
        + v * (1.0 + world * u)
    )
    inflation = 1.0 / ((1.0 - acc) * math.sqrt(1.0 - _gamma(numel, acc)))
    return coefficient * inflation * math.sqrt(numel) * math.fsum(norms) * (1.0 + 1e-6)


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


def check_reduction(
    local_sums: Sequence[Sequence[float]],
    local_norms: Sequence[Sequence[float]],
    reduced_sums: Sequence[Sequence[float]],
    numel: Sequence[int],
    u: float,
) -> ReductionFinding | None:
    """The worst bucket whose reduced sum breaks the bound on some rank, or ``None``.

    Arguments are indexed ``[rank][bucket]``. Buckets with a non-finite value anywhere are the
    non-finite check's business and skipped here.
    """
    world = len(local_sums)
    worst: tuple[float, ReductionFinding] | None = None
    exact = _differing_replicas(reduced_sums, numel)
    if exact is not None:
        return exact
    for b, n in enumerate(numel):
        column = [local_sums[s][b] for s in range(world)]
        norms = [local_norms[s][b] for s in range(world)]
        reduced = [reduced_sums[r][b] for r in range(world)]
        if not all(math.isfinite(x) for x in (*column, *norms, *reduced)):
            continue
        expected = math.fsum(column)
        bound = reduction_bound(world, n, norms, u)
        bad = {r: world * p for r, p in enumerate(reduced) if abs(world * p - expected) > bound}
        if not bad:
            continue
        excess = max(abs(v - expected) for v in bad.values()) / max(bound, 1e-300)
        suspects = tuple(sorted(bad)) if len(bad) < world else ()
        finding = ReductionFinding(suspects, b, expected, bad, bound)
        if worst is None or excess > worst[0]:
            worst = (excess, finding)
    return worst[1] if worst is not None else None


def _differing_replicas(
    reduced_sums: Sequence[Sequence[float]], numel: Sequence[int]
) -> ReductionFinding | None:
    world = len(reduced_sums)
    for b in range(len(numel)):
        values = [reduced_sums[r][b] for r in range(world)]
        if len({v for v in values if not math.isnan(v)}) <= 1:
            continue
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
    return None
