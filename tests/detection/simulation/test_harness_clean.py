"""``sdcguard train`` without faults: no false alarm in 500 audits per mode, bitwise
determinism and resume, the report exactly as DESIGN."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from detection.harness import TrainConfig, run
from detection.simulation.model import ModelConfig

STEPS = 125  # x 4 ranks, audit_every=1: 500 audits


@pytest.fixture(scope="module")
def loss_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """4 ranks x 125 loss-audited steps, checkpoints every 25 steps, a trace."""
    work = tmp_path_factory.mktemp("clean-loss")
    report = run(
        TrainConfig(
            world_size=4,
            steps=STEPS,
            audit_every=1,
            audit_mode="loss",
            seed=11,
            checkpoint_dir=work / "ckpt",
            checkpoint_every=25,
            report=work / "report.json",
            trace=work / "trace.jsonl",
        )
    )
    return report, work


@pytest.fixture(scope="module")
def gradient_run() -> dict[str, Any]:
    """4 ranks on 2 nodes x 125 gradient-audited steps."""
    return run(
        TrainConfig(
            world_size=4,
            ranks_per_node=2,
            steps=STEPS,
            audit_every=1,
            audit_mode="gradient",
            seed=11,
        )
    )


def test_model_has_dropout_and_batchnorm() -> None:
    cfg = ModelConfig()
    assert cfg.dropout > 0
    assert cfg.mlp_norm == "batch"


def test_500_loss_audits_of_a_clean_run_raise_no_alarm(
    loss_run: tuple[dict[str, Any], Path],
) -> None:
    report, _ = loss_run
    assert report["alarms"] == []


def test_500_gradient_audits_of_a_clean_run_raise_no_alarm(gradient_run: dict[str, Any]) -> None:
    assert gradient_run["alarms"] == []
    assert gradient_run["nodes"] == {"0": "node-0", "1": "node-0", "2": "node-1", "3": "node-1"}


def test_report_has_exactly_the_design_shape(loss_run: tuple[dict[str, Any], Path]) -> None:
    report, work = loss_run
    assert json.loads((work / "report.json").read_text()) == report
    assert list(report) == [
        "world_size",
        "steps",
        "nodes",
        "alarms",
        "checkpoints",
        "final_fingerprint",
        "step_ms",
    ]
    assert (report["world_size"], report["steps"]) == (4, STEPS)
    assert report["nodes"] == {str(r): f"node-{r}" for r in range(4)}
    assert re.fullmatch(r"[0-9a-f]{32}", report["final_fingerprint"])
    assert set(report["step_ms"]) == {"median", "p90"}
    assert 0 < report["step_ms"]["median"] <= report["step_ms"]["p90"]
    for entry in report["checkpoints"]:
        assert list(entry) == ["step", "uri", "sha256", "fingerprint", "status"]
    assert [c["step"] for c in report["checkpoints"]] == [0, 25, 50, 75, 100]
    assert {c["status"] for c in report["checkpoints"]} == {"verified"}
    first = report["checkpoints"][0]
    assert first["uri"] == str((work / "ckpt" / "ckpt-000000.pt").resolve())
    assert re.fullmatch(r"[0-9a-f]{64}", first["sha256"])


def test_trace_has_one_line_per_step_with_every_rank(
    loss_run: tuple[dict[str, Any], Path],
) -> None:
    report, work = loss_run
    lines = [json.loads(x) for x in (work / "trace.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(STEPS))
    for line in lines:
        assert set(line) == {"step", "losses", "grad_fingerprints", "weight_fingerprint"}
        assert len(line["losses"]) == len(line["grad_fingerprints"]) == 4
    assert lines[-1]["weight_fingerprint"] == report["final_fingerprint"]
    ckpt = {c["step"]: c["fingerprint"] for c in report["checkpoints"]}
    assert lines[25]["weight_fingerprint"] == ckpt[25]


def test_same_seed_gives_the_same_final_fingerprint_whatever_the_guard_does(
    loss_run: tuple[dict[str, Any], Path],
    gradient_run: dict[str, Any],
) -> None:
    """Three runs of the same seed — loss audits, gradient audits on other nodes, and plain DDP
    with no sdcguard at all — end on bitwise the same weights: the guard has no side effect."""
    plain = run(TrainConfig(world_size=4, steps=STEPS, seed=11, plain=True))
    assert plain["alarms"] == []
    assert plain["checkpoints"] == []
    assert (
        loss_run[0]["final_fingerprint"]
        == gradient_run["final_fingerprint"]
        == plain["final_fingerprint"]
    )
    other_seed = run(TrainConfig(world_size=4, steps=3, seed=12, plain=True))
    shorter = run(TrainConfig(world_size=4, steps=3, seed=11, plain=True))
    assert other_seed["final_fingerprint"] != shorter["final_fingerprint"]


def test_resume_from_a_checkpoint_is_bitwise_the_straight_run(
    loss_run: tuple[dict[str, Any], Path],
) -> None:
    report, work = loss_run
    resumed = run(
        TrainConfig(
            world_size=4,
            steps=STEPS,
            audit_every=1,
            seed=11,
            resume_from=work / "ckpt" / "ckpt-000100.pt",
            trace=work / "resumed.jsonl",
        )
    )
    assert resumed["final_fingerprint"] == report["final_fingerprint"]
    assert resumed["alarms"] == []
    straight = (work / "trace.jsonl").read_text().splitlines()[101:]
    assert (work / "resumed.jsonl").read_text().splitlines() == straight
