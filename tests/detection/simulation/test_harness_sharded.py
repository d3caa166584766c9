"""``sdcguard train --parallel fsdp|hsdp``: the built-in model sharded with FSDP2 (or HSDP)
under the same guard call; clean runs are silent and report what DDP reports, the faults of
``--inject`` strike a sharded rank where the spec says and are caught as the sharded guard
can catch them, and what the sharded guard does not run is refused before any rank starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from detection.harness import TrainConfig, main, parse_config, run
from detection.simulation.parallel import mesh_shape
from detection.simulation.rank import guard_config_of


def _alarms(report: dict[str, Any]) -> list[tuple[int, str, str, list[int], list[str]]]:
    return [
        (a["step"], a["layer"], a["phase"], a["suspect_ranks"], a["suspect_nodes"])
        for a in report["alarms"]
    ]


def _job(**options: Any) -> dict[str, Any]:
    return run(TrainConfig(**{"world_size": 2, "steps": 5, "seed": 3, **options}))


def test_the_options_give_the_sharded_guard_its_audit_no_injection_and_their_mesh() -> None:
    """A sharded job audits as a DDP job does; the faults go to the harness's own hooks, not
    the sharded guard; the mesh follows the options."""
    fsdp = guard_config_of(parse_config(["--parallel", "fsdp", "--inject", "grad-flip@1:2"]))
    assert (fsdp.audit_every, fsdp.inject) == (10, ())
    ddp = guard_config_of(parse_config(["--inject", "grad-flip@1:2"]))
    assert (ddp.audit_every, ddp.inject) == (10, ("grad-flip@1:2",))
    # HSDP shards within a node unless told: 4 ranks, 2 a node -> 2 replicas of 2 shards
    assert mesh_shape(parse_config(["--parallel", "hsdp", "--ranks-per-node", "2"])) == (2, 2)
    assert mesh_shape(parse_config(["--parallel", "hsdp", "--shard-size", "4"])) == (1, 4)
    assert mesh_shape(parse_config(["--parallel", "fsdp"])) == (4,)


def test_clean_sharded_runs_raise_no_alarm_and_report_what_ddp_reports() -> None:
    """Two ranks: FSDP2's reduce-scatter adds the same two gradients DDP's all-reduce adds, so
    the sharded job trains bitwise the same model and reports the same fingerprint (rank 0's
    weights and buffers, summed over the shards). HSDP 2x2: four ranks, silent, same report."""
    ddp = _job(audit_every=0)
    fsdp = _job(parallel="fsdp")
    assert fsdp["alarms"] == ddp["alarms"] == []
    assert set(fsdp) == set(ddp)
    assert {k: fsdp[k] for k in ("world_size", "steps", "nodes", "checkpoints")} == {
        k: ddp[k] for k in ("world_size", "steps", "nodes", "checkpoints")
    }
    assert fsdp["final_fingerprint"] == ddp["final_fingerprint"]
    hsdp = _job(parallel="hsdp", world_size=4, ranks_per_node=2)
    assert hsdp["alarms"] == []
    assert set(hsdp) == set(ddp)
    assert hsdp["nodes"] == {"0": "node-0", "1": "node-0", "2": "node-1", "3": "node-1"}


def test_a_gradient_flip_under_fsdp_is_named_on_its_step() -> None:
    """Bit 30 of one element of rank 1's own unsharded gradient at step 2, before the
    reduce-scatter: its gradient's L∞ stands out against its own history, and the rank is
    named on that step. The same job without the flip is silent (the test above)."""
    report = _job(parallel="fsdp", inject=["grad-flip@1:2"])
    assert _alarms(report) == [(2, "gradstats", "pre-allreduce", [1], ["node-1"])]


def test_a_weight_flip_under_hsdp_with_two_replicas_is_detected_not_named() -> None:
    """Rank 1's copy of the shard flips after step 2's update (mesh 2x1: two replicas): the
    replica vote sees the two copies differ and cannot say which is wrong."""
    report = _job(parallel="hsdp", inject=["weight-flip@1:2"])
    assert _alarms(report) == [(2, "fingerprint", "weights", [], [])]
    assert report["alarms"][0]["detail"]["ambiguous"] is True


def test_an_activation_flip_under_fsdp_is_caught_by_the_audit_of_its_step() -> None:
    """Bit 30 of an activation in rank 1's forward at step 2, an audited step: its partner
    replays rank 1's micro-batch through the sharded model and gets another loss; the pair is
    named on that step. The same job without the flip is silent (the test above, which audits
    step 0 too)."""
    report = _job(parallel="fsdp", audit_every=1, inject=["act-flip@1:2"])
    assert [(a["step"], a["layer"], a["phase"]) for a in report["alarms"]] == [(2, "audit", "loss")]
    assert set(report["alarms"][0]["suspect_ranks"]) == {0, 1}


def test_checkpoints_are_sealed_directories_a_resume_continues_bitwise_on_any_mesh(
    tmp_path: Path,
) -> None:
    """Every rank writes its shards into ``ckpt-<step>/``, sealed by ``manifest.json``, the
    guard's state beside it; under FSDP2 no vote verifies one (pending). Resumed from step 2's
    — by its directory under FSDP2, by the manifest the report (and the ledger) names under
    HSDP 2x1 — the job ends on bitwise the uninterrupted run's fingerprint."""
    full = _job(parallel="fsdp", steps=6, checkpoint_dir=tmp_path, checkpoint_every=2)
    records = full["checkpoints"]
    assert [(c["step"], c["status"]) for c in records] == [(s, "pending") for s in (0, 2, 4)]
    second = tmp_path / "ckpt-000002"
    assert records[1]["uri"] == str((second / "manifest.json").resolve())
    assert (second / "manifest.json").is_file()
    assert (tmp_path / "ckpt-000002.sdcguard.pt").is_file()
    resumed = _job(parallel="fsdp", steps=6, resume_from=second)
    assert resumed["alarms"] == []
    assert resumed["final_fingerprint"] == full["final_fingerprint"]
    other_mesh = _job(parallel="hsdp", steps=6, resume_from=Path(records[1]["uri"]))
    assert other_mesh["final_fingerprint"] == full["final_fingerprint"]


