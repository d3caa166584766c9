"""The decision of a sharded step from its rows: one alarm a step, the right one, and
consequences of a known event not raised again."""

from __future__ import annotations

from detection.guard.sharded_decision import Row, ShardedDecision
from detection.transport.alarm import Layer, Phase
from detection.weights.fingerprint import Fingerprint
from detection.weights.replicas import ReplicaGroups

NODES = ("node-0", "node-0", "node-1", "node-1")
FOUR_REPLICAS = ReplicaGroups.of_mesh([[0], [1], [2], [3]])
FSDP = ReplicaGroups.of_mesh([[0, 1, 2, 3]])
ONE_GATHER = ReplicaGroups(((0, 1, 2, 3),))


def _row(
    step: int = 1,
    *,
    gathered: int = 3,
    part: int = 7,
    own: bool = False,
    shard: bool = False,
    weights: bool = False,
    scaled: bool = False,
) -> Row:
    return Row(
        step,
        shard,
        weights,
        True,
        scaled,
        own,
        0,
        1.0,
        1e-6,
        1.0,
        Fingerprint(gathered, gathered),
        Fingerprint(part, part),
    )


def test_a_clean_step_passes_the_vote_only_where_there_is_one() -> None:
    rows = [_row()] * 4
    voted = ShardedDecision(FOUR_REPLICAS, NODES).decide(1, rows)
    assert (voted.alarm, voted.vote_passed, voted.fingerprint) == (None, True, Fingerprint(7, 7))
    alone = ShardedDecision(FSDP, NODES).decide(1, rows)
    assert (alone.alarm, alone.vote_passed) == (None, False)  # no copy to compare: no evidence
    assert alone.fingerprint == Fingerprint(28, 28)  # four shards summed


def test_a_nonfinite_gradient_is_named_before_the_reduce_scatter_and_not_after() -> None:
    rows = [_row(shard=True), _row(own=True, shard=True), _row(), _row()]
    alarm = ShardedDecision(FSDP, NODES).decide(1, rows).alarm
    assert alarm is not None
    assert (alarm.layer, alarm.phase, alarm.suspect_ranks) == (
        Layer.NONFINITE,
        Phase.PRE_ALLREDUCE,
        (1,),
    )
    rows = [_row(shard=True), _row(), _row(), _row()]
    alarm = ShardedDecision(FSDP, NODES).decide(1, rows).alarm
    assert alarm is not None
    assert (alarm.phase, alarm.suspect_ranks) == (Phase.POST_ALLREDUCE, ())
    scaled = [_row(own=True, shard=True, scaled=True)] + [_row(scaled=True)] * 3
    assert ShardedDecision(FSDP, NODES).decide(1, scaled).alarm is None  # the scaler's overflow


def test_nonfinite_weights_after_finite_gradients_name_the_owner_once() -> None:
    decision = ShardedDecision(FSDP, NODES)
    rows = [_row(), _row(), _row(weights=True), _row()]
    alarm = decision.decide(1, rows).alarm
    assert alarm is not None
    assert (alarm.phase, alarm.suspect_ranks, alarm.suspect_nodes) == (
        Phase.WEIGHTS,
        (2,),
        ("node-1",),
    )
    assert decision.decide(2, [_row(2, weights=True)] * 4).alarm is None  # its consequence


def test_a_split_is_raised_once_and_a_new_split_again() -> None:
    decision = ShardedDecision(FOUR_REPLICAS, NODES)
    alarm = decision.decide(1, [_row(), _row(), _row(part=8), _row()]).alarm
    assert alarm is not None
    assert (alarm.layer, alarm.suspect_ranks, alarm.detail["ambiguous"]) == (
        Layer.FINGERPRINT,
        (2,),
        False,
    )
    assert decision.decide(2, [_row(2), _row(2), _row(2, part=8), _row(2)]).alarm is None
    again = decision.decide(3, [_row(3), _row(3, part=9), _row(3, part=8), _row(3)]).alarm
    assert again is not None
    assert again.suspect_ranks == ()  # 2 of 4 agree: no strict majority
    assert again.detail["ambiguous"] is True


def test_the_reduce_scatter_algebra_allows_rounding_and_nothing_more() -> None:
    def rows(out: float, *, unchecked: int = 0) -> list[Row]:
        first = Row(
            1,
            False,
            False,
            True,
            False,
            False,
            unchecked,
            2.0,
            1e-6,
            out,
            Fingerprint(3, 3),
            Fingerprint(7, 7),
        )
        return [first, *[_row()] * 3]  # the others: in 1.0, out 1.0, margin 1e-6 each

    assert ShardedDecision(FSDP, NODES).decide(1, rows(2.0 + 3.9e-6)).alarm is None
    alarm = ShardedDecision(FSDP, NODES).decide(1, rows(2.0 + 4.1e-6)).alarm
    assert alarm is not None
    assert (alarm.layer, alarm.phase, alarm.suspect_ranks) == (
        Layer.ALLREDUCE,
        Phase.POST_ALLREDUCE,
        (),
    )
    assert alarm.detail["bound"] == 4e-6
    assert ShardedDecision(FSDP, NODES).decide(1, rows(3.0, unchecked=1)).alarm is None


def test_a_rank_that_gathered_other_bytes_is_named_by_a_majority() -> None:
    decision = ShardedDecision(FSDP, NODES, ONE_GATHER)
    assert decision.decide(1, [_row()] * 4).alarm is None
    alarm = decision.decide(2, [_row(2), _row(2), _row(2), _row(2, gathered=4)]).alarm
    assert alarm is not None
    assert (alarm.layer, alarm.phase, alarm.suspect_ranks) == (Layer.ALLREDUCE, Phase.FORWARD, (3,))
    pair = ShardedDecision(ReplicaGroups.of_mesh([[0, 1]]), NODES, ReplicaGroups(((0, 1),)))
    alarm = pair.decide(1, [_row(), _row(gathered=4)]).alarm
    assert alarm is not None
    assert (alarm.suspect_ranks, alarm.detail["ambiguous"]) == ((), True)
