"""What :class:`~detection.guard.SDCGuard` is configured with, and the errors it raises.

``GuardConfig`` is identical on every rank (checked at start-up: the decision is the same on
every rank only if the configuration is); the errors are typed so that a loop can tell a
configuration problem (at construction) from a protocol violation (in the loop, saying what
to change) and from a refused step after a halt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from detection.audit.ring import AuditMode
from detection.faults.spec import FaultSpec
from detection.stepcheck.gradstats import StatsConfig

__all__ = [
    "AlarmSink",
    "GuardConfig",
    "GuardConfigError",
    "GuardError",
    "GuardHaltedError",
    "GuardUsageError",
    "Identity",
]


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
    ``micro_batches``: ``guard.backward`` calls per step (gradient accumulation: ``no_sync``
    around all but the last); a loss audit replays one of them (a different one each audit),
    a gradient audit the whole group.
    ``calibrate``: audits that must come out clean (and reproduce each rank's own micro-batch)
    before the audit arms; until then a mismatch raises
    :class:`~detection.audit.calibration.NotReplayableError` saying what to change, not an alarm.
    ``step_checks``: the per-step layer (:mod:`detection.stepcheck.checks`): gradient statistics,
    the
    algebraic all-reduce check and the optimizer-state check on every step. On by default.
    ``skip_update_on_alarm``: when that layer finds a step corrupted, drop its gradients before
    ``optimizer.step`` on every rank, so the corrupted step never reaches the weights.
    ``abft``: the layers' checksums (:mod:`detection.stepcheck.abft`: Linear forward rows and weight
    gradient, Embedding rows and gradient, LayerNorm/BatchNorm gradient) on every step, the
    only check of this layer that sees a flip which makes a value smaller. ``None`` (the
    default): on, except on a ``torch.compile`` model, whose traced modules call no hooks (then
    off, logged); ``True``: on, and a compiled model is refused; ``False``: off.
    ``abft_every``: the checksums' budget — each checked layer is checked once every
    ``abft_every`` steps, layer ``i`` on the steps with ``i % abft_every == step % abft_every``
    (a rotation every rank derives from the step number), so a step checks about
    ``1/abft_every`` of the layers and costs that share of full coverage. Default 8: a one-off
    flip in a layer's output or gradient is seen by its checksum with probability 1/8 on the
    step it happens (the statistics still look at every step), a fault that recurs on the same
    part within 8 steps. ``1``: full coverage, every layer on every step.
    ``defer_decision``: decide each step at the end of the next one, from an all-gather started
    when the step ended and run while the next step computes — the host no longer waits for
    that collective, which on a small model is most of the fixed cost per step. The alarm still
    names the step that went wrong; it is raised, and the job halted, one step later, once
    that next step has updated the weights too. A checkpoint is verified only by evidence
    gathered after it (:mod:`detection.gate`), so none taken on corrupt weights is verified;
    ``guard.flush()`` decides the open step at once, ``guard.close()`` and
    ``guard.verify_loaded()`` call it, and a loop must close the guard (on every rank) for its
    last step to be decided. Steps under a GradScaler and replay mode decide at once.
    ``stats``: the tuning.
    ``update_replay_every``: under pure FSDP2 (one copy of each shard), the optimizer update of
    each shard is re-run bitwise by a peer rank once every ``update_replay_every`` steps, and
    each rank's shards are fingerprinted between updates (:mod:`detection.guard.update_replay`:
    the bound, the cost, what it names); ``0``: neither runs. Ignored where a vote already sees
    a wrong update (DDP, HSDP).
    """

    audit_every: int = 0
    audit_mode: AuditMode | str = AuditMode.LOSS
    seed: int = 0
    vote_optimizer_state: bool = False
    halt_on_alarm: bool = True
    inject: tuple[str, ...] = field(default_factory=tuple)
    micro_batches: int = 1
    calibrate: int = 0
    step_checks: bool = True
    skip_update_on_alarm: bool = False
    abft: bool | None = None
    abft_every: int = 8
    defer_decision: bool = False
    stats: StatsConfig = field(default_factory=StatsConfig)
    update_replay_every: int = 8

    def __post_init__(self) -> None:
        if self.audit_every < 0:
            raise GuardConfigError(f"audit_every must be ≥ 0, got {self.audit_every}")
        if self.micro_batches < 1:
            raise GuardConfigError(f"micro_batches must be ≥ 1, got {self.micro_batches}")
        if self.calibrate < 0:
            raise GuardConfigError(f"calibrate must be ≥ 0, got {self.calibrate}")
        if self.abft_every < 1:
            raise GuardConfigError(f"abft_every must be ≥ 1, got {self.abft_every}")
        if self.update_replay_every < 0:
            raise GuardConfigError(
                f"update_replay_every must be ≥ 0, got {self.update_replay_every}"
            )
        try:
            object.__setattr__(self, "audit_mode", AuditMode(self.audit_mode))
        except ValueError:
            raise GuardConfigError(
                f"audit_mode must be 'loss' or 'gradient', got {self.audit_mode!r}"
            ) from None
        object.__setattr__(self, "inject", tuple(self.inject))
        for spec in self.inject:
            FaultSpec.parse(spec)

    @property
    def mode(self) -> AuditMode:
        """``audit_mode`` as the enum (it is normalised to one on construction)."""
        mode = self.audit_mode
        return mode if isinstance(mode, AuditMode) else AuditMode(mode)


class Identity(Protocol):
    """What the guard needs of a rank's identity (``detection.identity.RankIdentity``)."""

    @property
    def node(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


class AlarmSink(Protocol):
    """What the guard needs of the alarm sender (``detection.transport.sender.AlarmSender``)."""

    def send_alarm(self, body: dict[str, Any]) -> str: ...

    def register_ranks(self, ranks: list[dict[str, Any]]) -> None: ...
