"""The decision of a sharded step (FSDP2, HSDP), the same on every rank from the same rows.

Each rank's row says: its step, whether its own gradient held a non-finite value before the
reduce-scatter (:mod:`detection.guard.sharded_hook`), whether the gradient shards it holds
after the reduce-scatter do, whether its weight shards do after the update, whether an optimizer
stepped, whether a GradScaler scaled the loss, its shard's fingerprint (at unsharded
positions) and, last, the ring audit's two words — its own loss and its partner's loss
recomputed (:mod:`detection.guard.sharded_audit`, which decides the audit after the layers
below). At most one alarm a step, the first that applies:

1. **A non-finite gradient** (no GradScaler: under one, an overflow is the scaler's to skip).
   Seen in a rank's own gradient before the reduce-scatter: that rank is named
   (``pre-allreduce``). Seen only in the shards after it (``post-allreduce``): the collective
   itself made it — it sums every rank's gradient into each shard, so the shard that holds
   the NaN says nothing about where it arose, and no rank is named.
2. **Non-finite weights after finite gradients**: the update of the ranks whose shards went
   non-finite produced them — those ranks are named. Weights already known non-finite (a NaN
   gradient applied, an alarm raised) are a consequence, not a new event.
3. **The reduce-scatter's algebra**: the shards' sum against the inputs' (scaled), beyond
   the rounding bound (:mod:`detection.guard.sharded_hook`): alarm ``allreduce``, no rank
   named.
4. **The all-gather's views**: every rank of an all-gather group received the same bytes
   (:class:`~detection.guard.sharded_hook.CheckedAllGather`); a rank whose view differs is
   named by a strict majority of three or more, two say that they differ (alarm
   ``allreduce/forward``).
5. **A replica split** (HSDP): a replicate group's copies of its shard disagree
   (:mod:`detection.weights.replicas`) — three or more copies name the divergent ranks, two
   say that they differ. A split seen before is a consequence; a new one is raised.
6. **The update replay** (pure FSDP2, :mod:`detection.guard.update_replay`): a buddy's bitwise
   replay of its owner's update differs — the pair is named, owner and buddy.

Before all of these, **custody** (pure FSDP2): a rank's own shards changed between two updates
with nobody writing them — that rank is named; it comes first because everything the step
computed from the changed weights (a non-finite gradient on every rank) is its consequence.

``vote_passed`` — the checkpoint gate's evidence — is true only where there was a vote
(two or more replicas) and it passed: pure FSDP2 never verifies a checkpoint by vote.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from detection.gate import StepOutcome
from detection.guard.update_alarm import (
    NO_REPLAY,
    REPLAY_WORDS,
    ReplayRow,
    custody_alarm,
    replay_alarm,
)
from detection.transport.alarm import Alarm, Layer, Phase
from detection.weights.fingerprint import Fingerprint, to_fingerprint
from detection.weights.replicas import ReplicaGroups, replica_vote
from detection.weights.vote import KnownDivergence

__all__ = ["ROW_WORDS", "Row", "ShardedDecision", "word_float"]

#: The words of :class:`Row`; a guard's row carries the per-step statistics after them.
ROW_WORDS = 16 + REPLAY_WORDS


def word_float(word: int) -> float:
    """A float64 sent as the int64 with its bits."""
    value: float = struct.unpack("<d", struct.pack("<q", word))[0]
    return value


def _algebra(step: int, rows: Sequence[Row]) -> Alarm | None:
    """The reduce-scatter's shards against its inputs (:mod:`detection.guard.sharded_hook`):
    a residual beyond every rank's rounding margin together cannot be rounding."""
    values = [v for r in rows for v in (r.reduced_in, r.margin, r.reduced_out)]
    if any(r.unchecked for r in rows) or not all(math.isfinite(v) for v in values):
        return None  # an unreadable scale, or non-finite values: the non-finite check's
    expected = math.fsum(r.reduced_in for r in rows)
    got = math.fsum(r.reduced_out for r in rows)
    bound = math.fsum(r.margin for r in rows)
    if abs(got - expected) <= bound:
        return None
    return Alarm.for_ranks(
        step,
        Layer.ALLREDUCE,
        Phase.POST_ALLREDUCE,
        (),
        (),
        {
            "collective": "reduce-scatter",
            "expected": expected,
            "got": got,
            "residual": abs(got - expected),
            "bound": bound,
        },
    )


@dataclass(frozen=True)
class Row:
    """One rank's evidence for one step, as all-gathered."""

    step: int
    grad_nonfinite: bool
    weights_nonfinite: bool
    stepped: bool
    scaled: bool
    own_nonfinite: bool
    unchecked: int  # reduce-scatters whose scale the check could not read
    reduced_in: float  # c·Σ of this rank's reduce-scatter inputs
    margin: float  # its share of the rounding bound
    reduced_out: float  # Σ of the shards it received
    gathered: Fingerprint  # what it received from the step's all-gathers
    part: Fingerprint
    audited_loss: int = 0  # the ring audit (detection.guard.sharded_audit): own loss bits
    replayed_loss: int = 0  # and its partner's loss recomputed here (0 when not audited)
    replay: ReplayRow = NO_REPLAY  # custody and the update replay (the last words)

    @classmethod
    def read(cls, words: Sequence[int]) -> Row:
        step, grad_nf, weights_nf, stepped, scaled, own_nf, unchecked, s_in, bound, s_out = words[
            :10
        ]
        ga, gb, a, b = words[10:14]
        audited, replayed = words[14:16]
        return cls(
            step=step,
            grad_nonfinite=bool(grad_nf),
            weights_nonfinite=bool(weights_nf),
            stepped=bool(stepped),
            scaled=bool(scaled),
            own_nonfinite=bool(own_nf),
            unchecked=unchecked,
            reduced_in=word_float(s_in),
            margin=word_float(bound),
            reduced_out=word_float(s_out),
            gathered=to_fingerprint(ga, gb),
            part=to_fingerprint(a, b),
            audited_loss=audited,
            replayed_loss=replayed,
            replay=ReplayRow.read(words[16:ROW_WORDS]),
        )


