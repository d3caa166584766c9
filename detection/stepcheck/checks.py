"""The per-step layer: statistical and algebraic checks on every step, decided before the update.

The other layers see a finite corruption of a local gradient or an activation only on audited
steps. This layer looks at every step, cheaply, and reaches its verdict in the optimizer's step
pre-hook — before the weights change:

* :mod:`detection.stepcheck.gradstats` — cross-rank and temporal tests of each rank's local bucket
norms
  and loss (``layer`` ``gradstats``): statistical evidence;
* :mod:`detection.stepcheck.allreduce` — Σ of the local bucket sums against the reduced bucket's sum
  within a derived rounding bound (``allreduce``): algebraic evidence;
* :mod:`detection.stepcheck.abft` — opt-in Linear checksums (``abft``);
* :mod:`detection.weights.optstate` — a non-finite optimizer state after the update (``optstate``),
  carried in the guard's own per-step row.

Everything before the all-gather stays on the device. The layer's row (float64, a few numbers
per bucket and rank) is built at the end of the step's last (synchronised) backward; by default
it travels, its bits carried exactly as int64 words, in the guard's one all-gather at the end of
the step (:meth:`StepChecks.hand_over`), and is decided there, naming the same step. With
``skip_update_on_alarm`` it is gathered at once instead (one more small all-gather and host
synchronisation) and decided before any optimizer, handed to the guard or not, can update a
weight. The comm hook runs only on that backward, on the buckets DDP reduces: with
gradient accumulation the statistics are those of the accumulated gradient, never of a
``no_sync`` micro-batch alone. Every rank decides from the same gathered table, so with
``skip_update_on_alarm`` every rank skips the same step: the gradients are dropped
(``p.grad = None``) before ``optimizer.step``, which then leaves weights and optimizer state
exactly as they were; under a GradScaler they are set to NaN instead, so the scaler skips the
step as it skips an overflow (``GradScaler.step`` refuses an optimizer without gradients).

Under a GradScaler the buckets hold *scaled* gradients: the statistics are divided by the
scale the step's backward used (a power of two: exact), so a scale change is no change of the
gradient. A step whose gathered statistics are non-finite anywhere (a scaler overflow, or a NaN
the non-finite check names) is not tested and not learnt from: the history holds clean, finite
steps only.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from torch import nn

from detection.row.gather import all_gather_rows
from detection.row.words import float_words, on_host, word_floats
from detection.stepcheck.abft import LinearChecksums
from detection.stepcheck.allreduce import check_reduction, unit_roundoff
from detection.stepcheck.gradstats import BUCKET_FIELDS, LocalGradStats, StatsConfig
from detection.stepcheck.gradstats_detector import GradStatsDetector
from detection.transport.alarm import Layer, Phase
from detection.weights.optstate import OptimizerStateCheck, StateFlag

__all__ = ["CarriedVerdict", "StepCheckFinding", "StepChecks"]

_log = logging.getLogger(__name__)
F = TypeVar("F", bound=tuple[Any, ...])
# Findings that lead before this layer's: a rank's own NaN, a strict-majority vote (the
# strongest attribution there is, and what automatic approval rests on).
_AHEAD = (Layer.NONFINITE, Layer.FINGERPRINT)

WEAKER = "statistical evidence: weaker than a vote or an audit, never approved automatically alone"


@dataclass(frozen=True)
class StepCheckFinding:
    """One finding of this layer, in the guard's finding shape (layer, phase, suspects, detail)."""

    layer: Layer
    phase: Phase
    suspects: tuple[int, ...]
    detail: dict[str, Any]

    def __iter__(self) -> Iterator[Any]:
        return iter((self.layer, self.phase, self.suspects, self.detail))


