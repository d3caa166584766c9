"""Cross-rank and temporal statistics of each rank's local gradient: a finite corruption, named
on the step it happens.

A finite bit flip in one rank's local gradient is averaged into every replica, so the weights
stay equal and no fingerprint sees it. What it does change is that rank's own bucket: one element
grows by a power of two. Per DDP bucket and rank, before all-reduce, the comm hook takes (on the
device, no host copy) the L2 norm and the largest magnitude (L∞) of the local bucket; with the
rank's loss they are all-gathered once per step and every rank runs the same two tests on the
same table, so every rank reaches the same verdict:

* **cross-rank** (3+ ranks): for each statistic ``x = log(value)``, the deviation of rank ``r``
  from the ranks' median, ``x_r - median``, against ``max(k · s, log F)`` where ``s`` is the
  robust cross-rank spread (1.4826 · MAD, an estimate of sigma) *averaged over clean steps* — the
  MAD of four values on a single step is too noisy to scale a test by;
* **temporal** (every world size, and the only one with 2 ranks, where a median of two is their
  mean and names nobody): ``x_r - μ_r`` against ``max(k · s_r, log F)``, where ``μ_r`` and ``s_r``
  are the rank's running mean and mean absolute deviation of that statistic over clean steps. A
  temporal excess on every rank at once is the job's own dynamics (a loss spike, a learning-rate
  change), not one rank's fault, and is not raised; with 3+ ranks at most half may be named.

Both tests are one-sided: a flip that raises a value raises a norm, one that lowers a value
(an exponent bit going 1 → 0) shrinks an element towards zero and moves the bucket by less than
that element — below any statistical threshold, and harmless in the same proportion.

Armed from the first step: while a reference holds fewer than ``warmup`` clean steps (running
averages with weight ``1/n``, then an exponential average with weight ``alpha``) its test speaks
with the conservative floor ``log E`` (``early_factor``, 64) in place of ``log F``: the
cross-rank test against the same step's median from step 0 (the spread learnt so far, 0 at
first, times ``k``), the temporal test from the rank's second step on. A raising bit-30 flip
(a factor 2¹²⁸) is far beyond either; what the early floor gives up is the low factors the learnt
spread will allow later.

Learning is robust: a step with any finding (of any layer) is not learnt, and while a reference
is young a value beyond the *mature* threshold ``max(k · s, log F)`` — above what the reference
would accept once learnt, below the early floor that names a rank — is not learnt either: it is
neither named (one young reference is no evidence against a rank) nor taken for normal (it
would inflate the mean and spread every later test reads). A temporal excess on more than half
the ranks is the job's dynamics and is learnt, as it is never named. So a fault in the first
steps cannot widen any threshold: it is either named, or kept out of the reference.
``k`` multiplies a *measured* spread: data differ per rank and per model, a fixed constant on
raw norms would be wrong for both. The floor ``F`` is not scaled by a spread, so it is set
above the largest excess clean steps were measured to reach (a heavy tail the averaged spread
does not follow: :mod:`detection.stepcheck.headroom`, ``docs/detection-design.md``). The cost
in sensitivity: a flip is caught when it raises a bucket's norm by more than
``exp(max(k·s, log F))``; with the defaults (``k = 16``, ``F = 16``) and a clean spread ``s``
of 0.05-0.15 that is a factor of 16.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from detection import native
from detection.stepcheck.allreduce import bucket_norm, chunked_sum, native_chunk
from detection.stepcheck.headroom import Headroom

__all__ = [
    "BUCKET_FIELDS",
    "MAD_TO_SIGMA",
    "TINY",
    "LocalGradStats",
    "ScalarTests",
    "StatFinding",
    "StatsConfig",
    "StatsConfigError",
    "stat_finding",
    "worst_per_rank",
]

TINY = 1e-30
MAD_TO_SIGMA = 1.4826
# Per bucket, per rank: local sum, local L2 norm, local L∞, reduced sum (all float64).
BUCKET_FIELDS = 4


@dataclass(frozen=True)
class StatsConfig:
    """Tuning of the statistical tests (identical on every rank: part of ``GuardConfig``).

    ``k``: threshold in units of the calibrated spread. ``floor_factor``: a statistic must at
    least be multiplied by this factor to be named, whatever its spread (a statistic that never
    moves would otherwise fire on rounding noise). ``warmup``: clean steps a reference learns
    before its tests take the learnt threshold. ``alpha``: weight of a new clean step in the
    running averages after warm-up.
    ``early_factor``: the floor in place of ``floor_factor`` while a reference holds fewer than
    ``warmup`` clean steps (the tests speak from the first step). ``abft_margin``: the ABFT
    tolerance ``τ`` of every layer, in units of its rounding bound derived from the arithmetic
    (:mod:`detection.stepcheck.abft_bound`; 1: the bound itself), the same from the first step.
    """

    k: float = 16.0
    floor_factor: float = 16.0
    warmup: int = 25
    alpha: float = 0.05
    early_factor: float = 64.0
    abft_margin: float = 1.0

    def __post_init__(self) -> None:
        problems = [
            (self.k > 0, f"k must be > 0, got {self.k}"),
            (self.floor_factor > 1, f"floor_factor must be > 1, got {self.floor_factor}"),
            (self.warmup >= 1, f"warmup must be ≥ 1, got {self.warmup}"),
            (0 < self.alpha <= 1, f"alpha must lie in (0, 1], got {self.alpha}"),
            (
                self.early_factor >= self.floor_factor,
                f"early_factor must be ≥ floor_factor, got {self.early_factor}",
            ),
            (self.abft_margin >= 1, f"abft_margin must be ≥ 1, got {self.abft_margin}"),
        ]
        for ok, message in problems:
            if not ok:
                raise StatsConfigError(message)


class StatsConfigError(ValueError):
    """A :class:`StatsConfig` value that would disarm or break the tests."""


@dataclass(frozen=True)
class StatFinding:
    """One rank's worst excess on one step: which statistic, which test, by how much."""

    rank: int
    statistic: str
    test: str
    bucket: int | None
    value: float
    reference: float
    deviation: float
    threshold: float
    scale: float

    def to_detail(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "statistic": self.statistic,
            "test": self.test,
            "bucket": self.bucket,
            "log_value": round(self.value, 6),
            "log_reference": round(self.reference, 6),
            "deviation": round(self.deviation, 6),
            "threshold": round(self.threshold, 6),
            "scale": round(self.scale, 6),
        }


