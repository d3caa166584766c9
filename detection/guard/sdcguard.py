"""``SDCGuard``: the few lines a DDP training script adds to catch silent data corruption.

::

    guard = SDCGuard(ddp_model, optimizer, microbatch=microbatch, loss_fn=loss_fn,
                     config=GuardConfig(audit_every=10, audit_mode="loss", seed=seed))
    for step in range(start, steps):
        with guard.step(step):                     # seeds dropout per (seed, step, rank)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(ddp_model, microbatch(step, rank))
            guard.backward(loss)                   # records the loss, runs loss.backward()
            optimizer.step()
        if guard.halted:
            break

(``docs/detection-design.md`` has the recipes for autocast, GradScaler, accumulation, compiled
models, several optimizers and ordinary data loaders.)

What runs where, per step:

* backward — the comm hook (:mod:`detection.guard.comm_hook`) sums each bucket before and after
  all-reduce (and, on audited gradient steps, fingerprints the local bucket);
* forward pre-hook (on the module the loop calls, outside any compiled region) — seeds the
  micro-batch's RNG and captures the autocast state and, on audited steps, the buffers;
* end of the step's last ``guard.backward`` — the per-step layer's row
  (:mod:`detection.stepcheck.checks`; with ``skip_update_on_alarm`` its verdict, from one small
  all-gather, before any optimizer updates a weight);
  then, on audited steps, the partner's micro-batch is recomputed on the module without DDP
  (:mod:`detection.audit.ring`), weights still as they were before any optimizer updates them;
  shipped batches arrive first (:mod:`detection.audit.batches`);
* ``optimizer.step`` post-hook — injected weight / optimizer-state faults (tests and demos);
* leaving ``guard.step`` — the weight fingerprint (and, if configured, the optimizer state's);
  then one all-gather of a small int64 row per rank (the per-step layer's row carried in it)
  and one host synchronisation, from which
  every rank reaches the same decision (:mod:`detection.guard.decision`): at most one
  :class:`~detection.transport.alarm.Alarm` per step, reported once per job by the lowest
  non-suspect rank.
  With ``GuardConfig(defer_decision=True)`` there is no all-gather: the row rides in the next
  step's gradient all-reduce (:mod:`detection.guard.carry`) and is read at the end of that step (or
  all-gathered at :meth:`SDCGuard.flush`, :meth:`SDCGuard.close`, if no backward came first):
  the alarm still names its own step, it is raised (and the job halted) one step later.

Everything before the all-gather stays on the device: no host copy of weights or gradients.

Consequences are not new events, and nothing else is suppressed: once an alarm named replicas
as diverged, the same divergence at later steps (and audit mismatches between replicas known to
differ) is not raised again, while a new split among replicas still equal is; once a non-finite
gradient was applied and the weights are actually non-finite, the steps computed from them are
the same event. A non-finite gradient the loop skipped poisons nothing. Persistent buffers are
checked where replicas must agree (:mod:`detection.weights.buffers`) and are part of the checkpoint
fingerprint. The configuration and the errors live in :mod:`detection.guard.config`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detection.audit.calibration import NotReplayableError
from detection.audit.recompute import AutocastState, unwrap_ddp
from detection.audit.ring import (
    AuditMode,
    PartnerRecompute,
    auditors_of,
    encode_loss,
    ring_partners,
    seed_rng,
    step_seed,
)
from detection.faults.injector import FaultInjector
from detection.faults.spec import FaultSpec
from detection.gate import CheckpointGate, StepOutcome
from detection.guard.audit_wiring import AuditWiring
from detection.guard.audit_wiring import StepState as _Step
from detection.guard.calibration_wiring import agree_at_start, check_calibration
from detection.guard.carry import RowInBucket
from detection.guard.comm_hook import CheckedCommHook, CommHook
from detection.guard.config import (
    AlarmSink,
    GuardConfig,
    GuardConfigError,
    GuardError,
    GuardHaltedError,
    GuardUsageError,
    Identity,
)
from detection.guard.counters import GuardCounters
from detection.guard.decision import (
    ROW,
    STATE_NONFINITE,
    STEP,
    STEPPED,
    WEIGHTS_NONFINITE,
    StepDecision,
    any_nonfinite,
    flags_word,
    step_row,
    step_row_on_host,
)
from detection.guard.protocol import refuse_backward, refuse_step, require_step
from detection.guard.sharded import ShardedGuard
from detection.guard.sharding import is_sharded
from detection.guard.state import load_state, state_of
from detection.guard.trace_mode import TraceMode
from detection.row.gather import GatherInFlight
from detection.row.words import loss_word, on_host
from detection.stepcheck.checks import LOOP_MAX, CarriedVerdict, StepChecks
from detection.transport.alarm import Alarm
from detection.weights.buffers import BufferWatch, buffer_owners
from detection.weights.fingerprint import Fingerprint, fingerprint_on_device
from detection.weights.load_check import verify_after_load
from detection.weights.plan import FingerprintPlan
from detection.weights.state import optimizer_state_tensors, persistent_buffers

__all__ = [
    "AlarmSink",
    "GuardConfig",
    "GuardConfigError",
    "GuardCounters",
    "GuardError",
    "GuardHaltedError",
    "GuardUsageError",
    "Identity",
    "NotReplayableError",
    "SDCGuard",
]

_log = logging.getLogger(__name__)


@dataclass
class _Undecided:
    """A step whose row is on its way to every rank (all-gathered or carried) and not yet
    decided."""

    current: _Step
    exchange: GatherInFlight | RowInBucket
    verdict: CarriedVerdict


class SDCGuard:
    """Detection for one DDP model and its optimizers, in every rank.

    Protocol (violations raise :class:`GuardUsageError`, saying what to change): each training
    step runs inside ``with guard.step(step)``; each micro-batch's loss goes through
    :meth:`backward` — ``GuardConfig.micro_batches`` times per step, all but the last inside
    ``ddp.no_sync()``; each optimizer steps at most once, after the last backward. The loss is
    ``loss_fn(model, batch)`` exactly (``loss_fn`` must accept the module without DDP too), for
    a batch that is either ``microbatch(step, rank[, micro])`` — a pure function, since a
    partner recomputes it — or handed over as ``guard.backward(loss, batch=batch)``, in which
    case it is shipped to the auditor on audited steps.

    ``model``: the DDP model, ``DDP(torch.compile(module))`` or ``torch.compile(DDP(module))``
    — whatever the loop calls. ``optimizer``: one or several (every one that updates the model).
    ``comm_hook``/``comm_state``: a DDP communication hook of your own; the guard wraps it
    (register it here, not on the model: DDP accepts only one hook).

    An FSDP2 or HSDP model (``fully_shard``) gets :class:`~detection.guard.sharded.ShardedGuard`
    instead: the same loop API and arguments, the layers that apply to a sharded model.
    """

    def __new__(cls, model: nn.Module, *args: Any, **kwargs: Any) -> SDCGuard:
        if cls is SDCGuard and is_sharded(model):
            # Not an SDCGuard, so Python calls no __init__ on it: built here, fully.
            return cast("SDCGuard", ShardedGuard(model, *args, **kwargs))
        return super().__new__(cls)

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        *,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        microbatch: Callable[..., Any] | None = None,
        config: GuardConfig | None = None,
        identity: Identity | None = None,
        sender: AlarmSink | None = None,
        gate: CheckpointGate | None = None,
        job_id: str = "local",
        comm_hook: CommHook | None = None,
        comm_state: Any = None,
    ) -> None:
        ddp, recompute_module, hooked = self._adopt(model)
        self.config = config or GuardConfig()
        self._take_loop(ddp, optimizer, loss_fn, microbatch)
        self._take_outlets(sender, gate, job_id)
        self._take_parameters(ddp)
        identities = self._place(identity)
        self._start_state(ddp)
        self._wire(ddp, comm_hook, comm_state, recompute_module)
        self._hook_into(hooked, identities)

    @property
    def replaying(self) -> TraceMode | None:
        """The former name of :attr:`trace_mode` (``None`` outside a diagnostic run), which
        training scripts written against it still read."""
        return self.trace_mode

    # -- set-up ------------------------------------------------------------------------------------
    def _adopt(self, model: nn.Module) -> tuple[DistributedDataParallel, nn.Module, nn.Module]:
        """The DDP module inside ``model``, the module a recomputation runs, and the module
        whose forward hooks see each micro-batch."""
        unwrapped = unwrap_ddp(model)
        if unwrapped is None:
            raise GuardConfigError(
                "SDCGuard needs the DistributedDataParallel-wrapped model (or torch.compile of it)"
            )
        ddp, recompute_module, hooked, self.compiled_outer = unwrapped
        if getattr(ddp, "_comm_hooks", None):
            raise GuardConfigError(
                "the model already has a comm hook; pass it as SDCGuard(comm_hook=..., "
                "comm_state=...) so the guard can wrap it"
            )
        return ddp, recompute_module, hooked

    def _take_loop(
        self,
        ddp: DistributedDataParallel,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        microbatch: Callable[..., Any] | None,
    ) -> None:
        """The training loop's parts: model, optimizers, loss, micro-batches, process group."""
        self.model = ddp
        self.module: nn.Module = ddp.module
        self.optimizers = (
            [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        )
        if not self.optimizers:
            raise GuardConfigError("SDCGuard needs the optimizer(s) that update the model")
        self.optimizer = self.optimizers[0]
        self.microbatch = microbatch
        self.loss_fn = loss_fn
        self.group: dist.ProcessGroup | None = ddp.process_group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

    def _take_outlets(
        self, sender: AlarmSink | None, gate: CheckpointGate | None, job_id: str
    ) -> None:
        """Where alarms and checkpoint records go — nowhere in a diagnostic run's trace mode."""
        # Replay mode (SDCGUARD_REPLAY_*, detection.guard.trace_mode): trace, no alarms, no
        # provenance.
        self.trace_mode = TraceMode.from_env(self.rank)
        self.sender = sender if self.trace_mode is None else None
        self.gate = gate
        if gate is not None and self.trace_mode is not None:
            gate._sink = None  # a replay records no checkpoint
        if gate is not None:
            gate.bind_guard_state(self.state_dict)  # written beside each checkpoint
        self.job_id = job_id

    def _take_parameters(self, ddp: DistributedDataParallel) -> None:
        """Which parameters the guard sees, and which of them the replicas vote on."""
        self.params = list(self.module.parameters())
        if not self.params:
            raise GuardConfigError("the model has no parameters")
        ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        # Parameters DDP was told to ignore are never synchronised: they may differ between
        # replicas by design, so the vote leaves them out (the injector keeps every position).
        self.voted = [
            p
            for name, p in self.module.named_parameters()
            if name.removeprefix("_orig_mod.") not in ignored and name not in ignored
        ]
        voted = {id(p) for p in self.voted}
        self._bucketed = [
            i for i, p in enumerate(self.params) if p.requires_grad and id(p) in voted
        ]

    def _place(self, identity: Identity | None) -> list[dict[str, Any]]:
        """Collective: agree with every rank at start (nodes, identities, configuration), then
        place this rank in the audit ring. Returns every rank's identity."""
        self.device = self.params[0].device
        self.node: str = identity.node if identity is not None else socket.gethostname()
        self.nodes, identities = self._agree(identity)
        self.partners = ring_partners(self.nodes)
        self.auditors = auditors_of(self.partners)
        self.audit_every = self.config.audit_every if self.world_size > 1 else 0
        self.micro_batches = self.config.micro_batches
        return identities

    def _start_state(self, ddp: DistributedDataParallel) -> None:
        """What the guard keeps across steps: alarms, counters, the weights' plan, the buffers."""
        self.alarms: list[Alarm] = []
        self.counters = GuardCounters()
        self.halted = False
        self.last_outcome: StepOutcome | None = None
        self._current: _Step | None = None
        self._undecided: _Undecided | None = None  # defer_decision: the step decided next
        self._replay_seed: int | None = None
        # What a checkpoint holds and the vote covers: the synchronised parameters, then the
        # persistent buffers, numbered after them in one global numbering.
        voted_numel = sum(p.numel() for p in self.voted)
        self.state_tensors = [*self.voted, *persistent_buffers(self.module)]
        self._weights_fingerprint = FingerprintPlan(self.voted)
        self._zeros = torch.zeros(3, dtype=torch.int64, device=self.device)  # never written
        # Around a compiled DDP the forward pre-hook runs before DDP's buffer broadcast: each
        # rank then checks its own buffers across steps, and there is nothing to vote on there.
        self.buffers = BufferWatch(
            self.module,
            start=voted_numel,
            broadcast=bool(getattr(ddp, "broadcast_buffers", True)) and not self.compiled_outer,
            rank=self.rank,
            device=self.device,
        )
        self._extra = {"job": self.job_id, "rank": self.rank, "node": self.node}

    def _wire(
        self,
        ddp: DistributedDataParallel,
        comm_hook: CommHook | None,
        comm_state: Any,
        recompute_module: nn.Module,
    ) -> None:
        """The layers of a step: fault injector, per-step checks, decision, comm hook, audit."""
        loss_fn, microbatch = self.loss_fn, self.microbatch
        if self.config.mode is AuditMode.GRADIENT and self.audit_every:
            self._check_determinism_possible()
        specs = [FaultSpec.parse(s) for s in self.config.inject]
        self.injector = FaultInjector(specs, rank=self.rank, node=self.node) if specs else None
        if self.injector is not None:
            self.injector.bind(self.module)
        self.checks = self._step_checks(comm_hook is None)
        self.decision = StepDecision(
            world_size=self.world_size,
            nodes=self.nodes,
            partners=self.partners,
            mode=self.config.mode,
            checks=self.checks,
            buffers_broadcast=self.buffers.broadcast,
        )
        self.hook = CheckedCommHook(
            self.params,
            process_group=self.group,
            inner=comm_hook,
            inner_state=comm_state,
            injector=self.injector,
            observer=self.checks,
        )
        self.hook.register(ddp)
        self.recompute = PartnerRecompute(
            recompute_module,
            loss_fn=loss_fn,
            microbatch=microbatch,
            mode=self.config.mode,
            seed=self.config.seed,
            partner=self.partners[self.rank],
            injector=self.injector,
            micro_batches=self.micro_batches,
            on_seed=self._set_replay_seed,
        )
        self.audit = AuditWiring(
            self.recompute,
            config=self.config,
            hook=self.hook,
            counters=self.counters,
            partners=self.partners,
            auditors=self.auditors,
            rank=self.rank,
            world_size=self.world_size,
            microbatch=microbatch,
            positions=self._bucketed,
            device=self.device,
            group=self.group,
        )

    def _hook_into(self, hooked: nn.Module, identities: list[dict[str, Any]]) -> None:
        """The hooks a step runs through (module and optimizer), then the ranks' registration."""
        self._handles = [
            hooked.register_forward_pre_hook(self._before_forward),
            hooked.register_forward_hook(self._after_forward),
        ]
        # A buffer owner's forward outside the model's: activation checkpointing's recompute.
        # A compiled model calls no module hooks (and recomputes inside its compiled graph).
        if not self._compiled():
            self._handles += [
                owner.register_forward_hook(self._owner_forward)
                for owner in buffer_owners(self.module, besides=(hooked, self.module))
            ]
        for opt in self.optimizers:
            self._handles.append(opt.register_step_pre_hook(self._before_optimizer_step))
            self._handles.append(opt.register_step_post_hook(self._after_optimizer_step))
        if self.sender is not None and self.rank == 0:
            self.sender.register_ranks(identities)
        _log.info(
            "sdcguard started: audit every %d (%s), partner %d, nodes %s, calibrating %d audits",
            self.audit_every,
            self.config.mode,
            self.partners[self.rank],
            self.nodes,
            self.config.calibrate,
            extra=self._extra,
        )

    def _agree(self, identity: Identity | None) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
        if identity is not None:
            ident = dict(identity.to_dict())
        else:
            ident = {"rank": self.rank, "local_rank": self.rank, "node": self.node}
        return agree_at_start(
            node=self.node,
            ident=ident,
            config=self.config,
            device=self.device,
            world_size=self.world_size,
            group=self.group,
        )

    def _compiled(self) -> bool:
        """Whether the loop's forward runs compiled code, around DDP or inside it."""
        return self.compiled_outer or isinstance(
            self.module, torch._dynamo.eval_frame.OptimizedModule
        )

    def _step_checks(self, default_reduction: bool) -> StepChecks:
        compiled = self._compiled()
        abft = not compiled if self.config.abft is None else self.config.abft
        if self.config.abft is None and compiled and self.config.step_checks:
            _log.info("ABFT off: a compiled model calls no module hooks", extra=self._extra)
        if abft and self.config.step_checks and compiled:
            raise GuardConfigError(
                "GuardConfig(abft=True) checks nn.Linear through module hooks, which a compiled "
                "model traces instead of calling: set abft=False for a torch.compile model (the "
                "per-step statistics and the all-reduce check stay on), or guard the eager model"
            )
        return StepChecks(
            module=self.module,
            optimizers=self.optimizers,
            params=self.params,
            group=self.group,
            world_size=self.world_size,
            config=self.config.stats,
            enabled=self.config.step_checks,
            abft=abft,
            skip_update=self.config.skip_update_on_alarm,
            check_reduction=default_reduction,
            extra=self._extra,
            abft_every=self.config.abft_every,
        )

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
        """Decide the step still open (:meth:`flush`), then remove the guard's module and
        optimizer hooks (DDP cannot unregister a comm hook)."""
        try:
            self.flush()
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self.checks.close()
            if self.injector is not None:
                self.injector.close()

    @property
    def armed(self) -> bool:
        """Whether audits may raise alarms: calibration is over (or was not asked for)."""
        return self.counters.calibration_audits >= self.config.calibrate

    # -- the training-loop API ---------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Bracket one training step; on leaving, decide it (collective: all ranks)."""
        refuse_step(step, halted=self.halted, open_step=self._current)
        audit = self.audit_every > 0 and step % self.audit_every == 0
        current = _Step(step=step, audit=audit, seed=step_seed(self.config.seed, step, self.rank))
        if audit and self.config.mode is AuditMode.LOSS:
            current.loss_micro = (step // self.audit_every) % self.micro_batches
        self._current = current
        seed_rng(current.seed, self.device)
        if self.injector is not None:
            self.injector.begin_step(step)
        gradient_audit = current.audit and self.config.mode is AuditMode.GRADIENT
        if self.trace_mode is not None:
            self.trace_mode.begin_step(step, self.module)
        self.hook.begin_step(
            fingerprint_gradients=gradient_audit or self.trace_mode is not None,
            inject=self.injector is not None and self.injector.any_active(),
        )
        self.checks.begin_step(step)
        self.buffers.begin_step()
        try:
            with self._deterministic(gradient_audit):
                yield
                self._finish(current)
            if self.trace_mode is not None and current.loss is not None:
                outcome = self.last_outcome
                self.trace_mode.after_step(
                    step,
                    current.loss,
                    self.hook.gradient_fingerprint(),
                    outcome.fingerprint.hex() if outcome is not None else "",
                    self.group,
                )
        finally:
            self.checks.end_step()
            self.hook.end_step()
            if self.injector is not None:
                self.injector.end_step()
            self.recompute.buffers.clear()
            self._current = None

    def backward(
        self,
        loss: torch.Tensor,
        *,
        scaler: torch.amp.GradScaler | None = None,
        batch: Any = None,
    ) -> None:
        """``loss.backward()`` — or ``scaler.scale(loss).backward()`` — recording the unscaled
        loss, the scale and (with ``batch=``, for loops without a pure ``microbatch``) the batch
        this loss came from, for the audit."""
        current = self._require_step("guard.backward()")
        micro = current.micro
        refuse_backward(current, loss, self.micro_batches)
        if batch is None and self.microbatch is None:
            raise GuardUsageError(
                "no microbatch(step, rank) function was given: pass the batch the loss came "
                "from, guard.backward(loss, batch=batch), so the auditor can recompute it"
            )
        syncing = self.model.require_backward_grad_sync
        last = micro == self.micro_batches - 1
        if syncing != last:
            raise GuardUsageError(
                f"micro-batch {micro} of {self.micro_batches} in step {current.step}: "
                + (
                    "wrap every backward but the last in `with ddp.no_sync():`"
                    if syncing
                    else "the last backward of a step must run outside ddp.no_sync()"
                )
            )
        if batch is not None:
            current.batches[micro] = batch
        if micro == current.loss_micro:
            current.loss = loss.detach()
        mean = loss.detach() if self.micro_batches == 1 else loss.detach() / self.micro_batches
        current.mean_loss = mean if current.mean_loss is None else current.mean_loss + mean
        if scaler is not None and scaler.is_enabled():
            scaled = scaler.scale(loss)
            current.scale = scaler._scale.detach().clone()  # type: ignore[union-attr]
        else:
            scaled = loss
        scaled.backward()
        current.micro += 1
        if not last:
            # Whatever the loop draws before the next forward comes from a known state too.
            seed_rng(step_seed(self.config.seed, current.step, self.rank, micro + 1), self.device)
            return
        # The reduced gradients are in: decide the per-step layer before any optimizer (handed
        # to the guard or not) updates a weight, then replay the partner on unchanged weights.
        self.buffers.after_backward()  # past any recompute of activation checkpointing
        self._check_before_update(current)
        if current.audit:
            self._run_audit(current)

    def state_dict(self) -> dict[str, Any]:
        """The per-step layer's learnt state (:mod:`detection.guard.state`): the same on every
        rank; save it with the checkpoint (a :class:`CheckpointGate` writes it beside the
        checkpoint), so a resumed job is armed at its first step. Call between steps, once the
        last one is decided (with ``defer_decision``, after :meth:`flush` on every rank)."""
        if self._current is not None or self._undecided is not None:
            raise GuardUsageError(
                "guard.state_dict() while a step is open or undecided: call it between steps, "
                "after guard.flush() on every rank with defer_decision"
            )
        return state_of(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take over a :meth:`state_dict` (on every rank, before the first resumed step); a
        state of another world size or model raises :class:`GuardConfigError`."""
        if self._current is not None:
            raise GuardUsageError("guard.load_state_dict() inside a step: call it between steps")
        self.flush()
        load_state(self, state)

    def verify_loaded(self, expected: Fingerprint | str) -> Fingerprint:
        """After loading a checkpoint: every replica's weights equal the recorded fingerprint
        (collective; raises :class:`~detection.weights.load_check.LoadVerificationError`)."""
        self.flush()
        self.buffers.forget_previous()
        return verify_after_load(self.state_tensors, expected, self.group)

    # -- hooks -------------------------------------------------------------------------------------
    def _require_step(self, what: str) -> _Step:
        return require_step(self._current, what)

    def _set_replay_seed(self, value: int | None) -> None:
        self._replay_seed = value

    def _before_forward(self, _module: nn.Module, _args: Any) -> None:
        if self.recompute.active:
            if (
                self._replay_seed is not None
            ):  # the replay's forward starts where the original's did
                seed_rng(self._replay_seed, self.device)
                self._replay_seed = None
            return
        self.buffers.forward_started(self._current is not None)
        current = self._current
        if current is None or current.micro >= self.micro_batches:
            return
        micro = current.micro
        if micro in current.forwards:
            return
        current.forwards.add(micro)
        # micro-batch 0's seed is the step's (step_seed), taken once at the step's start
        seed = (
            step_seed(self.config.seed, current.step, self.rank, micro) if micro else current.seed
        )
        seed_rng(seed, self.device)
        current.autocast[micro] = AutocastState.capture()
        first = current.loss_micro if self.config.mode is AuditMode.LOSS else 0
        if current.audit and micro == first:
            # The original forward, after DDP's buffer broadcast: the replay starts from here.
            self.recompute.buffers.capture()

    def _after_forward(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        if not self.recompute.active:
            self.buffers.forward_finished(self._current is not None)

    def _owner_forward(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        if self.recompute.active:
            return
        if self._current is None:
            # a submodule run on its own between steps (a BatchNorm recalibration, say) changes
            # buffers legitimately, as the whole model's forward there does
            self.buffers.forget_previous()
        else:
            self.buffers.owner_ran()

    def _before_optimizer_step(self, opt: Any, _args: Any, _kwargs: Any) -> None:
        current = self._require_step("optimizer.step()")
        if id(opt) in current.stepped:
            raise GuardUsageError(
                "optimizer.step() called twice in one guarded step: step each optimizer once "
                "per guard.step() block"
            )
        if current.micro < self.micro_batches:
            raise GuardUsageError(
                f"optimizer.step() after {current.micro} of {self.micro_batches} backward "
                "calls: step the optimizer once, after the step's last guard.backward()"
            )
        self._check_before_update(current)  # a no-op: the last backward decided it

    def _after_optimizer_step(self, opt: Any, _args: Any, _kwargs: Any) -> None:
        current = self._require_step("optimizer.step()")
        current.stepped.add(id(opt))
        if self.injector is not None and opt is self.optimizer:
            self.injector.after_optimizer_step(self.optimizer)

    def _check_before_update(self, current: _Step) -> None:
        """The per-step layer's verdict (collective, once per step: later calls are no-ops),
        from the loss averaged over the step's micro-batches and the scale of its backward."""
        self.hook.settle_reduced()  # the reduced buckets' sums, which the layer's row carries
        self.checks.before_update(current.step, current.mean_loss, current.scale)

    def _run_audit(self, current: _Step) -> None:
        self.audit.run(current, armed=self.armed)

    # -- the decision ------------------------------------------------------------------------------
    def _finish(self, current: _Step) -> None:
        if current.micro == 0 or current.loss is None:
            raise GuardUsageError(
                "the step's loss never went through guard.backward(): call "
                "guard.backward(loss) instead of loss.backward()"
            )
        if current.micro < self.micro_batches:
            raise GuardUsageError(
                f"step {current.step} ran {current.micro} of {self.micro_batches} backward "
                f"calls: set GuardConfig(micro_batches={current.micro}) or call guard.backward "
                "once per micro-batch"
            )
        self._check_before_update(current)  # no-ops: the last backward ran both
        self._run_audit(current)
        # The previous step first, if it is still open: its outcome (a NaN applied to the
        # weights) decides what this row reads, and decisions are taken in step order.
        self.flush()
        state_fp = self._zeros[:2]
        if self.config.vote_optimizer_state:
            state = [t for opt in self.optimizers for t in optimizer_state_tensors(opt, self.voted)]
            if state:
                state_fp = fingerprint_on_device(state).to(self.device)
        poison_possible = self.decision.poison_possible  # weights read only after a NaN step
        # The per-step layer's row rides along (its float64 bits as int64 words), unless it
        # had to decide before the update: one collective, one host synchronisation per step.
        verdict = self.checks.hand_over()
        row = self._row(current, verdict, state_fp, poison_possible=poison_possible)
        if not self._defers(current):
            self._settle(_Undecided(current, GatherInFlight.start(row, self.group), verdict))
        elif self.hook.can_carry and RowInBucket.fits(row.numel(), self.world_size):
            # In the next step's gradient all-reduce (detection.guard.carry): no collective of its
            # own.
            carried = RowInBucket(
                row, step=current.step, rank=self.rank, world_size=self.world_size, group=self.group
            )
            self.hook.carry(carried)
            self._undecided = _Undecided(current, carried, verdict)
        else:
            self._undecided = _Undecided(current, GatherInFlight.start(row, self.group), verdict)

    def _row(
        self,
        current: _Step,
        verdict: CarriedVerdict,
        state_fp: torch.Tensor,
        *,
        poison_possible: bool,
    ) -> torch.Tensor:
        """The step's row. On a GPU it is assembled on the device, with no host synchronisation;
        on a CPU the same words are read on the host and made a tensor once
        (:mod:`detection.row.words`)."""
        loss, extra = current.loss, verdict.row
        if loss is None:
            raise GuardUsageError("the step's loss never went through guard.backward()")
        if on_host(self.device):
            weights_nonfinite = int(any_nonfinite(self.params)) if poison_possible else 0
            return step_row_on_host(
                current.step,
                flags=self.hook.flags_on_host(),
                weights=self._weights_fingerprint.words(),
                state=state_fp.tolist(),
                own=[loss_word(loss), *self.hook.gradient_fingerprint_on_host()],
                replay=current.recomputed.tolist() if current.recomputed is not None else [0, 0, 0],
                nf=STATE_NONFINITE * self.checks.state_flag_on_host()
                + WEIGHTS_NONFINITE * weights_nonfinite
                + STEPPED * bool(current.stepped),
                buffers=self.buffers.row_on_host(),
                extra=extra.tolist() if isinstance(extra, torch.Tensor) else extra or (),
            )
        if isinstance(extra, list):
            extra = torch.tensor(extra, dtype=torch.int64, device=self.device)
        return step_row(
            current.step,
            flags=self.hook.flags(),
            weights=self._weights_fingerprint(),
            state=state_fp,
            own=[encode_loss(loss), self.hook.gradient_fingerprint()],
            replay=current.recomputed if current.recomputed is not None else self._zeros[:3],
            nf=flags_word(
                stepped=bool(current.stepped),
                weights_nonfinite=any_nonfinite(self.params) if poison_possible else None,
                state_nonfinite=self.checks.state_flag(),
            ),
            buffers=self.buffers.row(),
            extra=extra,
        )

    def _defers(self, current: _Step) -> bool:
        """Whether this step's decision waits for the next step (``defer_decision``). Never in
        replay mode (its trace reads each step's outcome at once) nor on a step under a
        GradScaler (a partial overflow is resolved by recomputing on the step's own weights).
        The answer is the same on every rank: the configuration and the scaler are."""
        return self.config.defer_decision and self.trace_mode is None and current.scale is None

    def flush(self) -> None:
        """Decide the step still open, if any (``defer_decision``): every rank reads the
        all-gather it already started and reaches the same decision. Collective only when that
        step ran a calibration audit; call it on every rank, where the loop needs the last
        step's verdict now — :meth:`close` and :meth:`verify_loaded` do."""
        step, self._undecided = self._undecided, None
        if step is not None:
            self.hook.carry(None)  # not taken by now: it is all-gathered as it is read
            self._settle(step)

    def _settle(self, undecided: _Undecided) -> None:
        current = undecided.current
        table = undecided.exchange.table()
        rows: list[list[int]]
        if table.numel() <= LOOP_MAX:  # a small table: read once, split as lists
            everything: list[list[int]] = table.tolist()
            rows = [r[:ROW] for r in everything]
            self.checks.decide_carried(undecided.verdict, [r[ROW:] for r in everything])
        else:
            rows = table[:, :ROW].tolist()
            self.checks.decide_carried(undecided.verdict, table[:, ROW:])
        if current.self_replays is not None:
            check_calibration(
                current.step,
                current.self_replays,
                rows,
                partners=self.partners,
                config=self.config,
                counters=self.counters,
                group=self.group,
                extra=self._extra,
            )
        self._decide(current, rows)

    def _decide(self, current: _Step, rows: Sequence[Sequence[int]]) -> None:
        """Act on the step's decision (:mod:`detection.guard.decision`) — the same on every rank,
        since every rank sees the same rows: record the outcome, raise the alarm, tell the
        gate."""
        if any(r[STEP] != current.step for r in rows):
            raise GuardUsageError(
                f"ranks are at different steps: {[r[STEP] for r in rows]}: pass every rank "
                "the same step number to guard.step()"
            )
        decision = self.decision.decide(
            current.step,
            rows,
            audit=current.audit,
            rank=self.rank,
            account_for_scaler=lambda nonfinite: self.audit.account_for_scaler(current, nonfinite),
        )
        self.last_outcome = decision.outcome
        self._tally(current, decision.audit_passed, decision.inconclusive)
        if decision.alarm is not None:
            self._raise(decision.alarm)
        if self.gate is not None:
            self.gate.observe(decision.outcome)

    def _tally(self, current: _Step, audit_passed: bool, inconclusive: bool) -> None:
        c = self.counters
        c.steps += 1
        c.votes += 1
        c.nonfinite_checks += 1
        c.step_checks = self.checks.tested_steps
        if current.audit:
            c.audits += 1
            c.audits_passed += int(audit_passed)
            c.audits_inconclusive += int(inconclusive)

    def _raise(self, alarm: Alarm) -> None:
        self.alarms.append(alarm)
        self.counters.alarms += 1
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
        if self.config.halt_on_alarm and self.trace_mode is None:
            self.halted = True