def _finite_values(losses: npt.NDArray[np.float64], fields: npt.NDArray[np.float64]) -> bool:
    """Every loss, bucket sum and bucket L∞ is finite: no element was NaN/Inf on any rank
    (``fields``: ``[rank, bucket, (sum, l2, amax, reduced sum)]``). A float32 L2 norm may
    overflow from finite elements (one of 3e35 after a bit-30 flip): that is evidence for the
    tests, not a non-finite step, so it is not looked at here."""
    return bool(np.isfinite(losses).all() and np.isfinite(fields[:, :, [0, 2, 3]]).all())


#: A step's table of at most this many values is read as lists, larger ones as an array:
#: numpy's calls cost more than a loop over a few dozen values, a loop over hundreds of buckets
#: on many ranks more than the step.
LOOP_MAX = 256


@dataclass(frozen=True)
class _Parsed:
    """One step's rows, read: per rank the ABFT ratios, and per rank and bucket the local sum,
    L2 norm and reduced sum; ``values`` the statistical tests' table (``loss``, each bucket's
    L2, each bucket's L∞ per rank)."""

    finite: bool
    n_buckets: int
    ratios: list[list[float]]
    sums: list[list[float]] | npt.NDArray[np.float64]
    norms: list[list[float]] | npt.NDArray[np.float64]
    reduced: list[list[float]] | npt.NDArray[np.float64]
    values: npt.NDArray[np.float64] | list[list[float]]


def _parse_lists(rows: list[list[float]], n_ratios: int) -> _Parsed:
    # A row's tail is [n_buckets, (sum, l2, amax, reduced) per bucket]: each field one slice.
    start = 2 + n_ratios
    n_buckets = int(rows[0][start]) if rows and len(rows[0]) > start else 0
    f = BUCKET_FIELDS

    def field(k: int) -> list[list[float]]:
        first = start + k
        return [r[first : first + f * n_buckets : f] for r in rows]

    sums, norms, peaks, reduced = field(1), field(2), field(3), field(4)
    losses = [r[1] for r in rows]
    values = [[loss, *n, *p] for loss, n, p in zip(losses, norms, peaks, strict=True)]
    finite = all(map(math.isfinite, chain(losses, *sums, *peaks, *reduced)))
    ratios = [r[2:start] for r in rows]
    return _Parsed(finite, n_buckets, ratios, sums, norms, reduced, values)


def _parse_array(table: npt.NDArray[np.float64], n_ratios: int) -> _Parsed:
    world = table.shape[0]
    tail = table[:, 2 + n_ratios :]
    n_buckets = int(tail[0, 0]) if tail.size else 0
    fields = tail[:, 1 : 1 + BUCKET_FIELDS * n_buckets].reshape(world, n_buckets, BUCKET_FIELDS)
    losses = table[:, 1]
    return _Parsed(
        finite=_finite_values(losses, fields),
        n_buckets=n_buckets,
        ratios=table[:, 2 : 2 + n_ratios].tolist(),
        sums=fields[:, :, 0],
        norms=fields[:, :, 1],
        reduced=fields[:, :, 3],
        values=np.concatenate([losses[:, None], fields[:, :, 1], fields[:, :, 2]], axis=1),
    )


@functools.lru_cache(maxsize=8)
def _statistic_names(n_buckets: int) -> tuple[str, ...]:
    """The columns of the statistical tests: the loss, then each bucket's L2, then its L∞."""
    return (
        "loss",
        *(f"l2[{b}]" for b in range(n_buckets)),
        *(f"amax[{b}]" for b in range(n_buckets)),
    )


@dataclass(frozen=True)
class CarriedVerdict:
    """The per-step layer's part of one step's decision while that decision is open: ``row``,
    the words it adds to the guard's row (``None`` when it was decided before the update, and
    then ``findings`` is its verdict), and ``n_ratios``, how many ABFT ratios the row holds."""

    row: torch.Tensor | list[int] | None
    n_ratios: int
    findings: tuple[StepCheckFinding, ...]
    # The step's bucket sizes and unit roundoff: the all-reduce check's bound needs them, and
    # the next step (which may bucket differently: DDP rebuilds its buckets after the first)
    # has replaced them by the time a deferred decision is taken.
    numel: tuple[int, ...] = ()
    u: float = 0.0


