"""Every fault kind through ``sdcguard train`` (4 ranks): the alarm's step, layer, phase and —
where the design can name it — the suspect; and faults the design cannot see, unseen.

Ring for 4 ranks on 4 nodes: 0 → 2 → 1 → 3 → 0 (rank r recomputes the next one), so rank 2
is audited by rank 0. The per-step layer, armed from the first step, names a gradient or
activation flip on its own step before any audit: the tests of the audit itself turn it off
(``step_checks=False``), as a job whose per-step layer is off runs. Each case runs to its end
unless it says ``halt``; "exactly these alarms" therefore also shows that consequences of a
fault (NaN weights, a diverged replica) are not reported again as new events.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from detection.audit.ring import ring_partners
from detection.harness import TrainConfig, run

NODES4 = [f"node-{r}" for r in range(4)]


def _alarms(report: dict[str, Any]) -> list[tuple[int, str, str, list[int], list[str]]]:
    return [
        (a["step"], a["layer"], a["phase"], a["suspect_ranks"], a["suspect_nodes"])
        for a in report["alarms"]
    ]


def _job(*inject: str, **options: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"world_size": 4, "steps": 8, "audit_every": 4, "seed": 3}
    return run(TrainConfig(**{**base, **options, "inject": list(inject)}))


def test_ring_used_below_audits_rank_2_from_rank_0() -> None:
    assert ring_partners(NODES4) == [2, 3, 1, 0]


def test_nan_in_a_local_gradient_names_its_rank_before_allreduce() -> None:
    report = _job("grad-nan@2:3")
    assert _alarms(report) == [(3, "nonfinite", "pre-allreduce", [2], ["node-2"])]
    detail = report["alarms"][0]["detail"]
    assert detail["pre_allreduce_ranks"] == [2]
    assert detail["post_allreduce_ranks"] == [0, 1, 2, 3]  # the average carried it everywhere


def test_flip_after_allreduce_is_named_by_the_weight_vote_and_the_allreduce_check() -> None:
    """The strict-majority vote leads; in the same alarm the per-step layer had seen rank 1's
    reduced bucket differ before the update, and the huge element squared to inf in rank 1's
    Adam state."""
    report = _job("reduced-flip@1:5")
    assert _alarms(report) == [(5, "fingerprint", "weights", [1], ["node-1"])]
    also = report["alarms"][0]["detail"]["also"]
    assert [(a["layer"], a["suspect_ranks"]) for a in also] == [
        ("allreduce", [1]),
        ("optstate", [1]),
    ]


def test_weight_flip_is_named_by_the_vote_and_quarantines_checkpoints(tmp_path: Path) -> None:
    report = _job("weight-flip@3:2", checkpoint_dir=tmp_path, checkpoint_every=2)
    assert _alarms(report) == [(2, "fingerprint", "weights", [3], ["node-3"])]
    assert report["alarms"][0]["detail"]["diverged"] == "weights"
    assert [(c["step"], c["status"]) for c in report["checkpoints"]] == [
        (0, "verified"),
        (2, "quarantined"),
        (4, "quarantined"),
        (6, "quarantined"),
    ]


def test_optimizer_state_flip_is_named_when_it_reaches_the_weights() -> None:
    """The vote reads the weights (the default): state corrupted after step 6 makes rank 0's
    update of step 7 come out wrong, and step 7 is the alarm's step."""
    report = _job("optim-flip@0:6")
    assert _alarms(report) == [(7, "fingerprint", "weights", [0], ["node-0"])]
    assert report["alarms"][0]["detail"]["diverged"] == "weights"


def test_two_replicas_can_only_say_that_they_differ() -> None:
    report = _job("weight-flip@1:2", world_size=2)
    assert _alarms(report) == [(2, "fingerprint", "weights", [], [])]
    assert report["alarms"][0]["detail"]["culprit"] == "unknown"


def test_activation_flip_at_an_audited_step_fails_the_loss_audit() -> None:
    report = _job("act-flip@2:4", step_checks=False)
    # one disagreeing pair (0 recomputed 2): either side may have erred, both are named
    assert _alarms(report) == [(4, "audit", "loss", [0, 2], ["node-0", "node-2"])]
    assert report["alarms"][0]["detail"]["mismatched_pairs"] == [{"auditor": 0, "audited": 2}]


def test_gradient_flip_at_an_audited_step_fails_the_gradient_audit() -> None:
    report = _job("grad-flip@2:4", audit_mode="gradient", step_checks=False)
    assert _alarms(report) == [(4, "audit", "gradient", [0, 2], ["node-0", "node-2"])]


def test_an_upset_of_the_auditor_s_recomputation_leaves_only_the_pair(
    clean_reference: dict[str, Any],
) -> None:
    """The case the ring audit can only pin on a pair with the per-step layer armed: the upset
    strikes rank 0's recomputation of rank 2's micro-batch (``in=recompute``), not a training
    step. Training stays clean — the per-step layer, every checksum on every step, rightly
    sees nothing, and the weights end as the clean run's — while the audit's one disagreeing
    pair names both sides."""
    report = _job("act-flip@0:4:in=recompute", steps=10, abft_every=1)
    assert _alarms(report) == [(4, "audit", "loss", [0, 2], ["node-0", "node-2"])]
    assert report["alarms"][0]["detail"]["mismatched_pairs"] == [{"auditor": 0, "audited": 2}]
    assert report["final_fingerprint"] == clean_reference["final_fingerprint"]