class ShardedDecision:
    """What every rank concludes from one step's rows; keeps what is already known (a
    poisoned model, a split already alarmed) so that consequences are not new events."""

    def __init__(
        self,
        replicas: ReplicaGroups,
        nodes: Sequence[str],
        gatherers: ReplicaGroups | None = None,
        names: Sequence[str] = (),
    ) -> None:
        self.replicas = replicas
        self.names = tuple(names)  # the parameters' names, for the replay's detail
        self.gatherers = gatherers
        self.nodes = tuple(nodes)
        self.poisoned = False  # weights known non-finite, after an alarm said why
        self.known = {group: KnownDivergence() for group in replicas.groups}

    def decide(self, step: int, rows: Sequence[Row]) -> StepOutcome:
        parts = [r.part for r in rows]
        whole = self.replicas.whole(parts)
        verdict = replica_vote(parts, self.replicas)
        replay = [r.replay for r in rows]
        alarm = (
            custody_alarm(step, replay, self.nodes)
            or self._nonfinite(step, rows)
            or _algebra(step, rows)
            or self._gathered(step, rows)
            or self._split(step, parts)
            or replay_alarm(step, replay, self.nodes, self.names)
        )
        finite = not any(r.weights_nonfinite for r in rows)
        if finite:
            self.poisoned = False
        return StepOutcome(
            step=step,
            ranks=tuple(range(len(rows))),
            fingerprint=whole,
            vote_passed=self.replicas.voting and verdict.passed and finite and alarm is None,
            alarm=alarm,
        )

    def _nonfinite(self, step: int, rows: Sequence[Row]) -> Alarm | None:
        own = [rank for rank, r in enumerate(rows) if r.own_nonfinite]
        holding = [rank for rank, r in enumerate(rows) if r.grad_nonfinite]
        scaled = any(r.scaled for r in rows)
        if own and not scaled:
            self.poisoned = self.poisoned or any(r.stepped for r in rows)
            return Alarm.for_ranks(
                step,
                Layer.NONFINITE,
                Phase.PRE_ALLREDUCE,
                own,
                self.nodes,
                {"ranks": own, "ranks_holding_nonfinite_shards": holding},
            )
        if holding and not scaled:
            self.poisoned = self.poisoned or any(r.stepped for r in rows)
            return Alarm.for_ranks(
                step,
                Layer.NONFINITE,
                Phase.POST_ALLREDUCE,
                (),
                self.nodes,
                {
                    "ranks_holding_nonfinite_shards": holding,
                    "attribution": "none: every rank's own gradient was finite; the "
                    "reduce-scatter, which sums them into each shard, made it",
                },
            )
        bad = [rank for rank, r in enumerate(rows) if r.weights_nonfinite]
        if not bad or self.poisoned:
            return None
        self.poisoned = True
        return Alarm.for_ranks(
            step,
            Layer.NONFINITE,
            Phase.WEIGHTS,
            bad,
            self.nodes,
            {"ranks_with_nonfinite_shards": bad, "gradients": "finite"},
        )

    def _gathered(self, step: int, rows: Sequence[Row]) -> Alarm | None:
        """The ranks of one all-gather group received the same bytes, or some did not."""
        if self.gatherers is None:
            return None
        verdict = replica_vote([r.gathered for r in rows], self.gatherers)
        if verdict.passed:
            return None
        named = verdict.divergent if verdict.culprit_known else ()
        return Alarm.for_ranks(
            step,
            Layer.ALLREDUCE,
            Phase.FORWARD,
            named,
            self.nodes,
            {
                "collective": "all-gather",
                "groups_split": [list(g) for g in verdict.split],
                "ambiguous": not verdict.culprit_known,
            },
        )

    def _split(self, step: int, parts: Sequence[Fingerprint]) -> Alarm | None:
        if not self.replicas.voting:
            return None
        verdict = replica_vote(parts, self.replicas)
        new = [g for g in verdict.split if self.known[g].is_new([parts[r] for r in g])]
        for group in self.replicas.groups:
            values = [parts[r] for r in group]
            if group in verdict.split:
                self.known[group].record(values)
            else:
                self.known[group].clear()
        if not new:
            return None
        in_new = {r for g in new for r in g}
        named = [r for r in verdict.divergent if r in in_new] if verdict.culprit_known else []
        return Alarm.for_ranks(
            step,
            Layer.FINGERPRINT,
            Phase.WEIGHTS,
            named,
            self.nodes,
            {
                "replica_groups_split": [list(g) for g in new],
                "ambiguous": not verdict.culprit_known,
                "fingerprints": {str(r): parts[r].hex() for g in new for r in g},
            },
        )
