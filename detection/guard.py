"""``SDCGuard``: the few lines a DDP training script adds to catch silent data corruption.

::

    guard = SDCGuard(ddp_model, optimizer, microbatch=microbatch, loss_fn=loss_fn,
                     config=GuardConfig(audit_every=10, audit_mode="loss", seed=seed))
    for step in range(start, steps):
        with guard.step(step):                     # seeds dropout per (seed, step, rank)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(ddp_model, microbatch(step, rank))
            guard.backward(loss)                   # records the loss, runs loss.backward()
            optimizer.step()                       # audit replay runs just before the update
        if guard.halted:
            break

What runs where, per step:

* backward — the comm hook (:mod:`detection.nonfinite`) sums each bucket before and after
  all-reduce (and, on audited gradient steps, fingerprints the local bucket);
* ``optimizer.step`` pre-hook — on audited steps the partner's micro-batch is recomputed on
  the unwrapped module (:mod:`detection.audit`), weights still as they were before the update;
* ``optimizer.step`` post-hook — injected weight / optimizer-state faults (tests and demos);
* leaving ``guard.step`` — the weight fingerprint (and, if configured, the optimizer state's);
  then one all-gather of a small int64 row per rank and one host synchronisation, from which
  every rank reaches the same decision: at most one :class:`~detection.alarm.Alarm` per step,
  reported once per job by the lowest non-suspect rank.

Everything before the all-gather stays on the device: no host copy of weights or gradients.

Consequences are not new events, and nothing else is suppressed: once an alarm named replicas
as diverged, the same divergence at later steps (and audit mismatches between replicas known to
differ) is not raised again, while a new split among replicas still equal is; once a non-finite
gradient was applied and the weights are actually non-finite, the steps computed from them are
the same event. A non-finite gradient the loop skipped poisons nothing. Persistent buffers are
checked where replicas must agree (:mod:`detection.buffercheck`) and are part of the checkpoint
fingerprint.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detection.alarm import Alarm, Layer, Phase
from detection.attribution import attribute_pairs
from detection.audit import (
    AuditMode,
    AuditVerdict,
    PartnerReplay,
    attribute_audit,
    auditors_of,
    encode_loss,
    ring_partners,
    seed_rng,
    step_seed,
)
from detection.buffercheck import BUFFER_ROW, BufferWatch, buffer_finding
from detection.faults import FaultInjector, FaultSpec
from detection.fingerprint import Fingerprint, FingerprintPlan, fingerprint_on_device
from detection.gate import CheckpointGate, StepOutcome
from detection.nonfinite import (
    CheckedCommHook,
    CommHook,
    NonFiniteVerdict,
    attribute_nonfinite,
)
from detection.vote import (
    KnownDivergence,
    VoteVerdict,
    all_gather_rows,
    majority_vote,
    model_state_tensors,
    optimizer_state_tensors,
    to_fingerprint,
    verify_after_load,
)

__all__ = [
    "AlarmSink",
    "GuardConfig",
    "GuardConfigError",
    "GuardError",
    "GuardHaltedError",
    "GuardUsageError",
    "Identity",
    "SDCGuard",
]

_log = logging.getLogger(__name__)

# Layout of the row each rank contributes to the per-step all-gather.
_STEP, _PRE, _POST = 0, 1, 2
_W = slice(3, 5)  # weight fingerprint after the step
_S = slice(5, 7)  # optimizer-state fingerprint after the step
_OWN = slice(7, 10)  # own [loss bits, local-gradient fingerprint a, b]
_REPLAY = slice(10, 13)  # the same three values recomputed for the partner
_NF = 13  # bit 0: optimizer.step ran; bit 1: weights non-finite (checked after a NaN step)
_BUF = slice(14, 14 + BUFFER_ROW)  # persistent buffers (detection.buffercheck)
_ROW = 14 + BUFFER_ROW
_STEPPED, _WEIGHTS_NONFINITE = 1, 2


class GuardError(RuntimeError):
    """Base of the guard's own errors."""


class GuardConfigError(GuardError):
    """The guard cannot be set up as asked (inconsistent ranks, hook already taken, ...)."""


class GuardUsageError(GuardError):
    """The training loop broke the guard's protocol (see :class:`SDCGuard`)."""


class GuardHaltedError(GuardError):
    """A step was started after the guard halted the job on an alarm."""