def test_faults_only_the_per_step_layer_sees_from_the_first_steps(
    clean_reference: dict[str, Any],
) -> None:
    """A finite corruption before all-reduce at a step without audit (and a gradient flip under
    loss-only audits) is averaged into every replica: no replica layer can see it. Without the
    per-step layer nothing does (the final weights differ from the clean run's: the faults did
    strike); with it — armed from the first step, before the statistics learnt anything — and
    every checksum checked on every step (``abft_every=1``; the default's rotation checks a
    layer once every 8 steps), each is named on its own step by its layer's checksum, bit 30
    and bit 26 alike."""
    faults = ("grad-flip@1:5", "act-flip@3:6", "grad-flip@2:4")
    unseen = _job(*faults, steps=10, step_checks=False)
    assert unseen["alarms"] == []
    assert unseen["final_fingerprint"] != clean_reference["final_fingerprint"]
    full = {"steps": 10, "abft_every": 1}
    seen = [(step, layer, ranks) for step, layer, _, ranks, _ in _alarms(_job(*faults, **full))]
    assert seen == [(4, "abft", [2]), (5, "abft", [1]), (6, "abft", [3])]
    low = [
        (s, layer, r)
        for s, layer, _, r, _ in _alarms(_job(*(f + ":26" for f in faults[:2]), **full))
    ]
    assert low == [(5, "abft", [1]), (6, "abft", [3])]


def test_persistent_fault_under_the_ring_names_its_node_and_halts(tmp_path: Path) -> None:
    report = _job(
        "act-flip@node=node-2:from=3",
        audit_every=2,
        halt_on_alarm=True,
        trace=tmp_path / "trace.jsonl",
        step_checks=False,
    )
    # rank 2 is wrong in its own result and in its recomputation of rank 1: the suspect
    assert _alarms(report) == [(4, "audit", "loss", [2], ["node-2"])]
    assert report["alarms"][0]["detail"]["mismatched_pairs"] == [
        {"auditor": 0, "audited": 2},
        {"auditor": 2, "audited": 1},
    ]
    steps = [json.loads(x)["step"] for x in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]  # every rank stopped right after the alarm's step


def test_persistent_gradient_fault_is_named_by_gradient_audits() -> None:
    report = _job(
        "grad-flip@node=node-1",
        audit_mode="gradient",
        audit_every=3,
        steps=4,
        halt_on_alarm=True,
        step_checks=False,
    )
    assert _alarms(report) == [(0, "audit", "gradient", [1], ["node-1"])]


@pytest.mark.parametrize("ranks_per_node", [2])
def test_persistent_weight_fault_is_one_event(ranks_per_node: int) -> None:
    """Both ranks of node-1 flip a weight at every step from step 2: one alarm, named by the
    majority. The growing divergence of the same replicas — and the non-finite gradients they
    produce once a flip lands on a weight near 1.0 — follow from it and are not new events."""
    report = _job("weight-flip@node=node-1:from=2", ranks_per_node=ranks_per_node, world_size=6)
    assert _alarms(report) == [(2, "fingerprint", "weights", [2, 3], ["node-1"])]


def test_probe_names_the_first_submodule_a_persistent_fault_touches(tmp_path: Path) -> None:
    """The diagnostic replay's probe: per-submodule fingerprints of forward outputs and input
    gradients per rank. With a persistent fault in ``blocks.0.mlp.fc`` of node-1 from step 2,
    at step 2 every rank but 1 matches a clean run, and rank 1 first differs in that module."""
    clean, faulty = tmp_path / "clean.json", tmp_path / "faulty.json"
    _job(steps=3, audit_every=0, probe_step=2, probe=clean)
    _job(
        "act-flip@node=node-1:from=2/blocks.0.mlp.fc",
        steps=3,
        audit_every=0,
        probe_step=2,
        probe=faulty,
    )
    a, b = json.loads(clean.read_text()), json.loads(faulty.read_text())
    assert set(a) == {"step", "ranks", "order", "kinds"}
    assert a["step"] == 2
    assert sorted(a["ranks"]) == ["0", "1", "2", "3"]
    assert set(a["ranks"]["0"]) == {"forward", "backward"}
    assert a["order"][:2] == ["embed", "pos"]
    assert a["order"][-1] == "head"
    assert a["kinds"]["blocks.0.mlp.fc"] == "Linear"
    assert a["kinds"]["blocks.0.norm2"] == "_TokenBatchNorm"
    for rank in ("0", "2", "3"):
        assert a["ranks"][rank] == b["ranks"][rank]
    first = next(
        m for m in a["order"] if a["ranks"]["1"]["forward"][m] != b["ranks"]["1"]["forward"][m]
    )
    assert first == "blocks.0.mlp.fc"
