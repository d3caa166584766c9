"""The diagnostic rerun and its verdict, with real ``sdcguard train`` processes.

One short training run writes the checkpoint and the reference trace; the reruns resume from
that checkpoint on simulated nodes. A persistent fault of a node's hardware follows that node
into its reruns, exactly as DESIGN's fault spec says.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recovery.diagnosis.rerun import JobSpec, RerunRequest, StepRecord, load_trace
from recovery.diagnosis.verdict import Verdict, diagnose, first_diverging_module, first_mismatch
from recovery.local.diagnosis import LocalRerunner

WORLD = 2
SEED = 11


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean 2-rank run of 8 steps with a checkpoint after step 3 and a trace."""
    root = tmp_path_factory.mktemp("trained")
    subprocess.run(
        [
            sys.executable, "-m", "detection.harness",
            "--world-size", str(WORLD), "--seed", str(SEED), "--steps", "8",
            "--audit-every", "0", "--checkpoint-every", "3",
            "--checkpoint-dir", str(root / "ckpt"), "--trace", str(root / "trace.jsonl"),
            "--report", str(root / "report.json"),
        ],
        check=True,
        capture_output=True,
        timeout=180,
    )  # fmt: skip
    return root


def _request(trained: Path, spec: JobSpec, node: str = "node-0") -> RerunRequest:
    return RerunRequest(
        job_id="job-r",
        checkpoint_uri=str(trained / "ckpt" / "ckpt-000003.pt"),
        checkpoint_step=3,
        end=7,
        node=node,
        spec=spec,
    )


def test_a_clean_replay_reproduces_the_training_trace_bitwise(
    trained: Path, tmp_path: Path
) -> None:
    runner = LocalRerunner(tmp_path)
    result = runner.rerun(_request(trained, JobSpec(world_size=WORLD, seed=SEED)))
    reference = load_trace(trained / "trace.jsonl")
    assert [r.step for r in result.steps] == [4, 5, 6, 7]
    assert first_mismatch(result.steps, reference) is None


@pytest.mark.slow
def test_a_persistent_node_fault_gives_hardware_naming_the_node_and_the_submodule(
    trained: Path, tmp_path: Path
) -> None:
    spec = JobSpec(
        world_size=WORLD,
        seed=SEED,
        inject=("act-flip@node=node-7:from=5/blocks.0.mlp.fc", "grad-flip@0:4"),
    )
    verdict = diagnose(
        LocalRerunner(tmp_path),
        _request(trained, spec),
        suspect_nodes=["node-7"],
        spare_nodes=["node-8", "node-9"],
        reference=load_trace(trained / "trace.jsonl"),
        alarm_step=5,
    )
    assert verdict.verdict is Verdict.HARDWARE
    assert verdict.node == "node-7"
    assert verdict.first_step == 5
    assert verdict.submodule == "blocks.0.mlp.fc"
    assert verdict.op_kind == "Linear"


@pytest.mark.slow
def test_no_mismatch_anywhere_is_inconclusive(trained: Path, tmp_path: Path) -> None:
    spec = JobSpec(world_size=WORLD, seed=SEED)
    verdict = diagnose(
        LocalRerunner(tmp_path),
        _request(trained, spec),
        suspect_nodes=["node-1"],
        spare_nodes=["node-8"],
        reference=load_trace(trained / "trace.jsonl"),
        alarm_step=5,
    )
    assert verdict.verdict is Verdict.INCONCLUSIVE
    assert verdict.node is None
    assert "not cleared" in verdict.reason


@pytest.mark.slow
def test_a_forced_nondeterminism_is_software(trained: Path, tmp_path: Path) -> None:
    """Reruns with another intra-op thread count than training: every node agrees with every
    other, and all differ from the training record from the first rerun step on."""
    spec = JobSpec(world_size=WORLD, seed=SEED, threads=2)
    verdict = diagnose(
        LocalRerunner(tmp_path),
        _request(trained, spec),
        suspect_nodes=["node-1"],
        spare_nodes=["node-8"],
        reference=load_trace(trained / "trace.jsonl"),
        alarm_step=6,
    )
    assert verdict.verdict is Verdict.SOFTWARE
    assert verdict.first_step == 4
    assert verdict.node is None


def _record(step: int, loss: float, fp: str = "00" * 16) -> StepRecord:
    return StepRecord(step, (loss, loss), ("aa" * 16, "bb" * 16), fp)


def test_first_mismatch_is_bitwise_and_only_on_common_steps() -> None:
    a = [_record(1, 1.0), _record(2, 2.0), _record(3, 3.0)]
    b = [_record(2, 2.0), _record(3, 3.0000001), _record(4, 9.0)]
    assert first_mismatch(a, b) == 3
    assert first_mismatch(a[:2], b) is None


def test_first_diverging_module_prefers_forward_in_execution_order() -> None:
    probe_a = {
        "order": ["embed", "blocks.0", "head"],
        "kinds": {"embed": "Embedding", "blocks.0": "Block", "head": "Linear"},
        "ranks": {"0": {"forward": {"embed": "1", "blocks.0": "2", "head": "3"},
                        "backward": {"head": "x", "blocks.0": "y"}}},
    }  # fmt: skip
    probe_b = json.loads(json.dumps(probe_a))
    probe_b["ranks"]["0"]["forward"]["head"] = "changed"
    probe_b["ranks"]["0"]["backward"]["blocks.0"] = "changed"
    assert first_diverging_module(probe_a, probe_b) == ("head", "forward", "Linear")
    assert first_diverging_module(probe_a, probe_a) is None