def test_a_checkpoint_of_the_other_kind_is_refused_before_any_rank_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ddp_file = tmp_path / "ckpt-000002.pt"
    ddp_file.write_bytes(b"")
    manifest = tmp_path / "ckpt-000002" / "manifest.json"
    manifest.parent.mkdir()
    manifest.write_text("{}")
    assert main(["--parallel", "fsdp", "--resume-from", str(ddp_file)]) == 2
    assert "a sharded checkpoint is a directory" in capsys.readouterr().err
    assert main(["--resume-from", str(manifest)]) == 2
    assert "a sharded checkpoint's manifest" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--parallel", "fsdp", "--abft"], "no layer checksums"),
        (["--parallel", "hsdp", "--abft-every", "1"], "no layer checksums"),
        (["--parallel", "fsdp", "--defer-decision"], "--defer-decision"),
        (["--parallel", "fsdp", "--skip-update-on-alarm"], "--skip-update-on-alarm"),
        (["--parallel", "fsdp", "--trace", "t.jsonl"], "trace DDP jobs only"),
        (["--parallel", "fsdp", "--inject", "reduced-flip@0:1"], "reduced-flip is not injected"),
        (["--parallel", "fsdp", "--inject", "act-flip@0:2:in=recompute"], "no fault is injected"),
        (["--parallel", "fsdp", "--audit-mode", "gradient"], "loss mode only"),
        (["--parallel", "fsdp", "--shard-size", "1"], "--shard-size applies to --parallel hsdp"),
        (["--parallel", "hsdp", "--shard-size", "3"], "do not split into replicas of 3"),
        (["--parallel", "hsdp", "--nodes", "a,b,a,b"], "a node's ranks are not consecutive"),
    ],
)
def test_what_the_sharded_guard_does_not_run_is_refused_with_the_reason(
    flags: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--world-size", "4", "--steps", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert reason in err, err