#: On CPU, buckets below this many elements take ``max(amax, -amin)``.
_TWO_PASS_MAX = 1 << 20


def _peak(flat: torch.Tensor) -> torch.Tensor:
    """max |x| of a 1-D tensor, NaN if it holds one. On CPU, for a bucket that stays in cache,
    ``max(amax, -amin)``: two vectorised passes, a third faster than one ``aminmax`` (and
    ``vector_norm(inf)`` is slower still); a larger bucket is bandwidth-bound, and there one
    ``aminmax``, a single read, is a quarter faster (2.4 M float32: 0.74 ms against 1.02, one
    thread). On a GPU, where each op is a kernel launch, one ``vector_norm(inf)``: one pass and
    one launch, NaN-propagating like ``amax``."""
    if flat.device.type != "cpu":
        return torch.linalg.vector_norm(flat, math.inf)
    if flat.numel() < _TWO_PASS_MAX:
        return torch.maximum(flat.amax(), flat.amin().neg())
    low, high = torch.aminmax(flat)
    return torch.maximum(-low, high)


def _flat(bucket: torch.Tensor) -> torch.Tensor:
    """A bucket as a 1-D tensor outside autograd: itself when it is one already (DDP's buckets
    are), with no op on the per-step path."""
    if bucket.dim() == 1 and not bucket.requires_grad:
        return bucket
    return bucket.detach().reshape(-1)


