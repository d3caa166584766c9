"""The sharded guard's step wiring: a step's state, the optimizer hooks, the row, the decision.

:class:`~detection.guard.sharded.ShardedGuard` keeps the training-loop protocol (``step``,
``backward``, the state and the load check); this module runs what a step adds between the
loop's calls and as it ends, so that the guard holds one job and this one another:

* the optimizer hooks refuse an update before the step's last backward or a second one in a
  step (the row's evidence is of one update of one full gradient), and hand each update to the
  buddy replay and custody (:mod:`detection.guard.update_replay`) when they run;
* as the step ends, every rank builds its int64 row — the words
  :class:`~detection.guard.sharded_decision.Row` reads, in its order, then the replay's words,
  then the per-step statistics as float64 bits — all-gathers it in one collective, and decides
  from the table (:class:`~detection.guard.sharded_decision.ShardedDecision`, then the
  referee on a replay mismatch, the ring audit, the per-step statistics).

It holds every layer a step runs, so it also says which those are (:meth:`StepWiring.coverage`,
the words the guard logs at start).

The invariant: every rank decides from the same table, so every rank reaches the same outcome;
the guard raises it and shows it to the checkpoint gate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from detection.gate import StepOutcome
from detection.guard.config import GuardConfig, GuardUsageError
from detection.guard.counters import GuardCounters
from detection.guard.decision import any_nonfinite
from detection.guard.sharded_audit import ShardedAudit, replicas_apart
from detection.guard.sharded_decision import ROW_WORDS, Row, ShardedDecision, word_float
from detection.guard.sharded_hook import CheckedAllGather, CheckedReduceScatter
from detection.guard.sharded_stats import ShardedStats
from detection.guard.update_alarm import NO_REPLAY_WORDS, is_replay_alarm
from detection.guard.update_referee import referee
from detection.guard.update_replay import UpdateReplay
from detection.row.gather import all_gather_table
from detection.weights.fingerprint import fingerprint_on_device
from detection.weights.replicas import ReplicaGroups
from detection.weights.sharded import local_parts

__all__ = ["ShardedStep", "StepWiring", "local_shard"]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The rank's own part of ``t``: a DTensor's local tensor, a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedStep:
    """One guarded step in progress."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.micro = 0
        self.loss: torch.Tensor | None = None
        self.scaled = False
        self.grad_nonfinite: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.stepped: set[int] = set()


