"""The words custody and the update replay add to a sharded step's row, and the alarms read
from them.

:mod:`detection.guard.update_replay` runs the two checks on each rank and writes their
:data:`REPLAY_WORDS` words; every rank then reads every rank's words from the all-gathered
table (:class:`ReplayRow`) and decides from them alike
(:mod:`detection.guard.sharded_decision`): custody names a rank whose own shards changed with
no update writing them (:func:`custody_alarm`), a replay that differs names the pair, owner
first (:func:`replay_alarm`), which a third replay may split
(:mod:`detection.guard.update_referee`, when :func:`is_replay_alarm`). Kept apart from the
checks so that reading a row and deciding from it needs none of the replay's machinery, and
the word layout is stated once for the writer and the readers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from detection.transport.alarm import Alarm, Layer, Phase

__all__ = [
    "NO_REPLAY",
    "NO_REPLAY_WORDS",
    "PARAM_MISMATCH",
    "REPLAY_WORDS",
    "STATE_CHANGED",
    "STATE_MISMATCH",
    "WEIGHTS_CHANGED",
    "ReplayRow",
    "custody_alarm",
    "is_replay_alarm",
    "replay_alarm",
]

#: The row words of custody and the update replay: custody (bit 0: weights changed, bit 1:
#: their state), replay verdict (bit 0: parameter, bit 1: state), first mismatching parameter's
#: index (-1: none), elements replayed.
REPLAY_WORDS = 4

#: The custody word's bits: the rank's weight shards, their optimizer state changed.
WEIGHTS_CHANGED = 1
STATE_CHANGED = 2
#: The replay verdict's bits: the replayed parameter, its optimizer state differs.
PARAM_MISMATCH = 1
STATE_MISMATCH = 2

_REPLAY_CHECK = "update-replay"


@dataclass(frozen=True)
class ReplayRow:
    """The custody and replay words of one rank's row."""

    custody: int  # this rank's own shards changed between two updates: bit 0 weights, bit 1
    # their optimizer state
    replay: int  # its replay of its owner's slice: 0 agrees (or none), bit 0/1 differ
    param: int  # the first parameter that differed (-1: none)
    replayed: int  # elements it replayed

    @classmethod
    def read(cls, words: Sequence[int]) -> ReplayRow:
        custody, replay, param, replayed = words[:REPLAY_WORDS]
        return cls(custody, replay, param, replayed)


#: The words of a step with neither check (HSDP, ``update_replay_every=0``), and as read.
NO_REPLAY_WORDS = (0, 0, -1, 0)
NO_REPLAY = ReplayRow.read(NO_REPLAY_WORDS)


def is_replay_alarm(alarm: Alarm | None) -> bool:
    """Whether ``alarm`` is :func:`replay_alarm`'s (a pair a third replay may split)."""
    return alarm is not None and alarm.detail.get("check") == _REPLAY_CHECK


def custody_alarm(step: int, rows: Sequence[ReplayRow], nodes: Sequence[str]) -> Alarm | None:
    """The ranks whose own shards (weights, or their optimizer state) changed between two
    updates, named alone (decided alike on every rank from the same rows)."""
    broken = [rank for rank, r in enumerate(rows) if r.custody]
    if not broken:
        return None
    weights = [rank for rank in broken if rows[rank].custody & WEIGHTS_CHANGED]
    state = [rank for rank in broken if rows[rank].custody & STATE_CHANGED]
    return Alarm.for_ranks(
        step,
        Layer.FINGERPRINT,
        Phase.WEIGHTS if weights else Phase.OPTIMIZER_STATE,
        broken,
        nodes,
        {
            "check": "custody",
            "ranks": broken,
            "weights_changed": weights,
            "state_changed": state,
            "majority": False,
            "evidence": "the rank's own shards changed between its last update and this one, "
            "with no update writing them (one copy's history, not a vote)",
        },
    )


def replay_alarm(
    step: int, rows: Sequence[ReplayRow], nodes: Sequence[str], names: Sequence[str] = ()
) -> Alarm | None:
    """A buddy's replay that differs from its owner's update: the pair named, owner first
    (decided alike on every rank from the same rows)."""
    world = len(rows)
    differ = [(buddy, r) for buddy, r in enumerate(rows) if r.replay]
    if not differ:
        return None
    pairs = [((buddy - 1) % world, buddy) for buddy, _ in differ]
    in_param = any(r.replay & PARAM_MISMATCH for _, r in differ)
    return Alarm.for_ranks(
        step,
        Layer.AUDIT,
        Phase.WEIGHTS if in_param else Phase.OPTIMIZER_STATE,
        [rank for pair in pairs for rank in pair],
        nodes,
        {
            "check": _REPLAY_CHECK,
            "pairs": [list(p) for p in pairs],  # owner first, buddy second
            "parameters": [
                names[r.param] if 0 <= r.param < len(names) else r.param for _, r in differ
            ],
            "replayed_elements": [r.replayed for _, r in differ],
            "ambiguous": True,
            "evidence": "the buddy's replay of the owner's update differs bitwise: the owner "
            "updated wrong or the buddy replayed wrong; two results cannot say which",
        },
    )