class LocalGradStats:
    """Per-bucket statistics of one rank's step, kept on the device until the all-gather.

    Called by the comm hook: :meth:`on_local` before all-reduce (after any injected fault, as
    faulty hardware would have produced it), :meth:`on_reduced` on the reduced bucket. Buckets
    may be reported in any order and from the future's callback thread; each writes its slot.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._local: dict[int, torch.Tensor] = {}
        self._reduced: dict[int, torch.Tensor] = {}
        self.numel: dict[int, int] = {}

    def clear(self) -> None:
        self._local.clear()
        self._reduced.clear()
        self.numel.clear()

    def on_local(self, key: int, buffer: torch.Tensor) -> torch.Tensor:
        """Record the local bucket's statistics; returns its (float64) sum."""
        flat = _flat(buffer)
        self.numel[key] = flat.numel()
        if native.stats_kind_ok(flat) and native.available():
            # the three in one pass (the same sum as chunked_sum's native one)
            stats = native.stats_f32(flat, native_chunk(flat.numel()))
            self._local[key] = stats
            return stats[0]
        peak = _peak(flat).to(torch.float64)
        total = chunked_sum(flat)
        self._local[key] = torch.stack([total, bucket_norm(flat), peak])
        return total

    def on_reduced(self, key: int, reduced: torch.Tensor) -> torch.Tensor:
        """Record the reduced bucket's sum, and return it (float64)."""
        total = chunked_sum(_flat(reduced))
        self._reduced[key] = total.reshape(1)
        return total

    def parts(self) -> list[torch.Tensor]:
        """The pieces of :meth:`row`, for a caller that joins them with its own in one op."""
        keys = sorted(self._local)
        # a fill, not torch.tensor([...]): no host-to-device copy (a synchronisation on CUDA)
        parts = [torch.full((1,), float(len(keys)), dtype=torch.float64, device=self.device)]
        for key in keys:
            parts.append(self._local[key].to(self.device))
            reduced = self._reduced.get(key)
            if reduced is None:
                reduced = torch.full((1,), math.nan, dtype=torch.float64, device=self.device)
            parts.append(reduced.to(self.device))
        return parts

    def row(self) -> torch.Tensor:
        """``[n_buckets, (sum, l2, amax, reduced sum) per bucket in index order]`` (float64)."""
        return torch.cat(self.parts())

    def values(self) -> list[float]:
        """:meth:`row` as host floats, for a CPU job (:mod:`detection.row.words`): the same
        float64 values, read where :meth:`parts` would copy and join them with an op each."""
        keys = sorted(self._local)
        out = [float(len(keys))]
        for key in keys:
            out.extend(self._local[key].tolist())
            reduced = self._reduced.get(key)
            out.append(math.nan if reduced is None else float(reduced))
        return out


def _log(value: float) -> float:
    return math.log(max(abs(value), TINY))


@dataclass
class _History:
    """Running mean and mean absolute deviation of one statistic of one rank."""

    mean: float = 0.0
    dev: float = 0.0
    n: int = 0

    def update(self, x: float, alpha: float, warmup: int) -> None:
        weight = 1.0 / (self.n + 1) if self.n < warmup else alpha
        if self.n:
            self.dev += weight * (abs(x - self.mean) - self.dev)
        self.mean += weight * (x - self.mean)
        self.n += 1