class StepChecks:
    """The layer for one guard. Protocol per step: :meth:`begin_step`, the comm hook's
    :meth:`on_local`/:meth:`on_reduced`, :meth:`before_update` (collective), then the guard's
    row carries :meth:`state_flag` and its decision calls :meth:`findings`."""

    def __init__(
        self,
        *,
        module: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        params: Sequence[torch.Tensor],
        group: dist.ProcessGroup | None,
        world_size: int,
        config: StatsConfig,
        enabled: bool,
        abft: bool,
        skip_update: bool,
        check_reduction: bool,
        extra: dict[str, Any],
        abft_every: int = 1,
    ) -> None:
        self.optimizers = list(optimizers)
        self.params = list(params)
        self.group = group
        self.world_size = world_size
        self.config = config
        self.skip_update = skip_update
        self.device = self.params[0].device
        self.stats = LocalGradStats(self.device)
        self.detector = GradStatsDetector(world_size, config)
        self.enabled = enabled
        self.abft = (
            LinearChecksums(module, self.params, every=abft_every) if abft and enabled else None
        )
        self._check_reduction = check_reduction
        self._state = OptimizerStateCheck()
        self._state_flags = [StateFlag(opt, self.params, self.device) for opt in self.optimizers]
        self._extra = extra
        self._decided = True
        self._carried: tuple[torch.Tensor | list[float], int] | None = None
        self._pending: list[StepCheckFinding] = []
        self.skipped_steps: list[int] = []
        self.tested_steps = 0  # steps whose statistics were finite and tested
        self.nonfinite_steps = 0  # steps left to the non-finite check (overflow or NaN)
        self._u = unit_roundoff(self.params[0].dtype)

    def close(self) -> None:
        if self.abft is not None:
            self.abft.close_hooks()

    # -- learnt state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What this layer learnt (:mod:`detection.guard.state`): the statistics' references;
        the checksums learn nothing (their tolerance is derived), so only their layers' names."""
        return {
            "gradstats": self.detector.state_dict(),
            "abft_layers": self.abft.names if self.abft is not None else [],
            "tested_steps": self.tested_steps,
            "nonfinite_steps": self.nonfinite_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state["gradstats"])
        self.tested_steps = int(state["tested_steps"])
        self.nonfinite_steps = int(state["nonfinite_steps"])

    # -- the comm hook's calls ------------------------------------------------------------------
    def on_local(self, key: int, bucket: dist.GradBucket) -> torch.Tensor | None:
        """The local bucket's statistics; returns its sum, which the non-finite check shares."""
        if self._decided:
            return None
        buffer = bucket.buffer()
        self._u = unit_roundoff(buffer.dtype)
        total = self.stats.on_local(key, buffer)
        if self.abft is not None:
            self.abft.on_local_gradient(
                list(zip(bucket.parameters(), bucket.gradients(), strict=True))
            )
        return total

    def on_reduced(self, key: int, reduced: torch.Tensor) -> torch.Tensor | None:
        return None if self._decided else self.stats.on_reduced(key, reduced)

    # -- the step -------------------------------------------------------------------------------
    def begin_step(self, step: int = 0) -> None:
        """Open ``step``; its number places it in the checksums' rotation (``abft_every``)."""
        self.stats.clear()
        self._pending = []
        self._carried = None
        self._decided = not self.enabled
        if self.abft is not None:
            self.abft.open(step)

    def end_step(self) -> None:
        self._decided = True
        if self.abft is not None:
            self.abft.close()

    def before_update(
        self, step: int, loss: torch.Tensor | None, scale: torch.Tensor | None = None
    ) -> None:
        """Collective, once per step (the end of the step's last backward; the optimizer
        pre-hook and the end of the step only if that was skipped): gather, decide, and drop
        the gradients of a corrupted step when ``skip_update_on_alarm`` is set. ``scale``: the
        GradScaler scale of the step's backward (the buckets' gradients are multiplied by it).
        """
        if self._decided:
            return
        self._decided = True
        if self.abft is not None:
            self.abft.close()
        row, n_ratios = (
            self._row_on_host(step, loss, scale)
            if on_host(self.device)
            else self._row(step, loss, scale)
        )
        if not self.skip_update:
            # Nothing acts on the verdict before the step's end: it travels in the guard's own
            # all-gather there (:meth:`hand_over`), one collective and one host
            # synchronisation per step for both.
            self._carried = (row, n_ratios)
            return
        if isinstance(row, list):
            row = torch.tensor(row, dtype=torch.float64)
        rows = all_gather_rows(row, self.group)
        nonfinite_before = self.nonfinite_steps
        self._pending = self._decide(rows, n_ratios, self._numel(), self._u)
        # A non-finite gradient (the non-finite check's alarm) is dropped too; under a scaler
        # the scaler skips it already.
        nonfinite = self.nonfinite_steps > nonfinite_before and scale is None
        if self._pending or nonfinite:
            self._drop_update(scaled=scale is not None)
            self.skipped_steps.append(step)
            _log.warning(
                "update of step %d skipped on every rank: %s",
                step,
                ", ".join(str(f.layer) for f in self._pending) or "non-finite gradient",
                extra={**self._extra, "step": step},
            )

    def _row(
        self, step: int, loss: torch.Tensor | None, scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, int]:
        """This rank's float64 row (step, loss, ABFT ratios, bucket statistics) on the device,
        and the number of ABFT ratios in it."""
        loss_value = (
            loss.detach().reshape(-1)[:1].to(device=self.device, dtype=torch.float64)
            if loss is not None
            else torch.full((1,), math.nan, dtype=torch.float64, device=self.device)
        )
        ratios = [self.abft.ratios()] if self.abft is not None else []
        n_ratios = ratios[0].numel() if ratios else 0
        head = torch.full((1,), float(step), dtype=torch.float64, device=self.device)
        if scale is None:  # one cat for the whole row: its ops are a small model's fixed cost
            return torch.cat([head, loss_value, *ratios, *self.stats.parts()]), n_ratios
        # per bucket (sum, l2, amax, reduced sum) / scale; the bucket count kept
        stats = self.stats.row()
        divisor = scale.detach().reshape(1).to(self.device, torch.float64)
        stats = torch.cat([stats[:1], stats[1:] / divisor])
        return torch.cat([head, loss_value, *ratios, stats]), n_ratios

    def _row_on_host(
        self, step: int, loss: torch.Tensor | None, scale: torch.Tensor | None
    ) -> tuple[list[float], int]:
        """:meth:`_row` as host floats, the same values, on a CPU (:mod:`detection.row.words`)."""
        ratios = self.abft.ratios().tolist() if self.abft is not None else []
        stats = self.stats.values()
        if scale is not None:
            divisor = float(scale)
            stats = [stats[0], *(v / divisor for v in stats[1:])]
        loss_value = float(loss) if loss is not None else math.nan
        return [float(step), loss_value, *ratios, *stats], len(ratios)

    def hand_over(self) -> CarriedVerdict:
        """The step's part in the guard's decision, taken out of this layer so the next step
        may begin before it is decided: the row to carry in the guard's all-gather (the float64
        bits as int64 words, exactly), or the findings of a verdict reached before the update.
        The guard hands it back, with the gathered words, to :meth:`decide_carried`."""
        if self._carried is None:
            verdict = CarriedVerdict(None, 0, tuple(self._pending))
        else:
            row, n_ratios = self._carried
            words = float_words(row) if isinstance(row, list) else row.view(torch.int64)
            verdict = CarriedVerdict(words, n_ratios, (), numel=self._numel(), u=self._u)
        self._carried = None
        self._pending = []
        return verdict

    def decide_carried(
        self, verdict: CarriedVerdict, words: torch.Tensor | Sequence[Sequence[int]]
    ) -> None:
        """Make ``verdict`` the findings :meth:`merge` places next. A carried row is decided
        from every rank's words (``words``: the host ``(world, n)`` int64 table of the gathered
        rows past the guard's own, or a small one's rows as ints): the same on every rank, as
        every rank holds the table.
        Verdicts are decided in step order, so the temporal history learns as it would at
        once."""
        if verdict.row is None:
            self._pending = list(verdict.findings)
            return
        if not isinstance(words, torch.Tensor):
            rows: list[list[float]] | npt.NDArray[np.float64] = [word_floats(w) for w in words]
        else:
            table = words.contiguous().view(torch.float64)
            rows = table.tolist() if table.numel() <= LOOP_MAX else table.numpy()
        self._pending = self._decide(rows, verdict.n_ratios, verdict.numel, verdict.u)

    def _numel(self) -> tuple[int, ...]:
        """The elements of each bucket of this step, in bucket order."""
        return tuple(self.stats.numel[k] for k in sorted(self.stats.numel))

    def _drop_update(self, *, scaled: bool) -> None:
        """Make every optimizer leave weights and state as they are, the same on every rank."""
        for p in self.params:
            if scaled and p.grad is not None:
                p.grad.fill_(math.nan)  # the scaler sees an overflow and skips the step
            else:
                p.grad = None

    def state_flag(self) -> torch.Tensor:
        """``[1]`` if this rank's optimizer state holds a NaN/Inf after the update (device)."""
        if not self.enabled:
            return torch.zeros(1, dtype=torch.int64, device=self.device)
        flags = [flag() for flag in self._state_flags]
        return flags[0] if len(flags) == 1 else torch.stack(flags).amax(0)

    def state_flag_on_host(self) -> int:
        """:meth:`state_flag` as a host int, for a CPU job's row (:mod:`detection.row.words`)."""
        if not self.enabled:
            return 0
        return max(flag.on_host() for flag in self._state_flags)

    def merge(
        self,
        findings: Sequence[F],
        state_flags: Sequence[int],
        *,
        known: frozenset[int],
        poisoned: bool,
        nonfinite: bool,
        make: Callable[[Layer, Phase, tuple[int, ...], dict[str, Any]], F],
    ) -> list[F]:
        """The guard's findings with this layer's placed by strength of evidence: the pre-update
        findings after a non-finite check and a vote (which name a rank by its own NaN or by a
        majority) and before an audit, the optimizer-state finding last (it names every replica
        that applied the update). ``findings`` come as the guard orders them: non-finite, vote,
        audit; each is a tuple whose first item is its layer.

        What follows from an event already raised is not new: nothing while a NaN is open,
        nothing naming only replicas an alarm named as wrong (``known``), and no non-finite state
        on the step of a non-finite gradient (or a scaler overflow) or while such replicas
        exist (their gradients reach every replica through the all-reduce)."""
        ours = [
            make(*f)
            for f in self._pending
            if not (poisoned or (known and (not f.suspects or set(f.suspects) <= known)))
        ]
        at = sum(1 for f in findings if f[0] in _AHEAD)
        out = [*findings[:at], *ours, *findings[at:]]
        state = self._state.observe(state_flags)
        if state is not None and not (poisoned or nonfinite or known):
            out.append(
                make(Layer.OPTSTATE, Phase.OPTIMIZER_STATE, state, self._state_detail(state))
            )
        return out

    def _state_detail(self, ranks: tuple[int, ...]) -> dict[str, Any]:
        return {
            "check": "non-finite optimizer state after the update",
            "statistic": "max |state|",
            "threshold": "finite",
            "ranks": list(ranks),
            "reason": "every replica applied the same non-finite state: the vote cannot see it"
            if len(ranks) == self.world_size
            else "non-finite state on some replicas",
        }

    # -- the decision ----------------------------------------------------------------------------
    def _decide(
        self,
        rows: Sequence[Sequence[float]] | npt.NDArray[np.float64],
        n_ratios: int,
        numel: Sequence[int],
        u: float,
    ) -> list[StepCheckFinding]:
        """The findings of one step from every rank's row; ``numel`` and ``u``: that step's
        bucket sizes and unit roundoff."""
        if isinstance(rows, np.ndarray):
            step = _parse_array(rows, n_ratios)
        elif sum(map(len, rows)) <= LOOP_MAX:
            step = _parse_lists([r if isinstance(r, list) else list(r) for r in rows], n_ratios)
        else:
            step = _parse_array(np.asarray(rows, dtype=np.float64), n_ratios)
        found: list[StepCheckFinding] = []
        if not step.finite:
            # A non-finite loss or gradient element on some rank: an overflow the scaler
            # handles, or a NaN the non-finite check names. Neither a test nor a lesson here.
            self.nonfinite_steps += 1
            return found
        self.tested_steps += 1
        n_buckets, ratios = step.n_buckets, step.ratios
        if self._check_reduction and n_buckets:
            reduction = check_reduction(
                step.sums, step.norms, step.reduced, list(numel) or [0] * n_buckets, u
            )
            if reduction is not None:
                detail = {**reduction.to_detail(), "unit_roundoff": u}
                found.append(
                    StepCheckFinding(
                        Layer.ALLREDUCE, Phase.POST_ALLREDUCE, reduction.suspects, detail
                    )
                )
        if self.abft is not None and n_ratios:
            abft = self._abft_finding(ratios)
            if abft is not None:
                found.append(abft)
        # the buckets' sizes name the layout (a count alone misses DDP's rebuilt buckets)
        layout = tuple(numel) if len(numel) == n_buckets else n_buckets
        self.detector.reset_if_layout_changed(layout)
        names = _statistic_names(n_buckets)
        clean = not found  # the histories learn a step no layer found anything in
        stats = self.detector.test_learn_table(names, step.values, learn=clean)
        if stats:
            lead = max(stats, key=lambda f: f.deviation / f.threshold)
            phase = Phase.LOSS if lead.statistic == "loss" else Phase.PRE_ALLREDUCE
            found.append(
                StepCheckFinding(
                    Layer.GRADSTATS,
                    phase,
                    tuple(sorted(f.rank for f in stats)),
                    {
                        "test": lead.test,
                        "statistic": f"log {lead.statistic}",
                        "bucket": lead.bucket,
                        "deviation": round(lead.deviation, 6),
                        "threshold": round(lead.threshold, 6),
                        "k": self.config.k,
                        "floor_factor": self.config.floor_factor,
                        "warmup": self.config.warmup,
                        "per_rank": [f.to_detail() for f in stats],
                        "evidence": WEAKER,
                    },
                )
            )
        return found

    def _abft_finding(self, ratios: Sequence[Sequence[float]]) -> StepCheckFinding | None:
        """The checksums' finding: a ratio above ``abft_margin`` (every ratio is counted in
        units of its own rounding bound, :mod:`detection.stepcheck.abft_bound`, so one tolerance for
        all, from the first step, learnt from nothing)."""
        if self.abft is None:
            return None
        tau = self.config.abft_margin
        worst: tuple[float, int, int] | None = None
        suspects = set()
        for rank, per in enumerate(ratios):
            for i, value in enumerate(per):
                if value > tau:
                    suspects.add(rank)
                    score = value / tau if math.isfinite(value) else math.inf
                    if worst is None or score > worst[0]:
                        worst = (score, rank, i)
        if worst is None:
            return None
        _, rank, i = worst
        layer, direction = divmod(i, 2)
        value = ratios[rank][i]
        return StepCheckFinding(
            Layer.ABFT,
            Phase.FORWARD if direction == 0 else Phase.BACKWARD,
            tuple(sorted(suspects)),
            {
                "check": "forward row checksum" if direction == 0 else "weight-gradient checksum",
                "module": self.abft.names[layer],
                "statistic": value if math.isfinite(value) else "inf",
                "threshold": tau,
                "tolerance": "tau * the rounding bound of the layer's arithmetic (abft_bound)",
                "evidence": "algebraic, on the suspect rank's own computation",
            },
        )