@dataclass(frozen=True)
class GuardConfig:
    """What the guard does; identical on every rank (checked at start-up).

    ``audit_every``: ring audit on steps with ``step % audit_every == 0`` (0: never).
    ``seed``: dropout seeds derive from (seed, step, rank) — the audit's replay needs them.
    ``vote_optimizer_state``: vote on the optimizer state as well as the weights. Off by
    default: replicas apply the same update to the same state, so a corrupted state shows in
    the weights at the next update — the step whose weights come out wrong, which is then the
    alarm's step — while reading Adam's state would triple the vote's memory traffic. On, the
    alarm names the step that wrote the bad state, and also catches state that never reaches
    the weights (a second moment whose first moment stays zero).
    ``halt_on_alarm`` (on by default): set :attr:`SDCGuard.halted` after the step that raised
    an alarm, so the loop stops on weights that may be corrupt (``guard.step`` refuses further
    steps). Off, the guard keeps checking and raises each new event once.
    ``inject``: fault specs (``--inject`` syntax) for tests and demos.
    """

    audit_every: int = 0
    audit_mode: AuditMode | str = AuditMode.LOSS
    seed: int = 0
    vote_optimizer_state: bool = False
    halt_on_alarm: bool = True
    inject: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.audit_every < 0:
            raise GuardConfigError(f"audit_every must be ≥ 0, got {self.audit_every}")
        try:
            object.__setattr__(self, "audit_mode", AuditMode(self.audit_mode))
        except ValueError:
            raise GuardConfigError(
                f"audit_mode must be 'loss' or 'gradient', got {self.audit_mode!r}"
            ) from None
        object.__setattr__(self, "inject", tuple(self.inject))

    @property
    def mode(self) -> AuditMode:
        """``audit_mode`` as the enum (it is normalised to one on construction)."""
        return AuditMode(self.audit_mode)
        for spec in self.inject:
            FaultSpec.parse(spec)