@dataclass
class ScalarTests:
    """The tests of one layout as a loop over each rank's values: their definition
    (:meth:`_test_logs`, :meth:`_learn_logs`), and the faster way for a small table (see
    :class:`GradStatsDetector`)."""

    world_size: int
    config: StatsConfig = field(default_factory=StatsConfig)
    steps_learnt: int = 0
    _temporal: dict[tuple[int, str], _History] = field(default_factory=dict)
    _spread: dict[str, _History] = field(default_factory=dict)
    _mature: bool = False  # every reference holds ``warmup`` steps: no young-value gate
    headroom: Headroom = field(default_factory=Headroom)  # clean excesses (measurement only)

    @property
    def calibrated(self) -> bool:
        return self.steps_learnt >= self.config.warmup

    def history(self) -> dict[tuple[int, str], tuple[float, float, int]]:
        return {key: (h.mean, h.dev, h.n) for key, h in sorted(self._temporal.items())}

    def test(self, values: Sequence[dict[str, float]]) -> list[StatFinding]:
        """The findings of this step, at most one per rank."""
        return self._test_logs(*_logs_of(values))

    def test_rows(
        self, names: Sequence[str], rows: Sequence[Sequence[float]], *, learn: bool
    ) -> list[StatFinding]:
        """:meth:`test` and then, when ``learn`` and nothing was found, :meth:`learn`, of the
        table ``rows[r][j]`` (statistic ``names[j]`` on rank ``r``): each value's log taken
        once and no mapping built per rank — the guard's per-step path, where the two calls
        and their mappings cost more than the tests."""
        log, isfinite, tiny = math.log, math.isfinite, TINY
        logs = [
            [(j, log(max(abs(v), tiny))) for j, v in enumerate(row) if isfinite(v)] for row in rows
        ]
        found = self._test_logs(names, logs)
        if learn and not found:
            self._learn_logs(names, logs)
        return found

    def _test_logs(
        self, names: Sequence[str], logs: Sequence[Sequence[tuple[int, float]]]
    ) -> list[StatFinding]:
        """The tests on each rank's finite logs (``(column, log)``, columns named by ``names``):
        cross-rank against the median of three or more ranks, temporal against the rank's own
        history; each rank's worst (:func:`worst_per_rank`)."""
        cfg = self.config
        floor, early = math.log(cfg.floor_factor), math.log(cfg.early_factor)
        cross: list[StatFinding] = []
        if self.world_size >= 3:
            for name, xs in sorted((names[j], xs) for j, xs in _by_column(logs).items()):
                if len(xs) < 3:
                    continue
                median = statistics.median(v for _, v in xs)
                spread = self._spread.get(name)
                scale = spread.mean if spread is not None else 0.0
                young = spread is None or spread.n < cfg.warmup
                threshold = max(cfg.k * scale, early if young else floor)
                for r, v in xs:
                    if v - median > threshold:
                        cross.append(
                            stat_finding(r, name, "cross-rank", v, median, threshold, scale)
                        )
        temporal: list[StatFinding] = []
        get, warmup, k = self._temporal.get, cfg.warmup, cfg.k
        for r, x in enumerate(logs):
            for j, v in x:
                history = get((r, names[j]))
                if history is None or not history.n:
                    continue
                threshold = max(k * history.dev, floor if history.n >= warmup else early)
                if v - history.mean > threshold:
                    temporal.append(
                        stat_finding(
                            r, names[j], "temporal", v, history.mean, threshold, history.dev
                        )
                    )
        if not cross and not temporal:
            return []
        return worst_per_rank(cross, temporal, self.world_size)

    def _learn_logs(
        self, names: Sequence[str], logs: Sequence[Sequence[tuple[int, float]]]
    ) -> None:
        """Fold a clean step's logs into the histories: each rank's own, and with three or more
        ranks the spread (scaled median absolute deviation) of each column; while a reference is
        young, a value beyond its mature threshold is left out (:meth:`_outliers`)."""
        cfg = self.config
        alpha, warmup, temporal = cfg.alpha, cfg.warmup, self._temporal
        kept, columns = self._outliers(names, logs) if not self._mature else (set(), set())
        peak, peak_name = -math.inf, ""
        for r, x in enumerate(logs):
            for j, v in x:
                if (r, j) in kept:
                    continue
                history = temporal.get((r, names[j]))
                if history is None:
                    history = temporal[(r, names[j])] = _History()
                elif history.n >= warmup and v - history.mean > peak:
                    peak, peak_name = v - history.mean, names[j]
                history.update(v, alpha, warmup)
        self.headroom.temporal.note(peak, peak_name)
        if self.world_size >= 3:
            peak, peak_name = -math.inf, ""
            for j, ranked in _by_column(logs).items():
                if len(ranked) < 3 or j in columns:
                    continue
                xs = [v for _, v in ranked]
                median = statistics.median(xs)
                mad = MAD_TO_SIGMA * statistics.median(abs(v - median) for v in xs)
                spread = self._spread.setdefault(names[j], _History())
                if spread.n >= warmup and max(xs) - median > peak:
                    peak, peak_name = max(xs) - median, names[j]
                spread.update(mad, alpha, warmup)
            self.headroom.cross.note(peak, peak_name)
        self.steps_learnt += 1
        if self.steps_learnt >= warmup and not self._mature:
            # as the arrays count it: a history for every rank and column, a spread for every
            # column with 3+ ranks, each of ``warmup`` steps
            spreads = self._spread.values() if self.world_size >= 3 else ()
            self._mature = (
                len(temporal) == self.world_size * len(names)
                and all(h.n >= warmup for h in temporal.values())
                and (self.world_size < 3 or len(self._spread) == len(names))
                and all(h.n >= warmup for h in spreads)
            )

    def _outliers(
        self, names: Sequence[str], logs: Sequence[Sequence[tuple[int, float]]]
    ) -> tuple[set[tuple[int, int]], set[int]]:
        """The values a young reference does not learn: ``(rank, column)`` beyond the mature
        threshold ``max(k · s, log F)`` of its young temporal history (unless more than half
        the ranks are, the job's dynamics) or of its column's young cross-rank spread, and the
        columns whose spread is not learnt (one of their values was a cross-rank outlier)."""
        cfg = self.config
        floor, warmup, k = math.log(cfg.floor_factor), cfg.warmup, cfg.k
        temporal: list[tuple[int, int]] = []
        for r, x in enumerate(logs):
            for j, v in x:
                h = self._temporal.get((r, names[j]))
                if h is not None and 0 < h.n < warmup and v - h.mean > max(k * h.dev, floor):
                    temporal.append((r, j))
        ranks = {r for r, _ in temporal}
        if not (len(ranks) < self.world_size and len(ranks) <= max(1, self.world_size // 2)):
            temporal = []
        cross: list[tuple[int, int]] = []
        if self.world_size >= 3:
            for j, ranked in _by_column(logs).items():
                spread = self._spread.get(names[j])
                if len(ranked) < 3 or (spread is not None and spread.n >= warmup):
                    continue
                median = statistics.median(v for _, v in ranked)
                threshold = max(k * (spread.mean if spread is not None else 0.0), floor)
                cross.extend((r, j) for r, v in ranked if v - median > threshold)
        return {*temporal, *cross}, {j for _, j in cross}

    def learn(self, values: Sequence[dict[str, float]]) -> None:
        """Fold a clean step into the histories."""
        self._learn_logs(*_logs_of(values))

    def export(self) -> dict[str, Any]:
        """What was learnt, as plain lists (:meth:`GradStatsDetector.state_dict`)."""
        names = list(dict.fromkeys([*(n for _, n in self._temporal), *self._spread]))
        return {
            "steps_learnt": self.steps_learnt,
            "names": names,
            "temporal": [[r, n, h.mean, h.dev, h.n] for (r, n), h in self._temporal.items()],
            "spread": [[n, h.mean, h.dev, h.n] for n, h in self._spread.items()],
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.steps_learnt = int(state["steps_learnt"])
        self._temporal = {
            (int(r), str(n)): _History(float(m), float(d), int(c))
            for r, n, m, d, c in state["temporal"]
        }
        self._spread = {
            str(n): _History(float(m), float(d), int(c)) for n, m, d, c in state["spread"]
        }
        self._mature = False


def _logs_of(
    values: Sequence[dict[str, float]],
) -> tuple[list[str], list[list[tuple[int, float]]]]:
    """Each rank's finite values as ``(column, log)`` in the rank's own order, and the
    columns' names (a non-finite value is no evidence: it is left out, as a missing one)."""
    index: dict[str, int] = {}
    logs = []
    for per in values:
        row = []
        for name, v in per.items():
            if math.isfinite(v):
                row.append((index.setdefault(name, len(index)), _log(v)))
        logs.append(row)
    return list(index), logs


def _by_column(
    logs: Sequence[Sequence[tuple[int, float]]],
) -> dict[int, list[tuple[int, float]]]:
    """Each column's finite logs as ``(rank, log)`` in rank order."""
    columns: dict[int, list[tuple[int, float]]] = {}
    for r, x in enumerate(logs):
        for j, v in x:
            columns.setdefault(j, []).append((r, v))
    return columns


def worst_per_rank(
    cross: Sequence[StatFinding], temporal: Sequence[StatFinding], world_size: int
) -> list[StatFinding]:
    """Each rank's worst finding of a step (by deviation over threshold; the first of equal
    ones), from its cross-rank findings and, unless they are the job's own dynamics (every
    rank, or with 3+ ranks more than half of them), its temporal ones; in rank order."""
    ranks = {f.rank for f in temporal}
    if not (len(ranks) < world_size and len(ranks) <= max(1, world_size // 2)):
        temporal = []
    worst: dict[int, tuple[float, StatFinding]] = {}
    for finding in (*cross, *temporal):
        score = finding.deviation / finding.threshold
        if finding.rank not in worst or score > worst[finding.rank][0]:
            worst[finding.rank] = (score, finding)
    return [worst[r][1] for r in sorted(worst)]


def stat_finding(
    rank: int, name: str, test: str, value: float, ref: float, threshold: float, scale: float
) -> StatFinding:
    statistic, _, bucket = name.partition("[")
    """A finding of statistic ``name`` (``loss``, ``l2[b]``, ``amax[b]``) on ``rank``."""
    return StatFinding(
        rank=rank,
        statistic=statistic,
        test=test,
        bucket=int(bucket.rstrip("]")) if bucket else None,
        value=value,
        reference=ref,
        deviation=value - ref,
        threshold=threshold,
        scale=scale,
    )
