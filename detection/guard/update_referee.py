"""A third replay that splits an owner-buddy pair whose update replay differed (world ≥ 3).

When a buddy's replay of its owner's update differs (:mod:`detection.guard.update_replay`),
two results disagree and neither can say which is wrong: the owner may have updated wrong, or
the buddy replayed wrong. A third computation splits them. The *referee* of the pair is the
rank after the buddy, ``(owner + 2) mod W`` — with ``W ≥ 3`` neither of the two. The owner
sends it the very buffer it sent its buddy (kept until the next step), the buddy its replay's
fingerprints; the referee replays the owner's snapshot and compares:

* it agrees with the owner's result, not the buddy's: the buddy replayed wrong — buddy named;
* it agrees with the buddy's, not the owner's: the owner updated wrong — owner named;
* it agrees with neither: three different results, the pair stays named (``ambiguous``).

Two of three bitwise-equal computations against one is the ring audit's kind of evidence, so the
alarm keeps layer ``audit``. The snapshot is the owner's own: a flip in its copy (before the
snapshot was taken, or in it) is a fault of the owner's memory, and the two replays from it
then agree against the owner's result — the owner is named, rightly. The referee receives the
owner's buffer from the owner, not from the buddy, so a buddy that received it corrupted cannot
steer the verdict.

Cost: nothing on a clean step. On a step with a mismatch, one more replay of a slice, the
slice's bytes sent once more, and one all-gather of one word a rank — collective: every rank
takes part, all having decided the same alarm from the same rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from detection.guard.update_payload import Package, replay_payload, ship
from detection.guard.update_replay import ReplayRow, UpdateReplay
from detection.row.gather import all_gather_table
from detection.transport.alarm import Alarm

__all__ = ["BUDDY_WRONG", "NEITHER", "OWNER_WRONG", "referee"]

OWNER_WRONG = 1
BUDDY_WRONG = 2
NEITHER = 3


def _flat(fps: Sequence[torch.Tensor]) -> list[list[int]]:
    """Fingerprints as host integers, one row a tensor (one host read)."""
    rows: list[list[int]] = torch.cat(list(fps)).tolist() if fps else []
    return rows


def referee(
    replay: UpdateReplay, rows: Sequence[ReplayRow], alarm: Alarm, nodes: Sequence[str]
) -> Alarm:
    """The step's replay ``alarm`` with each differing pair refereed by a third replay (see the
    module); unchanged when fewer than three ranks. Collective: every rank, with the same rows."""
    world, rank, device = replay.world_size, replay.rank, replay.device
    buddies = [b for b, r in enumerate(rows) if r.replay]
    if world < 3 or not buddies:
        return alarm
    owner_of = {b: (b - 1) % world for b in buddies}
    referee_of = {b: (b + 1) % world for b in buddies}
    outgoing: dict[int, Package] = {}
    sources: list[int] = []
    for b in buddies:
        o, f = owner_of[b], referee_of[b]
        if rank == o:
            if replay.sent is None:
                raise RuntimeError("a replay mismatch with no snapshot sent this step")
            outgoing[f] = replay.sent  # the owner's own copy, not the buddy's
        if rank == b:
            outgoing[f] = Package(_flat([r.mine for r in replay.results]))
        if rank == f:
            sources = [o, b]
    got = ship(outgoing, sources, device, replay.group)
    verdict = 0
    if sources:
        o, b = sources
        results = replay_payload(got[o], replay.optimizers, device, consume=True)
        third = _flat([r.mine for r in results])
        with_owner = third == _flat([r.post for r in results])
        with_buddy = third == got[b].header
        verdict = (
            BUDDY_WRONG
            if with_owner and not with_buddy
            else OWNER_WRONG
            if with_buddy and not with_owner
            else NEITHER
        )
    verdicts = all_gather_table(torch.tensor([verdict], dtype=torch.int64, device=device))
    return _settled(alarm, buddies, owner_of, referee_of, verdicts[:, 0].tolist(), nodes)


def _settled(
    alarm: Alarm,
    buddies: Sequence[int],
    owner_of: dict[int, int],
    referee_of: dict[int, int],
    verdicts: Sequence[int],
    nodes: Sequence[str],
) -> Alarm:
    named: list[int] = []
    refereed: list[dict[str, object]] = []
    for b in buddies:
        o, f = owner_of[b], referee_of[b]
        verdict = verdicts[f]
        wrong = [o] if verdict == OWNER_WRONG else [b] if verdict == BUDDY_WRONG else [o, b]
        named += wrong
        sided = {OWNER_WRONG: "buddy", BUDDY_WRONG: "owner"}.get(verdict, "neither")
        refereed.append({"owner": o, "buddy": b, "referee": f, "agrees_with": sided})
    ambiguous = any(v["agrees_with"] == "neither" for v in refereed)
    ranks = tuple(sorted(set(named)))
    return dataclasses.replace(
        alarm,
        suspect_ranks=ranks,
        suspect_nodes=tuple(sorted({nodes[r] for r in ranks})),
        detail={
            **alarm.detail,
            "referees": refereed,
            "ambiguous": ambiguous,
            "evidence": "a third replay by the rank after the buddy sided with one of the "
            "pair: two bitwise-equal results against one"
            if not ambiguous
            else "three replays, three results: the pair stays named",
        },
    )