class Identity(Protocol):
    """What the guard needs of a rank's identity (``detection.identity.RankIdentity``)."""

    @property
    def node(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


class AlarmSink(Protocol):
    """What the guard needs of the alarm sender (``detection.sender.AlarmSender``)."""

    def send_alarm(self, body: dict[str, Any]) -> str: ...

    def register_ranks(self, ranks: list[dict[str, Any]]) -> None: ...


def _any_nonfinite(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """1 (int64, on the device) when any floating-point parameter holds a NaN or an infinity."""
    flags = [torch.isfinite(p.detach()).all() for p in params if p.is_floating_point()]
    if not flags:
        return torch.zeros((), dtype=torch.int64, device=params[0].device)
    return (~torch.stack(flags).all()).to(torch.int64)


def _state_fingerprint(weights: Sequence[int], buffers: Sequence[int]) -> Fingerprint:
    """Weights plus buffers: buffers are numbered after the parameters, so the sum of the two
    fingerprints is that of ``model_state_tensors`` (what a checkpoint holds)."""
    w, b = to_fingerprint(*weights), to_fingerprint(*buffers)
    return to_fingerprint(w.a + b.a, w.b + b.b)


class _Finding(NamedTuple):
    layer: Layer
    phase: Phase
    suspects: tuple[int, ...]
    detail: dict[str, Any]


def _nonfinite_finding(verdict: NonFiniteVerdict) -> _Finding:
    reason = (
        "non-finite local gradient"
        if verdict.pre_ranks
        else "non-finite gradient after all-reduce from finite local gradients"
    )
    return _Finding(
        Layer.NONFINITE,
        verdict.phase,
        verdict.suspects,
        {
            "pre_allreduce_ranks": list(verdict.pre_ranks),
            "post_allreduce_ranks": list(verdict.post_ranks),
            "reason": reason,
        },
    )


@dataclass
class _Step:
    step: int
    audit: bool
    loss: torch.Tensor | None = None
    replay: torch.Tensor | None = None
    snapshot_taken: bool = False
    optimizer_stepped: bool = False


class SDCGuard:
    """Detection for one DDP model and its optimizer, in every rank.

    Protocol (violations raise :class:`GuardUsageError`): each training step runs inside
    ``with guard.step(step)``; the loss goes through :meth:`backward`; ``optimizer.step()``
    is called at most once, inside the block; one micro-batch per rank per step, produced by
    ``microbatch(step, rank)`` — a pure function, since a partner recomputes it — and turned into
    a scalar loss by ``loss_fn(model, batch)``, which must accept the unwrapped module too.

    ``comm_hook``/``comm_state``: a DDP communication hook of your own; the guard wraps it
    (register it here, not on the model: DDP accepts only one hook).
    """

    def __init__(
        self,
        model: DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        *,
        microbatch: Callable[[int, int], Any],
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        config: GuardConfig | None = None,
        identity: Identity | None = None,
        sender: AlarmSink | None = None,
        gate: CheckpointGate | None = None,
        job_id: str = "local",
        comm_hook: CommHook | None = None,
        comm_state: Any = None,
    ) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise GuardConfigError("SDCGuard needs the DistributedDataParallel-wrapped model")
        if getattr(model, "_comm_hooks", None):
            raise GuardConfigError(
                "the model already has a comm hook; pass it as SDCGuard(comm_hook=..., "
                "comm_state=...) so the guard can wrap it"
            )
        self.config = config or GuardConfig()
        self.model = model
        self.module: nn.Module = model.module
        self.optimizer = optimizer
        self.microbatch = microbatch
        self.loss_fn = loss_fn
        self.sender = sender
        self.gate = gate
        self.job_id = job_id
        self.group: dist.ProcessGroup | None = model.process_group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.params = list(self.module.parameters())
        if not self.params:
            raise GuardConfigError("the model has no parameters")
        self.device = self.params[0].device
        self.node: str = identity.node if identity is not None else socket.gethostname()
        self.nodes, identities = self._agree(identity)
        self.partners = ring_partners(self.nodes)
        self.auditors = auditors_of(self.partners)
        self.audit_every = self.config.audit_every if self.world_size > 1 else 0
        self.alarms: list[Alarm] = []
        self.halted = False
        self.last_outcome: StepOutcome | None = None
        self._current: _Step | None = None
        self._poison_possible = False  # a non-finite step was applied: weights may be NaN
        self._known = KnownDivergence()  # replicas known (alarmed) to hold different weights
        self._replaying = False
        self.state_tensors = model_state_tensors(self.module)
        self._weights_fingerprint = FingerprintPlan(self.params)
        self._zeros = torch.zeros(3, dtype=torch.int64, device=self.device)  # never written
        self.buffers = BufferWatch(
            self.module,
            start=sum(p.numel() for p in self.params),
            broadcast=bool(getattr(model, "broadcast_buffers", True)),
            rank=self.rank,
            device=self.device,
        )
        self._extra = {"job": job_id, "rank": self.rank, "node": self.node}

        if self.config.mode is AuditMode.GRADIENT and self.audit_every:
            self._check_determinism_possible()
        specs = [FaultSpec.parse(s) for s in self.config.inject]
        self.injector = FaultInjector(specs, rank=self.rank, node=self.node) if specs else None
        if self.injector is not None:
            self.injector.bind(self.module)
        self.hook = CheckedCommHook(
            self.params,
            process_group=self.group,
            inner=comm_hook,
            inner_state=comm_state,
            injector=self.injector,
        )
        self.hook.register(model)
        self.replay = PartnerReplay(
            self.module,
            loss_fn=loss_fn,
            microbatch=microbatch,
            mode=self.config.mode,
            seed=self.config.seed,
            partner=self.partners[self.rank],
            injector=self.injector,
        )
        self._handles = [
            optimizer.register_step_pre_hook(self._before_optimizer_step),
            optimizer.register_step_post_hook(self._after_optimizer_step),
            self.module.register_forward_pre_hook(self._before_forward),
            self.module.register_forward_hook(self._after_forward),
        ]
        if sender is not None and self.rank == 0:
            sender.register_ranks(identities)
        _log.info(
            "sdcguard armed: audit every %d (%s), partner %d, nodes %s",
            self.audit_every,
            self.config.mode,
            self.partners[self.rank],
            self.nodes,
            extra=self._extra,
        )

    # -- set-up ------------------------------------------------------------------------------------
    def _agree(self, identity: Identity | None) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
        """Gather every rank's node, identity, thread count and config once; refuse to start
        when they disagree, since bitwise replay needs the same intra-op thread count and an
        identical guard configuration everywhere."""
        if identity is not None:
            ident = dict(identity.to_dict())
        else:
            ident = {"rank": self.rank, "local_rank": self.rank, "node": self.node}
        mine = (self.node, torch.get_num_threads(), repr(self.config), ident)
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        threads = {t for _, t, _, _ in everyone}
        if len(threads) > 1:
            raise GuardConfigError(
                f"ranks run with different intra-op thread counts {sorted(threads)}: replays "
                "would not be bitwise; call torch.set_num_threads with the same value everywhere"
            )
        if len({c for _, _, c, _ in everyone}) > 1:
            raise GuardConfigError("ranks were given different GuardConfig values")
        return tuple(n for n, _, _, _ in everyone), [i for _, _, _, i in everyone]

    def _check_determinism_possible(self) -> None:
        """Deterministic kernels are switched on only for audited gradient steps (see
        :meth:`_deterministic`); on CUDA they need cuBLAS configured before the process starts."""
        if self.device.type == "cuda" and not os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
            raise GuardConfigError(
                "gradient audits on CUDA need deterministic cuBLAS: set "
                "CUBLAS_WORKSPACE_CONFIG=:4096:8 before the process starts"
            )

    @contextlib.contextmanager
    def _deterministic(self, on: bool) -> Iterator[None]:
        """Deterministic algorithms for one audited gradient step — original and replay alike,
        so the replay is bitwise — and the faster defaults on every other step."""
        if not on or torch.are_deterministic_algorithms_enabled():
            yield
            return
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(False)

    def close(self) -> None:
        """Remove the guard's module and optimizer hooks (DDP cannot unregister a comm hook)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.injector is not None:
            self.injector.close()

    # -- the training-loop API ---------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Bracket one training step; on leaving, decide it (collective: all ranks)."""
        if self.halted:
            raise GuardHaltedError(f"the guard halted the job after an alarm; step {step} refused")
        if self._current is not None:
            raise GuardUsageError("guard.step() blocks do not nest")
        current = _Step(step=step, audit=self.audit_every > 0 and step % self.audit_every == 0)
        self._current = current
        seed_rng(step_seed(self.config.seed, step, self.rank), self.device)
        if self.injector is not None:
            self.injector.begin_step(step)
        gradient_audit = current.audit and self.config.mode is AuditMode.GRADIENT
        self.hook.begin_step(
            fingerprint_gradients=gradient_audit,
            inject=self.injector is not None and self.injector.any_active(),
        )
        self.buffers.begin_step()
        try:
            with self._deterministic(gradient_audit):
                yield
                self._finish(current)
        finally:
            self.hook.end_step()
            if self.injector is not None:
                self.injector.end_step()
            self.replay.buffers.clear()
            self._current = None

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, recording the loss for the audit."""
        current = self._require_step("guard.backward()")
        if loss.numel() != 1:
            raise GuardUsageError("loss_fn must return a scalar loss")
        current.loss = loss.detach()
        loss.backward()

    def verify_loaded(self, expected: Fingerprint | str) -> Fingerprint:
        """After loading a checkpoint: every replica's weights equal the recorded fingerprint
        (collective; raises :class:`~detection.vote.LoadVerificationError`)."""
        self.buffers.forget_previous()
        return verify_after_load(self.state_tensors, expected, self.group)

    # -- hooks -------------------------------------------------------------------------------------
    def _require_step(self, what: str) -> _Step:
        if self._current is None:
            raise GuardUsageError(f"{what} outside a guard.step() block")
        return self._current

    def _before_forward(self, _module: nn.Module, _args: Any) -> None:
        if not self._replaying:
            self.buffers.forward_started(self._current is not None)
        current = self._current
        if current is not None and current.audit and not current.snapshot_taken:
            # The original forward, after DDP's buffer broadcast: the replay starts from here.
            current.snapshot_taken = True
            self.replay.buffers.capture()

    def _after_forward(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        if not self._replaying:
            self.buffers.forward_finished(self._current is not None)

    def _before_optimizer_step(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        current = self._require_step("optimizer.step()")
        if current.optimizer_stepped:
            raise GuardUsageError("optimizer.step() called twice in one guarded step")
        self._run_audit(current)

    def _after_optimizer_step(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        current = self._require_step("optimizer.step()")
        current.optimizer_stepped = True
        if self.injector is not None:
            self.injector.after_optimizer_step(self.optimizer)

    def _run_audit(self, current: _Step) -> None:
        if not current.audit or current.replay is not None:
            return
        if not current.snapshot_taken and not self.replay.buffers.empty:
            raise GuardUsageError("no forward pass of the model inside this guarded step")
        self._replaying = True
        try:
            current.replay = self.replay.run(current.step, self.hook.partition())
        finally:
            self._replaying = False

    # -- the decision ------------------------------------------------------------------------------
    def _finish(self, current: _Step) -> None:
        if current.loss is None:
            raise GuardUsageError("the step's loss never went through guard.backward()")
        self._run_audit(current)  # when the loop skipped optimizer.step(), weights are unchanged
        zero2 = self._zeros[:2]
        state_fp = zero2
        if self.config.vote_optimizer_state:
            state = optimizer_state_tensors(self.optimizer, self.params)
            if state:
                state_fp = fingerprint_on_device(state).to(self.device)
        own = torch.cat([encode_loss(current.loss), self.hook.gradient_fingerprint()])
        replay = current.replay if current.replay is not None else self._zeros[:3]
        nf = torch.full(
            (1,),
            _STEPPED if current.optimizer_stepped else 0,
            dtype=torch.int64,
            device=self.device,
        )
        if self._poison_possible:  # only after a non-finite step was applied: costs a pass
            nf = nf + _WEIGHTS_NONFINITE * _any_nonfinite(self.params)
        row = torch.cat(
            [
                # a fill, not torch.tensor(..., device=): no host-to-device copy, no sync
                torch.full((1,), current.step, dtype=torch.int64, device=self.device),
                self.hook.flags(),
                self._weights_fingerprint().to(self.device),
                state_fp,
                own,
                replay,
                nf,
                self.buffers.row(),
            ]
        )
        rows = all_gather_rows(row, self.group)
        self._decide(current, rows)

    def _decide(self, current: _Step, rows: Sequence[Sequence[int]]) -> None:
        """Turn the gathered rows into at most one alarm and a step outcome — the same on every
        rank, since every rank sees the same rows.

        Only what truly follows from an alarmed event is not raised again: once a non-finite
        gradient was applied and the weights are actually non-finite, everything computed from
        them is (``poisoned``); replicas an alarm named as holding different weights
        (:class:`~detection.vote.KnownDivergence`) disagree from then on, so their further
        divergence, audit mismatches between them, and non-finite local gradients of replicas
        a majority named as wrong are theirs. Everything else is checked
        every step: a non-finite gradient the loop skipped poisons nothing, and a divergence
        without a majority leaves every class of equal replicas under watch.
        """
        step = current.step
        if any(r[_STEP] != step for r in rows):
            raise GuardUsageError(f"ranks are at different steps: {[r[_STEP] for r in rows]}")
        poisoned = self._poison_possible and any(r[_NF] & _WEIGHTS_NONFINITE for r in rows)
        findings: list[_Finding] = []

        nonfinite = attribute_nonfinite(
            [bool(r[_PRE]) for r in rows], [bool(r[_POST]) for r in rows]
        )
        stepped = any(r[_NF] & _STEPPED for r in rows)
        self._poison_possible = nonfinite is not None and (stepped or poisoned)
        wrong = self._known.minority()  # replicas an alarm named as holding wrong weights
        follows = poisoned or (
            nonfinite is not None
            and bool(nonfinite.pre_ranks)
            and set(nonfinite.pre_ranks) <= wrong
        )
        if nonfinite is not None and not follows:
            findings.append(_nonfinite_finding(nonfinite))

        weights = [tuple(r[_W]) for r in rows]
        states = [tuple(r[_S]) for r in rows]
        values = [w + s for w, s in zip(weights, states, strict=True)]
        verdict = majority_vote(values)
        known_before = copy.copy(self._known)
        new_divergence = False
        if verdict.unanimous:
            if nonfinite is None:  # equal again (not merely equally NaN): forget the divergence
                self._known.clear()
        elif not poisoned and self._known.is_new(values):
            findings.append(self._vote_finding(verdict, weights, states))
            new_divergence = True

        buffers = buffer_finding([r[_BUF] for r in rows], self.buffers.broadcast)
        if buffers is not None and not poisoned:
            findings.append(_Finding(Layer.FINGERPRINT, Phase.WEIGHTS, buffers[0], buffers[1]))

        audit_passed = False
        if current.audit:
            audit = attribute_audit(
                self.partners, [r[_OWN] for r in rows], [r[_REPLAY] for r in rows], self.nodes
            )
            audit_passed = audit.passed
            follows = poisoned or all(known_before.apart(a, b) for a, b in audit.mismatches)
            if not audit.passed and not follows:
                findings.append(self._audit_finding(audit))

        alarm = self._merge(step, findings)
        if new_divergence and alarm is not None:
            self._known.record(values)  # known only once alarmed
        own = rows[self.rank]
        outcome = StepOutcome(
            step=step,
            ranks=tuple(range(self.world_size)),
            fingerprint=_state_fingerprint(own[_W], own[_BUF][2:4]),
            vote_passed=verdict.unanimous and buffers is None,
            audit=self.config.mode if current.audit else None,
            audit_passed=audit_passed,
            alarm=alarm,
        )
        self.last_outcome = outcome
        if alarm is not None:
            self._raise(alarm)
        if self.gate is not None:
            self.gate.observe(outcome)

    def _vote_finding(
        self,
        verdict: VoteVerdict,
        weights: Sequence[tuple[int, ...]],
        states: Sequence[tuple[int, ...]],
    ) -> _Finding:
        parts = [
            name
            for name, values in (("weights", weights), ("optimizer_state", states))
            if len(set(values)) > 1
        ]
        detail: dict[str, Any] = {
            "diverged": "+".join(parts),
            "replicas": self.world_size,
            "fingerprints": {str(r): to_fingerprint(*w).hex() for r, w in enumerate(weights)},
        }
        if "optimizer_state" in parts:
            detail["optimizer_state_fingerprints"] = {
                str(r): to_fingerprint(*s).hex() for r, s in enumerate(states)
            }
        if not verdict.culprit_known:
            detail["culprit"] = "unknown"
            detail["reason"] = (
                "two replicas can say that they differ, never which one is wrong"
                if self.world_size == 2
                else "no strict majority among the replicas"
            )
        return _Finding(Layer.FINGERPRINT, Phase.WEIGHTS, verdict.divergent, detail)

    def _audit_finding(self, audit: AuditVerdict) -> _Finding:
        lone = len(audit.mismatches) == 1
        phase = Phase.LOSS if self.config.mode is AuditMode.LOSS else Phase.GRADIENT
        return _Finding(
            Layer.AUDIT,
            phase,
            audit.suspects,
            {
                "mode": str(self.config.mode),
                "mismatched_pairs": [{"auditor": a, "audited": b} for a, b in audit.mismatches],
                "attribution": "a single disagreeing pair: either side may have erred"
                if lone
                else "the smallest set of nodes explaining every disagreeing pair",
                **attribute_pairs(audit.mismatches, self.nodes).to_detail(),
            },
        )

    def _merge(self, step: int, findings: Sequence[_Finding]) -> Alarm | None:
        """One alarm per step: the most specific finding leads (non-finite names the rank that
        produced the value, the vote names the divergent replica, the audit names pairs); the
        others ride along in ``detail.also``."""
        if not findings:
            return None
        lead = findings[0]
        detail = lead.detail
        if len(findings) > 1:
            also = [
                {
                    "layer": str(f.layer),
                    "phase": str(f.phase),
                    "suspect_ranks": list(f.suspects),
                    **f.detail,
                }
                for f in findings[1:]
            ]
            detail = {**detail, "also": also}
        return Alarm.for_ranks(step, lead.layer, lead.phase, lead.suspects, self.nodes, detail)

    def _raise(self, alarm: Alarm) -> None:
        self.alarms.append(alarm)
        reporter = alarm.reporting_rank(self.world_size)
        extra = {
            **self._extra,
            "step": alarm.step,
            "layer": str(alarm.layer),
            "phase": str(alarm.phase),
        }
        if reporter == self.rank:
            _log.error(
                "SDC alarm: %s/%s at step %d, suspects %s",
                alarm.layer,
                alarm.phase,
                alarm.step,
                list(alarm.suspect_ranks),
                extra=extra,
            )
            if self.sender is not None:
                self.sender.send_alarm(alarm.to_webhook(self.job_id, self.rank, self.node))
        if self.config.halt_on_alarm:
            self.halted = True
