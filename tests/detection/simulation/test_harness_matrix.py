"""The sharded test matrix on the built-in model, through ``sdcguard train``: FSDP2 on two and
four ranks, HSDP 2x2 and 3x2, every step audited.

Each mesh trains 200 clean steps with an audit every step and raises no alarm. Where a run
then suffers a fault at its end (step 200, or 199 for a flip custody sees at the next step),
the 200 silent steps before it are that fault test's clean run, and the fault is caught as the
sharded guard can catch it:

* HSDP 3x2 (six ranks, two a node, a replica a node) — an activation flip at an audited step:
  its auditor's replay disagrees, that one pair named; a weight flip in one rank's shard after
  the update: the three copies of that shard vote it out, the rank and its node named alone;
  bit 30 of one rank's unsharded gradient before the reduce-scatter: named on its step.
* FSDP2 on four ranks — a weight flip in one rank's shard after the update: no other copy of
  a shard exists, custody of the shards between updates names the rank at the next step
  (within the update replay's bound of ``update_replay_every`` steps).

The short fault runs (five steps, the fault at step 2) carry their own clean evidence: steps
0 and 1 are silent.
"""

from __future__ import annotations

from typing import Any

import pytest

from detection.audit.ring import auditors_of, ring_partners
from detection.harness import TrainConfig, run

pytestmark = pytest.mark.slow

CLEAN_STEPS = 200
FAULT_STEP = 2
HSDP_3X2: dict[str, Any] = {
    "parallel": "hsdp",
    "world_size": 6,
    "ranks_per_node": 2,
    "shard_size": 2,
}


def _job(**options: Any) -> dict[str, Any]:
    return run(TrainConfig(**{"seed": 3, "threads": 1, **options}))


def _alarms(report: dict[str, Any]) -> list[tuple[int, str, str, list[int], list[str]]]:
    return [
        (a["step"], a["layer"], a["phase"], a["suspect_ranks"], a["suspect_nodes"])
        for a in report["alarms"]
    ]


def _auditor_of(report: dict[str, Any], rank: int) -> int:
    nodes = [report["nodes"][str(r)] for r in range(report["world_size"])]
    return auditors_of(ring_partners(nodes))[rank]


@pytest.mark.parametrize(
    "mesh",
    [
        pytest.param({"parallel": "fsdp", "world_size": 2}, id="fsdp-2"),
        pytest.param({"parallel": "hsdp", "world_size": 4, "ranks_per_node": 2}, id="hsdp-2x2"),
    ],
)
def test_the_built_in_model_trains_200_audited_steps_without_an_alarm(
    mesh: dict[str, Any],
) -> None:
    report = _job(**mesh, steps=CLEAN_STEPS, audit_every=1)
    assert report["alarms"] == []
    assert report["steps"] == CLEAN_STEPS


def test_hsdp_3x2_trains_200_audited_steps_silent_then_catches_an_activation_flip() -> None:
    """Rank 3's forward at step 200 (audited) loses bit 30 of one output element; its replays
    of other ranks' micro-batches that step stay clean (a transient upset does not repeat), so
    exactly one pair disagrees: rank 3 and its auditor, on step 200. The 200 steps before are
    silent."""
    flipped = 3
    report = _job(
        **HSDP_3X2, steps=CLEAN_STEPS + 1, audit_every=1, inject=[f"act-flip@{flipped}:200"]
    )
    auditor = _auditor_of(report, flipped)
    nodes = report["nodes"]
    assert _alarms(report) == [
        (
            CLEAN_STEPS,
            "audit",
            "loss",
            sorted([auditor, flipped]),
            sorted({nodes[str(auditor)], nodes[str(flipped)]}),
        )
    ]
    assert report["alarms"][0]["detail"]["mismatched_pairs"] == [
        {"auditor": auditor, "audited": flipped}
    ]


def test_hsdp_3x2_names_the_rank_and_node_whose_shard_flipped_after_the_update() -> None:
    """Rank 3 holds shard 1 of replica 1; ranks 1 and 5 hold its other copies. Its copy flips
    after step 2's update: two copies against one, rank 3 (node-1) is named, unambiguously."""
    report = _job(**HSDP_3X2, steps=5, inject=[f"weight-flip@3:{FAULT_STEP}"])
    assert _alarms(report) == [(FAULT_STEP, "fingerprint", "weights", [3], ["node-1"])]
    detail = report["alarms"][0]["detail"]
    assert detail["ambiguous"] is False
    assert detail["replica_groups_split"] == [[1, 3, 5]]


def test_hsdp_3x2_names_a_gradient_flip_before_the_reduce_scatter_on_its_step() -> None:
    """Bit 30 of one element of rank 3's unsharded gradient at step 2: its gradient's L∞
    stands out against its own history on the reduce-scatter's input; rank 3 is named."""
    report = _job(**HSDP_3X2, steps=5, inject=[f"grad-flip@3:{FAULT_STEP}"])
    assert _alarms(report) == [(FAULT_STEP, "gradstats", "pre-allreduce", [3], ["node-1"])]
    assert report["alarms"][0]["detail"]["collective"] == "reduce-scatter"


def test_fsdp2_on_four_ranks_trains_200_audited_steps_silent_then_custody_names_a_flip() -> None:
    """Steps 0..199 audited and silent. Rank 2's shards flip after step 199's update; nothing
    else holds a copy, but custody fingerprints each rank's shards after its update and again
    before the next: at step 200 rank 2 alone is named (one copy's history, not a vote)."""
    report = _job(
        parallel="fsdp",
        world_size=4,
        steps=CLEAN_STEPS + 1,
        audit_every=1,
        inject=[f"weight-flip@2:{CLEAN_STEPS - 1}"],
    )
    assert _alarms(report) == [(CLEAN_STEPS, "fingerprint", "weights", [2], ["node-2"])]
    detail = report["alarms"][0]["detail"]
    assert (detail["check"], detail["ranks"], detail["majority"]) == ("custody", [2], False)