class StepWiring:
    """The hooks' checks and the end of a step for one sharded guard (see the module); it holds
    the guard's parts, the guard its protocol."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        *,
        config: GuardConfig,
        counters: GuardCounters,
        replicas: ReplicaGroups,
        shard_ranks: int,
        nodes: Sequence[str],
        decision: ShardedDecision,
        stats: ShardedStats,
        reduce_scatter: CheckedReduceScatter,
        all_gather: CheckedAllGather,
        audit: ShardedAudit | None,
        replay: UpdateReplay | None,
        device: torch.device,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.params = list(params)
        self.config = config
        self.counters = counters
        self.replicas = replicas
        self.shard_ranks = shard_ranks
        self.nodes = tuple(nodes)
        self.decision = decision
        self.stats = stats
        self.reduce_scatter = reduce_scatter
        self.all_gather = all_gather
        self.audit = audit
        self.replay = replay
        self.device = device
        self.group = group
        self.micro_batches = config.micro_batches

    def coverage(self) -> str:
        """What the guard checks each step and what it does not, in words (logged at start)."""
        replicas = self.replicas.replicas
        if replicas >= 3:
            vote = f"weight vote across {replicas} replicas of each shard (names the rank)"
        elif replicas == 2:
            vote = "weight vote across 2 replicas of each shard (detects, cannot name)"
        else:
            vote = "no weight vote (one copy of each shard)"
        if self.replay is None:
            replay = (
                ""
                if replicas >= 2
                else ", update replay and custody off: a wrong update or a "
                "flipped stored weight is not detected"
            )
        elif self.replay.replaying:
            replay = (
                f", update replay by the next rank (every shard once every {self.replay.every} "
                "steps: names owner and buddy), custody of each rank's shards between updates "
                "(names the rank)"
            )
        else:
            replay = ", custody of the shards between updates (one rank: no update replay)"
        audit = f", {self.audit.describe()}" if self.audit is not None else ""
        off = "gradient audit" if self.audit is not None else "ring audit"
        if self.shard_ranks == 1:
            # FSDP2 runs no reduce-scatter or all-gather over a one-rank shard group: the
            # checks that live in them never run, and the replicas' gradient all-reduce mixes
            # a rank's gradient into every copy before anything sees it
            gradients = "non-finite gradient shards after the all-reduce (no rank named), "
            off += (
                ", the checks inside the reduce-scatter and all-gather (shard groups of one "
                "rank run neither: a finite gradient flip reaches every replica alike)"
            )
        else:
            gradients = (
                "non-finite gradients before and after the reduce-scatter, its algebra, the "
                "all-gather's views compared, per-step gradient statistics (step_checks), "
            )
        return (
            f"on: {gradients}non-finite weights, fingerprint, {vote}{replay}{audit}; "
            f"off: {off}, ABFT, optimizer-state vote"
        )

    # -- the optimizer hooks -----------------------------------------------------------------------
    def before_update(self, current: ShardedStep, opt: Any) -> None:
        """Pre-hook: one update a step, after the step's last backward."""
        if id(opt) in current.stepped:
            raise GuardUsageError("optimizer.step() called twice in one guarded step")
        if current.micro < self.micro_batches:
            raise GuardUsageError(
                f"optimizer.step() after {current.micro} of {self.micro_batches} backward "
                "calls: step the optimizer once, after the step's last guard.backward()"
            )
        if self.replay is not None:
            self.replay.before(opt, current.step)

    def after_update(self, current: ShardedStep, opt: Any) -> None:
        """Post-hook: the optimizer stepped (the row says so); custody records what it wrote."""
        current.stepped.add(id(opt))
        if self.replay is not None:
            self.replay.after(opt)

    # -- as the step ends --------------------------------------------------------------------------
    def part(self) -> torch.Tensor:
        """This rank's shards' fingerprint at their unsharded positions (every copy)."""
        parts = local_parts(self.params, every_copy=True)
        if not parts.runs:
            return torch.zeros(2, dtype=torch.int64, device=self.device)
        return fingerprint_on_device(parts.runs, offsets=parts.offsets).to(self.device)

    def decide(self, current: ShardedStep) -> StepOutcome:
        """Build this rank's row, all-gather the table and decide the step from it, alike on
        every rank (collective); the counters are tallied, the alarm is the caller's to raise."""
        if current.micro < self.micro_batches or current.loss is None:
            raise GuardUsageError(
                f"step {current.step} ran {current.micro} of {self.micro_batches} backward "
                "calls through guard.backward()"
            )
        table = all_gather_table(self._row(current), self.group).tolist()
        rows = [Row.read(r[:ROW_WORDS]) for r in table]
        if any(r.step != current.step for r in rows):
            raise GuardUsageError(
                f"ranks are at different steps: {[r.step for r in rows]}: pass every rank the "
                "same step number to guard.step()"
            )
        outcome = self.decision.decide(current.step, rows)
        if self.replay is not None and is_replay_alarm(outcome.alarm):
            assert outcome.alarm is not None
            settled = referee(self.replay, [r.replay for r in rows], outcome.alarm, self.nodes)
            outcome = dataclasses.replace(outcome, alarm=settled)
        if self.audit is not None:
            outcome = self.audit.decide(rows, outcome, replicas_apart(self.decision))
        if outcome.alarm is None and self.config.step_checks:
            floats = [[word_float(w) for w in r[ROW_WORDS:]] for r in table]
            found = self.stats.decide(current.step, floats, learn=True)
            self.counters.step_checks = self.stats.tested
            if found is not None:
                outcome = dataclasses.replace(outcome, alarm=found, vote_passed=False)
        self.counters.steps += 1
        self.counters.nonfinite_checks += 1
        self.counters.votes += int(self.replicas.voting)
        return outcome

    def _row(self, current: ShardedStep) -> torch.Tensor:
        """This rank's row: :class:`Row`'s words, the replay's, then the statistics' bits."""
        # under pure FSDP2, custody's record after the update is the row's part (no pass)
        recorded = self.replay.row_part() if self.replay is not None else None
        mine = recorded if recorded is not None else self.part()
        zero = torch.zeros((), dtype=torch.int64, device=self.device)
        row = torch.stack(
            [
                torch.tensor(current.step, dtype=torch.int64, device=self.device),
                current.grad_nonfinite if current.grad_nonfinite is not None else zero,
                any_nonfinite([local_shard(p) for p in self.params]),
                torch.tensor(int(bool(current.stepped)), dtype=torch.int64, device=self.device),
                torch.tensor(int(current.scaled), dtype=torch.int64, device=self.device),
                self.reduce_scatter.flag,
                torch.tensor(self.reduce_scatter.unchecked, dtype=torch.int64, device=self.device),
                *self.reduce_scatter.sums.view(torch.int64),
                *self.all_gather.view,
                *mine,
                *(self.audit.words() if self.audit is not None else [zero, zero]),
            ]
        )
        replayed = (
            self.replay.exchange()
            if self.replay is not None
            else torch.tensor(NO_REPLAY_WORDS, dtype=torch.int64, device=self.device)
        )
        row = torch.cat([row, replayed])
        return torch.cat([row, self._statistics(current).view(torch.int64)])

    def _statistics(self, current: ShardedStep) -> torch.Tensor:
        """This rank's loss, then its gradient's L2 norm and L∞ per reduce-scatter (float64,
        divided by the GradScaler's scale on a scaled step)."""
        loss = current.loss if current.loss is not None else torch.zeros(())
        calls = self.reduce_scatter.stats
        values = torch.cat(
            [
                loss.detach().to(device=self.device, dtype=torch.float64).reshape(1),
                *(c[:1] for c in calls),
                *(c[1:] for c in calls),
            ]
        )
        if current.scale is not None and calls:
            values[1:] /= current.scale.to(device=self.device, dtype=torch.float64)
        return values
