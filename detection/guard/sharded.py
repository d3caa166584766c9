"""``SDCGuard`` on a sharded model (FSDP2, HSDP): the same loop API, the layers that apply.

``SDCGuard(model, optimizer, …)`` hands an FSDP2 / HSDP model (:mod:`detection.guard.sharding`)
to :class:`ShardedGuard`; the loop is written as for DDP (``with guard.step(step)``,
``guard.backward(loss)``, ``optimizer.step()``), with FSDP2's own accumulation switch
(``model.set_requires_gradient_sync``) in place of ``ddp.no_sync()``.

What runs, per step, and what does not (never claimed):

* **on** — the non-finite check of each rank's own gradient before FSDP2's reduce-scatter
  (:mod:`detection.guard.sharded_hook`: names the rank), of the gradient shards each rank
  holds after it, and of the weights after the update; the algebra of the reduce-scatter
  (the shards' sum against the inputs', within a rounding bound), decided as the step ends;
  every rank's view of the all-gathered parameters compared within its all-gather group; the
  per-step statistics of each rank's own gradient (:mod:`detection.guard.sharded_stats`);
  the weight fingerprint at unsharded positions (:mod:`detection.weights.sharded`), the whole
  model's value on every rank, the value checkpoints carry; under HSDP the weight vote of
  each shard across its replicate group (:mod:`detection.weights.replicas`): three or more
  replicas name the rank, two say that they differ.
* **on with** ``audit_every > 0`` — the ring audit in loss mode
  (:mod:`detection.guard.sharded_audit`): on an audited step every rank recomputes its ring
  partner's micro-batch loss through the sharded model, all ranks at once, before the update,
  and the decision compares it bitwise with the partner's; ``calibrate`` as for DDP.
* **on under pure FSDP2** (``update_replay_every``, 8 by default; off under HSDP, whose vote
  sees both) — nothing there compares a shard with another copy (the audit does not either:
  every rank gathers the same wrong shard), so two checks stand in
  (:mod:`detection.guard.update_replay`): the owner's update re-run bitwise by its buddy rank,
  every shard once every ``update_replay_every`` steps (names the pair; a third replay names
  one of them from three ranks on), and each rank's shards fingerprinted between its updates
  (custody: names the rank). No checkpoint is verified there
  (:class:`~detection.gate.StepOutcome` ``vote_passed`` is false; a passed audit alone does
  not verify weights no copy was compared with).
* **off, said at start** — the gradient audit (``audit_mode='gradient'``), ABFT, the
  optimizer-state vote (under pure FSDP2 ``vote_optimizer_state=True`` puts the state under
  custody instead), ``skip_update_on_alarm``, ``defer_decision``, fault injection: each
  is refused when asked for explicitly. A reduce-scatter or all-gather of
  one's own (``comm_hook=``, FSDP2's ``ReduceScatter`` / ``AllGather``, or one of each) is
  wrapped, as a DDP comm hook is.

Every rank's evidence travels as one int64 row — step, flags, its shard's fingerprint — in one
all-gather a step, and every rank decides alike from the table
(:mod:`detection.guard.sharded_step`: the step's state, the optimizer hooks, the row and its
decision; this module keeps the loop protocol).
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from detection.audit.calibration import check_agreement, replay_environment
from detection.audit.ring import seed_rng, step_seed
from detection.gate import CheckpointGate, StepOutcome
from detection.guard.config import (
    AlarmSink,
    GuardConfig,
    GuardConfigError,
    GuardUsageError,
    Identity,
)
from detection.guard.counters import GuardCounters
from detection.guard.decision import any_nonfinite
from detection.guard.protocol import refuse_backward, refuse_step, require_step
from detection.guard.sharded_audit import ShardedAudit, refuse_audit_config
from detection.guard.sharded_decision import ShardedDecision
from detection.guard.sharded_hook import CheckedAllGather, CheckedReduceScatter
from detection.guard.sharded_stats import ShardedStats
from detection.guard.sharded_step import ShardedStep, StepWiring, local_shard
from detection.guard.sharding import ShardedLayout, adopt_sharded, refuse_unsupported, user_comms
from detection.guard.state import load_state, state_of
from detection.guard.trace_mode import TraceMode
from detection.guard.update_replay import UpdateReplay
from detection.row.gather import all_gather_table
from detection.transport.alarm import Alarm
from detection.weights.fingerprint import Fingerprint, to_fingerprint
from detection.weights.load_check import LoadVerificationError

__all__ = ["ShardedGuard"]

_log = logging.getLogger(__name__)


class ShardedGuard:
    """Detection for one FSDP2 / HSDP model and its optimizers, in every rank; see the module.
    Built by ``SDCGuard(model, …)`` for a sharded model, with the same arguments."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        *,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        microbatch: Callable[..., Any] | None = None,
        config: GuardConfig | None = None,
        identity: Identity | None = None,
        sender: AlarmSink | None = None,
        gate: CheckpointGate | None = None,
        job_id: str = "local",
        comm_hook: Any = None,
        comm_state: Any = None,
    ) -> None:
        del comm_state  # a DDP comm hook's state: FSDP2's comms carry their own
        self.config = config or GuardConfig()
        refuse_unsupported(self.config, comm_hook)
        refuse_audit_config(self.config, loss_fn)
        self.layout: ShardedLayout = adopt_sharded(model)
        self.model = model
        self.module = self.layout.module
        self.params = self.layout.params
        self.optimizers = (
            [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        )
        if not self.optimizers:
            raise GuardConfigError("SDCGuard needs the optimizer(s) that update the model")
        self.optimizer = self.optimizers[0]
        self.group: dist.ProcessGroup | None = None  # the mesh spans the job (checked)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = self.layout.device
        self.micro_batches = self.config.micro_batches
        self.sender, self.gate, self.job_id = sender, gate, job_id
        if TraceMode.from_env(self.rank) is not None:
            # a diagnostic run must send no alarm and record no checkpoint: refuse, never run
            # as a normal job inside one
            raise GuardConfigError(
                "a diagnostic run's trace mode (SDCGUARD_REPLAY_*) traces DDP jobs only: "
                "the sharded guard does not run inside one"
            )
        self.trace_mode = None
        self.node: str = identity.node if identity is not None else socket.gethostname()
        self.nodes, identities = self._agree(identity)
        self.alarms: list[Alarm] = []
        self.counters = GuardCounters()
        self.halted = False
        self.last_outcome: StepOutcome | None = None
        self._current: ShardedStep | None = None
        # built with step_checks off too (it then learns nothing): its state is the guard's
        self.stats = ShardedStats(self.world_size, self.config.stats, self.nodes)
        self.decision = ShardedDecision(
            self.layout.replicas,
            self.nodes,
            self.layout.gatherers,
            names=[name for name, _ in self.module.named_parameters()],
        )
        self.audit: ShardedAudit | None = None
        if self.config.audit_every > 0 and self.world_size > 1 and loss_fn is not None:
            self.audit = ShardedAudit(
                model,
                self.module,
                loss_fn=loss_fn,
                microbatch=microbatch,
                config=self.config,
                counters=self.counters,
                nodes=self.nodes,
                rank=self.rank,
                device=self.device,
                extra={"job": job_id, "rank": self.rank, "node": self.node},
            )
        self.replay = (
            UpdateReplay(
                self.params,
                self.optimizers,
                self.config.update_replay_every,
                rank=self.rank,
                world_size=self.world_size,
                device=self.device,
                group=self.group,
                state_custody=self.config.vote_optimizer_state,
            )
            if self.config.update_replay_every > 0 and self.layout.replicas.replicas == 1
            else None
        )
        if self.config.vote_optimizer_state and self.replay is None:
            raise GuardConfigError(
                "vote_optimizer_state=True on a sharded model puts the optimizer state under "
                "the update replay's custody: pure FSDP2 with update_replay_every > 0 only "
                "(docs/guide.md, 'Sharded models')"
            )
        inner_rs, inner_ag = user_comms(comm_hook) or (None, None)
        self.reduce_scatter = CheckedReduceScatter(self.device, inner=inner_rs)
        self.reduce_scatter.install(self.module)
        self.all_gather = CheckedAllGather(self.device, inner=inner_ag)
        self.all_gather.install(self.module)
        self.wiring = StepWiring(
            self.params,
            config=self.config,
            counters=self.counters,
            replicas=self.layout.replicas,
            shard_ranks=self.layout.gatherers.replicas,
            nodes=self.nodes,
            decision=self.decision,
            stats=self.stats,
            reduce_scatter=self.reduce_scatter,
            all_gather=self.all_gather,
            audit=self.audit,
            replay=self.replay,
            device=self.device,
            group=self.group,
        )
        self._extra = {"job": job_id, "rank": self.rank, "node": self.node}
        self._handles = []
        for opt in self.optimizers:
            self._handles.append(opt.register_step_pre_hook(self._before_optimizer_step))
            self._handles.append(opt.register_step_post_hook(self._after_optimizer_step))
        if self.sender is not None and self.rank == 0:
            self.sender.register_ranks(identities)
        if gate is not None:
            gate.bind_guard_state(self.state_dict)  # written beside each checkpoint
        _log.info(
            "sdcguard started on %s (mesh %s): %s",
            "HSDP" if self.layout.hsdp else "FSDP2",
            tuple(self.layout.mesh.shape),
            self.coverage(),
            extra=self._extra,
        )

    def coverage(self) -> str:
        """What this guard checks and what it does not, in words (logged at start)."""
        return self.wiring.coverage()

    def _agree(self, identity: Identity | None) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
        ident = (
            dict(identity.to_dict())
            if identity is not None
            else {"rank": self.rank, "local_rank": self.rank, "node": self.node}
        )
        # a replay is evidence only if every rank computes bitwise alike: with the audit on,
        # the ranks' hardware, builds and kernel settings must agree (as under DDP)
        env = replay_environment(self.device) if self.config.audit_every > 0 else {}
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, (self.node, repr(self.config), ident, env))
        if len({c for _, c, _, _ in everyone}) > 1:
            raise GuardConfigError("ranks were given different GuardConfig values")
        problems = check_agreement([e for _, _, _, e in everyone])
        if problems:
            raise GuardConfigError("; ".join(problems))
        return tuple(n for n, _, _, _ in everyone), [i for _, _, i, _ in everyone]

    # -- the training-loop API ---------------------------------------------------------------------
    @property
    def armed(self) -> bool:
        """Whether audits may raise alarms: calibration is over (or was not asked for)."""
        return self.audit.armed if self.audit is not None else True

    @property
    def recomputing(self) -> bool:
        """Whether the model's forward now running is the audit's replay of a micro-batch (a
        fault injector tells a recomputation from the rank's own step by it)."""
        return self.audit is not None and self.audit.recomputing

    @property
    def replaying(self) -> None:
        """A diagnostic run's trace mode, as on :class:`SDCGuard`: never inside one here."""
        return None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Bracket one training step; on leaving, decide it (collective: all ranks)."""
        refuse_step(step, halted=self.halted, open_step=self._current)
        self._current = ShardedStep(step)
        self.reduce_scatter.begin_step()
        self.all_gather.begin_step()
        if self.audit is not None:
            self.audit.begin_step(step)
        seed_rng(step_seed(self.config.seed, step, self.rank), self.device)
        if self.replay is not None:
            self.replay.begin_step()
        try:
            yield
            self._finish(self._current)
        finally:
            self._current = None
            if self.audit is not None:
                self.audit.end_step()

    def backward(
        self, loss: torch.Tensor, *, scaler: torch.amp.GradScaler | None = None, batch: Any = None
    ) -> None:
        """``loss.backward()`` — or ``scaler.scale(loss).backward()``; after the step's last
        micro-batch, the non-finite check of the reduce-scattered gradient shards and, on an
        audited step, the replay of the partner's micro-batch (weights not yet updated).
        ``batch``: the batch the loss came from, shipped to the auditor when there is no
        ``microbatch`` function."""
        current = self._require_step("guard.backward()")
        refuse_backward(current, loss, self.micro_batches)
        if self.audit is not None:
            self.audit.record(loss, batch)
        current.loss = loss.detach()
        scaling = scaler is not None and scaler.is_enabled()
        current.scaled = current.scaled or scaling
        scaled = loss
        if scaler is not None and scaling:
            scaled = scaler.scale(loss)  # creates the scale on its first call
            current.scale = scaler._scale.detach().clone()  # type: ignore[union-attr]
        scaled.backward()
        current.micro += 1
        if current.micro < self.micro_batches:
            seed_rng(
                step_seed(self.config.seed, current.step, self.rank, current.micro), self.device
            )
            return
        grads = [local_shard(p.grad) for p in self.params if p.grad is not None]
        current.grad_nonfinite = any_nonfinite(grads) if grads else None
        if self.audit is not None:
            self.audit.run()

    @property
    def checks(self) -> ShardedStats:
        """The per-step layer's learnt statistics (what :meth:`state_dict` carries)."""
        return self.stats

    def state_dict(self) -> dict[str, Any]:
        """The per-step layer's learnt state (:mod:`detection.guard.state`), the same on every
        rank: save it with the checkpoint (a :class:`CheckpointGate` writes it beside each
        one), so a resumed job of the same world size is armed at its first step. Call between
        steps."""
        if self._current is not None:
            raise GuardUsageError("guard.state_dict() inside a step: call it between steps")
        return state_of(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take over a :meth:`state_dict` (on every rank, before the first resumed step); a
        state of another world size, model or kind of guard raises :class:`GuardConfigError`."""
        if self._current is not None:
            raise GuardUsageError("guard.load_state_dict() inside a step: call it between steps")
        load_state(self, state)

    def verify_loaded(self, expected: Fingerprint | str) -> Fingerprint:
        """After loading a (resharded) checkpoint: every replica of the model (under FSDP2 the
        one copy) holds the recorded fingerprint (collective; raises
        :class:`LoadVerificationError` on every rank, naming the ranks of a wrong replica)."""
        want = Fingerprint.from_hex(expected) if isinstance(expected, str) else expected
        if self.replay is not None:
            self.replay.forget()  # the weights were written on purpose
        table = all_gather_table(self.wiring.part(), self.group).tolist()
        found = self.layout.replicas.per_rank([to_fingerprint(a, b) for a, b in table])
        if any(fp != want for fp in found.values()):
            raise LoadVerificationError(want, found)
        return want

    def flush(self) -> None:
        """Nothing to decide: every step is decided when it ends (no ``defer_decision``)."""

    def close(self) -> None:
        """Remove the optimizer hooks. FSDP2 cannot restore its default comms: the checked
        ones stay installed and keep working, their flags read by nobody."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.audit is not None:
            self.audit.close()

    # -- hooks and the decision --------------------------------------------------------------------
    def _require_step(self, what: str) -> ShardedStep:
        return require_step(self._current, what)

    def _before_optimizer_step(self, opt: Any, _args: Any, _kwargs: Any) -> None:
        self.wiring.before_update(self._require_step("optimizer.step()"), opt)

    def _after_optimizer_step(self, opt: Any, _args: Any, _kwargs: Any) -> None:
        self.wiring.after_update(self._require_step("optimizer.step()"), opt)

    def _finish(self, current: ShardedStep) -> None:
        outcome = self.wiring.decide(current)
        self.last_outcome = outcome
        if outcome.alarm is not None:
            self._raise(outcome.alarm)
        if self.gate is not None:
            self.gate.observe(outcome)

    def _raise(self, alarm: Alarm) -> None:
        self.alarms.append(alarm)
        self.counters.alarms += 1
        if alarm.reporting_rank(self.world_size) == self.rank:
            _log.error(
                "SDC alarm: %s/%s at step %d, suspects %s",
                alarm.layer,
                alarm.phase,
                alarm.step,
                list(alarm.suspect_ranks),
                extra={**self._extra, "step": alarm.step},
            )
            if self.sender is not None:
                self.sender.send_alarm(alarm.to_webhook(self.job_id, self.rank, self.node))
        if self.config.halt_on_alarm:
            self.halted = True
