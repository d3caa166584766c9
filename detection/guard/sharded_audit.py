"""The ring audit of an FSDP2 / HSDP model, in loss mode, with calibration.

On an audited step every rank recomputes its ring partner's micro-batch loss
(:func:`~detection.audit.ring.ring_partners`) and the decision compares it bit for bit with the
loss the partner reported in its row: a corruption of one rank's forward — an activation,
a kernel's result, a gathered weight used in its compute — changes its loss and not the
auditor's recomputation. The replay runs

* after the step's last backward and before any optimizer updates a shard: on the weights the
  original forward used;
* through the sharded model itself, on every rank at the same moment, so that the replays'
  all-gathers line up (:mod:`detection.guard.sharded_replay`, which also keeps FSDP2's state);
* on the partner's micro-batch — ``microbatch(step, rank[, micro])`` (a pure function) or the
  batch the partner handed to ``guard.backward(loss, batch=...)``, shipped to its auditor
  (:mod:`detection.audit.batches`);
* from the RNG state the partner's forward started from: with the audit on, a forward pre-hook
  seeds each micro-batch's first forward with ``step_seed(seed, step, rank, micro)`` and the
  replay seeds the partner's value at the same point; under the autocast state that forward
  ran in; with the buffers it saw.

With accumulation a loss audit replays one micro-batch per step, a different one each audit
(as for DDP). Attribution is the DDP audit's (:func:`~detection.audit.ring.attribute_audit`):
a mismatching pair names auditor and audited, a rank wrong in both roles stands out alone.

Calibration (``GuardConfig(calibrate=N)``): the first ``N`` audits also replay each rank's own
micro-batch twice; a loop whose loss does not reproduce itself bitwise refuses to arm
(:class:`~detection.audit.calibration.NotReplayableError`, on every rank alike) instead of
raising an alarm, exactly as under DDP.

Gradient mode is refused: a rank's own gradient goes straight into FSDP2's reduce-scatter,
which mixes every rank's gradient into each shard; replaying a partner's gradient would need
a second backward through FSDP2, whose hooks reduce-scatter into ``.grad``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from detection.audit.attribution import attribute_pairs
from detection.audit.batches import exchange_batches
from detection.audit.calibration import NotReplayableError, calibration_causes
from detection.audit.recompute import AutocastState, BufferSnapshot
from detection.audit.ring import (
    AuditMode,
    AuditVerdict,
    attribute_audit,
    auditors_of,
    encode_loss,
    ring_partners,
    seed_rng,
    step_seed,
)
from detection.gate import StepOutcome
from detection.guard.config import GuardConfig, GuardConfigError, GuardUsageError
from detection.guard.counters import GuardCounters
from detection.guard.sharded_decision import Row, ShardedDecision, word_float
from detection.guard.sharded_replay import LossFn, fsdp_modules, replay_loss
from detection.row.gather import all_gather_rows
from detection.transport.alarm import Alarm, Layer, Phase

__all__ = ["AuditStep", "ShardedAudit", "refuse_audit_config", "replicas_apart"]

_log = logging.getLogger(__name__)


def refuse_audit_config(config: GuardConfig, loss_fn: LossFn | None) -> None:
    """What the sharded ring audit cannot run, refused at construction (saying why)."""
    if config.audit_every > 0 and config.mode is AuditMode.GRADIENT:
        raise GuardConfigError(
            "audit_mode='gradient' is not available on an FSDP2/HSDP model: each rank's own "
            "gradient goes straight into FSDP2's reduce-scatter, which mixes every rank's "
            "gradient into each shard, so a partner's gradient could only be replayed by a "
            "second backward through FSDP2, whose hooks reduce-scatter into .grad; audit in "
            "audit_mode='loss'"
        )
    if config.audit_every > 0 and loss_fn is None:
        raise GuardConfigError(
            "the ring audit replays loss_fn(model, batch): pass SDCGuard(..., loss_fn=loss_fn)"
        )


def replicas_apart(decision: ShardedDecision) -> Callable[[int, int], bool]:
    """``apart(a, b)``: whether ranks ``a`` and ``b`` compute with copies of the model that an
    alarm already named as different — some shard's replicas ``a`` and ``b`` read are known
    apart (HSDP; under pure FSDP2 every rank reads the one copy: never)."""
    replica = {r: i for group in decision.replicas.groups for i, r in enumerate(group)}

    def apart(a: int, b: int) -> bool:
        return any(
            decision.known[g].apart(replica[a], replica[b]) for g in decision.replicas.groups
        )

    return apart


@dataclass
class AuditStep:
    """What one guarded step records for its audit."""

    step: int
    audited: bool
    loss_micro: int = 0  # the micro-batch whose loss is audited
    micro: int = 0  # backward calls so far
    forwards: set[int] = field(default_factory=set)  # micro-batches whose forward started
    autocast: dict[int, AutocastState] = field(default_factory=dict)
    batches: dict[int, Any] = field(default_factory=dict)  # own, handed over with batch=
    own: torch.Tensor | None = None  # the audited micro-batch's loss bits
    recomputed: torch.Tensor | None = None  # the partner's, replayed here
    self_replays: torch.Tensor | None = None  # calibration: own micro-batch replayed twice


class ShardedAudit:
    """The ring audit of one sharded guard: hooks, replays, and its part of the decision.

    ``model``: what the loop calls (its forward pre-hook sees each micro-batch start);
    ``root``: the ``fully_shard``-ed root module. Every rank decides alike from the rows."""

    def __init__(
        self,
        model: nn.Module,
        root: nn.Module,
        *,
        loss_fn: LossFn,
        microbatch: Callable[..., Any] | None,
        config: GuardConfig,
        counters: GuardCounters,
        nodes: Sequence[str],
        rank: int,
        device: torch.device,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.modules = fsdp_modules(root)
        self.loss_fn = loss_fn
        self.microbatch = microbatch
        self.config = config
        self.counters = counters
        self.nodes = tuple(nodes)
        self.rank = rank
        self.device = device
        self.extra = dict(extra or {})
        self.partners = ring_partners(self.nodes)
        self.auditors = auditors_of(self.partners)
        self.every = config.audit_every if len(self.nodes) > 1 else 0
        self.micro_batches = config.micro_batches
        self.buffers = BufferSnapshot(root)
        self.current: AuditStep | None = None
        self._replay_seed: int | None = None
        self._handle = model.register_forward_pre_hook(self._before_forward)

    @property
    def armed(self) -> bool:
        """Whether a mismatch is an alarm: calibration is over (or was not asked for)."""
        return self.counters.calibration_audits >= self.config.calibrate

    @property
    def recomputing(self) -> bool:
        """Whether the model's forward now running is a replay of a micro-batch (the audit's
        of a partner's, the calibration's of this rank's own), not the rank's training step."""
        return self._replay_seed is not None

    def describe(self) -> str:
        """The audit in words, for the guard's coverage line."""
        return f"ring audit of the loss every {self.every} steps (partner {self.partner})"

    @property
    def partner(self) -> int:
        return self.partners[self.rank]

    # -- the step ----------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        audited = self.every > 0 and step % self.every == 0
        self.current = AuditStep(step, audited)
        if audited:
            self.current.loss_micro = (step // self.every) % self.micro_batches

    def end_step(self) -> None:
        self.current = None
        self.buffers.clear()

    def _before_forward(self, _module: nn.Module, _args: Any) -> None:
        if self._replay_seed is not None:  # a replay's forward starts where the original's did
            seed_rng(self._replay_seed, self.device)
            return
        current = self.current
        if current is None or current.micro >= self.micro_batches:
            return
        micro = current.micro
        if micro in current.forwards:
            return
        current.forwards.add(micro)
        seed_rng(step_seed(self.config.seed, current.step, self.rank, micro), self.device)
        current.autocast[micro] = AutocastState.capture()
        if current.audited and micro == current.loss_micro:
            self.buffers.capture()  # the buffers the audited forward starts from

    def record(self, loss: torch.Tensor, batch: Any) -> None:
        """``guard.backward(loss, batch=...)`` of the open step's next micro-batch."""
        current = self._open("guard.backward()")
        if batch is None and self.microbatch is None:
            raise GuardUsageError(
                "no microbatch(step, rank) function was given: pass the batch the loss came "
                "from, guard.backward(loss, batch=batch), so the auditor can recompute it"
            )
        if batch is not None:
            current.batches[current.micro] = batch
        if current.micro == current.loss_micro:
            current.own = encode_loss(loss)
        current.micro += 1

    def run(self) -> None:
        """After the step's last backward, before any update: replay the partner's audited
        micro-batch (and, while calibrating, this rank's own twice). Collective."""
        current = self._open("guard.backward()")
        if not current.audited or current.recomputed is not None:
            return
        if current.loss_micro not in current.forwards:
            raise GuardUsageError(
                "no forward pass of the model the guard was given for the audited micro-batch: "
                "call the model you passed to SDCGuard (or its compiled form) in loss_fn"
            )
        micro = current.loss_micro
        partner_batch = self._partner_batch(current, micro)
        if not self.armed:
            own = self._batch(current.step, self.rank, micro, current.batches)
            runs = [self._replay(current, self.rank, own, keep=True) for _ in range(2)]
            current.self_replays = torch.cat(runs)
        current.recomputed = self._replay(current, self.partner, partner_batch, keep=False)

    def _partner_batch(self, current: AuditStep, micro: int) -> Any:
        if self.microbatch is not None:
            return self._batch(current.step, self.partner, micro, {})
        mine = [current.batches[micro]]
        received = exchange_batches({self.auditors[self.rank]: mine}, device=self.device)
        self.counters.batches_shipped += 1
        return received[self.partner][0]

    def _batch(self, step: int, rank: int, micro: int, handed: dict[int, Any]) -> Any:
        if micro in handed:
            return handed[micro]
        if self.microbatch is None:
            raise GuardUsageError("no microbatch(step, rank) function and no batch handed over")
        if self.micro_batches > 1:
            return self.microbatch(step, rank, micro)
        return self.microbatch(step, rank)

    def _replay(self, current: AuditStep, owner: int, batch: Any, *, keep: bool) -> torch.Tensor:
        snapshot = self.buffers.duplicate() if keep else None
        micro = current.loss_micro
        bits = replay_loss(
            self.model,
            self.modules,
            self.loss_fn,
            batch,
            seed=step_seed(self.config.seed, current.step, owner, micro),
            autocast=current.autocast.get(micro, AutocastState.off()),
            buffers=self.buffers,
            device=self.device,
            on_seed=self._set_replay_seed,
        )
        if snapshot is not None:
            self.buffers.restore(snapshot)
        return bits

    def _set_replay_seed(self, value: int | None) -> None:
        self._replay_seed = value

    def words(self) -> list[torch.Tensor]:
        """The row's two audit words (0-d int64 on the device): own loss bits and the
        partner's recomputed, zeros on a step without an audit."""
        current = self.current
        zero = torch.zeros((), dtype=torch.int64, device=self.device)
        if current is None or not current.audited or current.recomputed is None:
            return [zero, zero]
        own = current.own.to(self.device).reshape(()) if current.own is not None else zero
        return [own, current.recomputed.to(self.device).reshape(())]

    # -- the decision ------------------------------------------------------------------------------
    def decide(
        self, rows: Sequence[Row], outcome: StepOutcome, apart: Callable[[int, int], bool]
    ) -> StepOutcome:
        """The step's outcome with the audit's verdict (collective on calibration audits).
        ``apart(a, b)``: ranks ``a`` and ``b`` are known (alarmed) to compute with different
        weights — their mismatch is that divergence's consequence, not a new event."""
        current = self.current
        if current is None or not current.audited:
            return outcome
        own = [[r.audited_loss, 0, 0] for r in rows]
        replayed = [[r.replayed_loss, 0, 0] for r in rows]
        # NaN is bit-equal to NaN: an audit over non-finite values proves nothing
        finite = all(
            math.isfinite(word_float(r.audited_loss)) and not (r.grad_nonfinite or r.own_nonfinite)
            for r in rows
        )
        if current.self_replays is not None:
            self._calibrate(current, own, replayed, finite)
        verdict = attribute_audit(self.partners, own, replayed, self.nodes)
        passed = verdict.passed and finite
        self.counters.audits += 1
        self.counters.audits_passed += int(passed)
        self.counters.audits_inconclusive += int(not finite)
        alarm = outcome.alarm
        new = not all(apart(a, b) for a, b in verdict.mismatches)
        if alarm is None and finite and not verdict.passed and new:
            alarm = self._alarm(current.step, verdict)
        return dataclasses.replace(
            outcome,
            audit=AuditMode.LOSS,
            audit_passed=passed,
            alarm=alarm,
            vote_passed=outcome.vote_passed and alarm is None,
        )

    def _calibrate(
        self,
        current: AuditStep,
        own: Sequence[Sequence[int]],
        replayed: Sequence[Sequence[int]],
        finite: bool,
    ) -> None:
        """Every rank's two self-replays against its own loss: a loop that does not reproduce
        itself refuses to arm, on every rank alike."""
        assert current.self_replays is not None
        mine = current.self_replays.tolist()
        row = torch.tensor([mine[0], 0, 0, mine[1], 0, 0], dtype=torch.int64, device=self.device)
        selves = all_gather_rows(row)
        if not finite:
            return  # non-finite values prove nothing either way: not a clean audit
        causes = calibration_causes(current.step, self.partners, own, replayed, selves, mode="loss")
        if causes:
            raise NotReplayableError(
                f"the audit refuses to arm after {self.counters.calibration_audits} clean "
                f"calibration audit(s) of {self.config.calibrate}: " + " | ".join(causes)
            )
        self.counters.calibration_audits += 1
        if self.armed:
            _log.info(
                "sdcguard armed after %d clean audits",
                self.config.calibrate,
                extra={**self.extra, "step": current.step},
            )

    def _alarm(self, step: int, verdict: AuditVerdict) -> Alarm:
        lone = len(verdict.mismatches) == 1
        return Alarm.for_ranks(
            step,
            Layer.AUDIT,
            Phase.LOSS,
            verdict.suspects,
            self.nodes,
            {
                "mode": str(AuditMode.LOSS),
                "mismatched_pairs": [{"auditor": a, "audited": b} for a, b in verdict.mismatches],
                "attribution": "a single disagreeing pair: either side may have erred"
                if lone
                else "the smallest set of nodes explaining every disagreeing pair",
                **attribute_pairs(verdict.mismatches, self.nodes).to_detail(),
            },
        )

    def _open(self, what: str) -> AuditStep:
        if self.current is None:
            raise GuardUsageError(f"{what} outside a guard.step() block")
        return self.current

    def close(self) -> None:
        self._handle.remove()
