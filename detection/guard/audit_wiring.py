"""The guard's audit wiring: one step's state, the partner replay and the scaler's overflows.

:class:`~detection.guard.SDCGuard` keeps the training-loop protocol; this module runs what an
audited step adds on top of it, on weights still as they were before any optimizer updated
them (the caller's invariant: it runs at the end of the step's last backward):

* ship the micro-batches a loop handed over with ``batch=`` to their auditor
  (:mod:`detection.audit.batches`), since a partner cannot recompute them from a pure function;
* replay the partner's micro-batches (:mod:`detection.audit.ring`) — and, while the guard
  calibrates, the rank's own twice (:mod:`detection.audit.calibration`) — into one row each;
* under a GradScaler, resolve a non-finite local gradient seen on some ranks only by
  recomputing those ranks' micro-batches at the same scale (:mod:`detection.audit.overflow`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from detection.audit.batches import exchange_batches
from detection.audit.overflow import recompute_flagged
from detection.audit.recompute import AutocastState
from detection.audit.ring import AuditMode, PartnerRecompute
from detection.guard.comm_hook import CheckedCommHook, NonFiniteVerdict
from detection.guard.config import GuardConfig, GuardUsageError
from detection.guard.counters import GuardCounters

__all__ = ["AuditWiring", "StepState"]


@dataclass
class StepState:
    """What the guard records during one ``guard.step`` block."""

    step: int
    audit: bool
    seed: int = (
        0  # the seed of micro-batch 0 (``step_seed``): taken at the step's start and forward
    )
    loss_micro: int = 0  # the micro-batch whose loss the row carries (the audited one)
    micro: int = 0  # backward calls so far
    loss: torch.Tensor | None = None
    recomputed: torch.Tensor | None = None
    self_replays: torch.Tensor | None = None  # calibration: own micro-batch replayed twice
    forwards: set[int] = field(default_factory=set)  # micro-batches whose forward started
    autocast: dict[int, AutocastState] = field(default_factory=dict)
    batches: dict[int, Any] = field(default_factory=dict)  # own, when the loop passes batch=
    shipped: dict[int, Any] | None = None  # the partner's, received on audited steps
    scale: torch.Tensor | None = None  # the GradScaler scale of this step's backward
    mean_loss: torch.Tensor | None = None  # Σ of the micro-batches' losses / micro_batches
    stepped: set[int] = field(default_factory=set)  # id() of the optimizers that stepped


class AuditWiring:
    """The audit of one guard: partner replay, calibration self-replays, overflow recompute.

    ``microbatch`` is the loop's pure batch function, or ``None`` when batches are handed to
    ``guard.backward(batch=...)`` (then they are shipped). ``positions``: the indices of the
    parameters DDP buckets (what an overflow recompute compares)."""

    def __init__(
        self,
        recompute: PartnerRecompute,
        *,
        config: GuardConfig,
        hook: CheckedCommHook,
        counters: GuardCounters,
        partners: Sequence[int],
        auditors: Sequence[int],
        rank: int,
        world_size: int,
        microbatch: Any,
        positions: Sequence[int],
        device: torch.device,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.recompute = recompute
        self.config = config
        self.hook = hook
        self.counters = counters
        self.partners = list(partners)
        self.auditors = list(auditors)
        self.rank = rank
        self.world_size = world_size
        self.microbatch = microbatch
        self.positions = list(positions)
        self.device = device
        self.group = group
        self.micro_batches = config.micro_batches

    def micros(self, current: StepState) -> list[int]:
        """The micro-batches an audit of ``current`` replays: the audited one in loss mode,
        the whole group in gradient mode."""
        if self.config.mode is AuditMode.LOSS:
            return [current.loss_micro]
        return list(range(self.micro_batches))

    def run(self, current: StepState, *, armed: bool) -> None:
        """Replay the partner (collective when batches are shipped), once per step; before
        the guard is ``armed`` also replay the rank's own micro-batches twice."""
        if not current.audit or current.recomputed is not None:
            return
        if not current.forwards:
            raise GuardUsageError(
                "no forward pass of the model the guard was given inside this guarded step: "
                "call the model you passed to SDCGuard (or its compiled form)"
            )
        micros = self.micros(current)
        if self.microbatch is None:
            auditor = self.auditors[self.rank]
            mine = [current.batches[m] for m in micros]
            received = exchange_batches({auditor: mine}, device=self.device, group=self.group)
            self.counters.batches_shipped += len(mine)
            got = received[self.partners[self.rank]]
            current.shipped = dict(zip(micros, got, strict=True))
        partition = self.hook.partition()
        if not armed:
            # Calibration: the rank replays its own micro-batch twice as well, so a loop that
            # cannot be replayed is told apart from a rank that computes wrong.
            partner = self.recompute.partner
            try:
                self.recompute.partner = self.rank
                runs = [
                    self._recompute_row(current, partition, micros, own_batches=True, keep=True)
                    for _ in range(2)
                ]
            finally:
                self.recompute.partner = partner
            current.self_replays = torch.cat(runs)
        current.recomputed = self._recompute_row(current, partition, micros, own_batches=False)

    def _recompute_row(
        self,
        current: StepState,
        partition: Sequence[Sequence[int]],
        micros: Sequence[int],
        *,
        own_batches: bool,
        keep: bool = False,
    ) -> torch.Tensor:
        """One replay's row; ``keep``: leave the buffer snapshot for another replay."""
        batches = current.batches if own_batches else current.shipped
        if own_batches and self.microbatch is not None:
            batches = None
        snapshot = self.recompute.buffers.duplicate() if keep else None
        row = self.recompute.run(
            current.step,
            partition,
            micros=micros,
            loss_micro=current.loss_micro,
            batches=batches,
            autocast=current.autocast,
            scale=current.scale,
        )
        if snapshot is not None:
            self.recompute.buffers.restore(snapshot)
        return row

    def account_for_scaler(
        self, current: StepState, nonfinite: NonFiniteVerdict | None
    ) -> tuple[NonFiniteVerdict | None, dict[str, Any], bool]:
        """Under a GradScaler a non-finite local gradient is normally an overflow the scaler
        handles (it skips the step and lowers the scale), not SDC. On every rank it is taken as
        one; on some ranks only, each such rank's micro-batches are recomputed by its auditor
        at the same scale (collective): non-finite there too is an overflow, finite is SDC and
        stays a finding naming the rank."""
        if current.scale is None or nonfinite is None or not nonfinite.pre_ranks:
            return nonfinite, {}, False
        flagged = list(nonfinite.pre_ranks)
        if len(flagged) == self.world_size:
            self.counters.overflow_steps += 1
            return None, {}, True
        finite = self._recompute_flagged(current, flagged)
        self.counters.overflow_resolutions += 1
        sdc = tuple(r for r in flagged if finite[r])
        if not sdc:
            self.counters.overflow_steps += 1
            return None, {}, True
        detail = {
            "scaler": "recomputed at the same scale on the auditor: finite, so not an overflow",
            "recomputed_by": {str(r): self.auditors[r] for r in sdc},
        }
        return NonFiniteVerdict(nonfinite.phase, sdc, sdc, nonfinite.post_ranks), detail, False

    def _recompute_flagged(self, current: StepState, flagged: Sequence[int]) -> list[int]:
        """``finite[r]`` for each flagged rank ``r``, as recomputed by ``r``'s auditor."""
        finite, shipped = recompute_flagged(
            self.recompute,
            flagged,
            step=current.step,
            partners=self.partners,
            micros=list(range(self.micro_batches)),
            own_batches=current.batches if self.microbatch is None else None,
            positions=self.positions,
            autocast=current.autocast,
            scale=current.scale,
            group=self.group,
        )
        self.counters.batches_shipped += shipped
        return finite
