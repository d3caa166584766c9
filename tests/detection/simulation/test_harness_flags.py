"""``sdcguard train --abft/--no-abft``, ``--abft-every`` and ``--skip-update-on-alarm``: they
parse into the guard's configuration and take effect in a run.

An ``act-flip`` of the head's output at an unaudited step is seen by the layer checksums
(``abft``, on by default) when they check the head on that step: always with ``--abft-every 1``
(full coverage); under the default budget, on the head's turn in the rotation, so a flip that
recurs on every step is caught within ``abft_every`` steps and a one-off flip only on that turn.
With ``--skip-update-on-alarm`` every rank drops the caught step's update, so the run ends on
other weights; with ``--no-abft`` no checksum alarm is raised at all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from detection.guard import GuardConfig
from detection.harness import main, parse_config
from detection.simulation.model import ModelConfig, TinyTransformer
from detection.simulation.rank import guard_config_of
from detection.stepcheck.abft import LinearChecksums

FLIP = "act-flip@0:27:29"  # after the 25-step warm-up of the per-step layer


def test_the_flags_parse_into_the_guard_configuration() -> None:
    default = guard_config_of(parse_config([]))
    assert (default.abft, default.skip_update_on_alarm) == (None, False)  # None: on (eager)
    assert guard_config_of(parse_config(["--abft"])).abft is True
    assert guard_config_of(parse_config(["--no-abft"])).abft is False
    assert guard_config_of(parse_config(["--skip-update-on-alarm"])).skip_update_on_alarm
    assert default.abft_every == GuardConfig().abft_every > 1  # the budget: a rotation
    assert guard_config_of(parse_config(["--abft-every", "1"])).abft_every == 1


def test_abft_and_no_abft_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--abft", "--no-abft"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def _run(tmp_path: Path, name: str, *flags: str) -> dict[str, Any]:
    report = tmp_path / f"{name}.json"
    argv = ["--world-size", "1", "--steps", "29", "--audit-every", "0", "--inject", FLIP]
    assert main([*argv, "--report", str(report), *flags]) == 0
    body: dict[str, Any] = json.loads(report.read_text())
    return body


def test_the_checksums_catch_the_flip_and_skip_its_update_unless_turned_off(
    tmp_path: Path,
) -> None:
    skipped = _run(tmp_path, "skip", "--skip-update-on-alarm", "--abft-every", "1")
    assert [(a["step"], a["layer"], a["phase"], a["suspect_ranks"]) for a in skipped["alarms"]] == [
        (27, "abft", "forward", [0])
    ]

    # The checksums only read (the same seed ends on the same weights whatever the guard
    # checks), so other final weights come from the update the flag dropped.
    off = _run(tmp_path, "off", "--no-abft", "--abft-every", "1")
    assert all(a["layer"] != "abft" for a in off["alarms"]), off["alarms"]
    assert skipped["final_fingerprint"] != off["final_fingerprint"]


def test_under_the_default_budget_a_recurring_flip_is_caught_on_its_layers_turn(
    tmp_path: Path,
) -> None:
    """The same flip on every step from 27 for one period of the rotation (a defective part's
    fault recurs): the head is checked once in that period, on the step whose phase is its
    index's, and that step's checksum names it; no other step's checksum raises."""
    every = GuardConfig().abft_every
    names = LinearChecksums(TinyTransformer(ModelConfig()), [torch.zeros(1)]).names
    flips = [f"act-flip@0:{step}:29" for step in range(27, 27 + every)]
    report = tmp_path / "budget.json"
    argv = ["--world-size", "1", "--steps", str(28 + every), "--audit-every", "0"]
    for flip in flips:
        argv += ["--inject", flip]
    assert main([*argv, "--report", str(report)]) == 0
    alarms = [a for a in json.loads(report.read_text())["alarms"] if a["layer"] == "abft"]
    assert len(alarms) == 1, alarms
    (alarm,) = alarms
    head = names.index(alarm["detail"]["module"])
    assert 27 <= alarm["step"] < 27 + every
    assert alarm["step"] % every == head % every
    assert alarm["detail"]["module"] == names[-1]  # the last Linear: act-flip's target


def test_defer_decision_parses_and_a_deferred_job_reports_what_one_deciding_at_once_does(
    tmp_path: Path,
) -> None:
    """``--defer-decision``: the same alarm (its own step) and the same checkpoints, each
    verified only by a later clean step. At three ranks the deferred rows ride in the gradient
    all-reduce, whose longer buffer may sum in another order: the weights' last bits (so their
    fingerprints) may differ from the at-once job's, which ``test_carry`` bounds; at two ranks
    it pins them bit for bit."""
    assert not guard_config_of(parse_config([])).defer_decision
    assert guard_config_of(parse_config(["--defer-decision"])).defer_decision

    def job(name: str, *flags: str) -> dict[str, Any]:
        report = tmp_path / f"{name}.json"
        argv = ["--world-size", "3", "--steps", "9", "--audit-every", "0"]
        argv += ["--inject", "weight-flip@1:6"]
        argv += ["--checkpoint-dir", str(tmp_path / name), "--checkpoint-every", "2"]
        assert main([*argv, "--report", str(report), *flags]) == 0
        body: dict[str, Any] = json.loads(report.read_text())
        return body

    def named(report: dict[str, Any]) -> list[tuple[Any, ...]]:
        return [
            (a["step"], a["layer"], a["phase"], a["suspect_ranks"], a["suspect_nodes"])
            for a in report["alarms"]
        ]

    at_once, deferred = job("at-once"), job("deferred", "--defer-decision")
    assert [(a["step"], a["layer"]) for a in at_once["alarms"]] == [(6, "fingerprint")]
    assert named(deferred) == named(at_once)
    status = {c["step"]: c["status"] for c in at_once["checkpoints"]}
    assert {c["step"]: c["status"] for c in deferred["checkpoints"]} == status
    assert status[4] == "verified"
    assert status[6] == "quarantined"
    # each checkpoint records its own step's fingerprint: the one the job's trace has there
    for report in (at_once, deferred):
        recorded = {c["step"]: c["fingerprint"] for c in report["checkpoints"]}
        assert len(set(recorded.values())) == len(recorded)
