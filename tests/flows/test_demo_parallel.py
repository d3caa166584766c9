"""``sdcguard demo --parallel``: the layout each job gets, and what a sharded demo refuses
before anything starts — every refusal names the option and why (no process, no server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.local.demo import DemoConfig, DemoError, _harness_args
from flows.local.demo_parallel import parallel_problems


def _config(**options: object) -> DemoConfig:
    return DemoConfig(**{"steps": 24, "fault_step": 12, **options})  # type: ignore[arg-type]


def test_hsdp_jobs_run_two_replicas_of_two_shards_and_write_no_trace(tmp_path: Path) -> None:
    config = _config(parallel="hsdp", fault="grad-nan", approve_in_ui=True)
    assert (
        parallel_problems(
            "hsdp", fault="grad-nan", world_size=4, transient=False, approve_in_ui=True
        )
        == []
    )
    args = _harness_args(config, "reference", tmp_path, None)
    assert args[args.index("--parallel") + 1 :][:3] == ["hsdp", "--shard-size", "2"]
    assert "--trace" not in args
    ddp = _harness_args(_config(), "reference", tmp_path, None)
    assert "--parallel" not in ddp
    assert ddp[ddp.index("--trace") + 1] == str(tmp_path / "reference.trace.jsonl")


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"parallel": "tp"}, "--parallel must be one of ddp, fsdp, hsdp"),
        ({"parallel": "fsdp"}, "--parallel fsdp: no checkpoint is ever verified"),
        ({"parallel": "hsdp", "world_size": 3}, "a vote needs 2 or more replicas"),
        ({"parallel": "hsdp", "fault": "weight-flip"}, "--fault weight-flip is not named"),
        ({"parallel": "hsdp", "fault": "reduced-flip"}, "--fault reduced-flip is not named"),
        ({"parallel": "hsdp", "approve_in_ui": False}, "needs --approve-in-ui"),
    ],
)
def test_what_a_sharded_demo_cannot_show_is_refused_with_the_reason(
    options: dict[str, object], reason: str
) -> None:
    config = _config(**{"fault": "grad-nan", "approve_in_ui": True, **options})
    problems = parallel_problems(
        config.parallel,
        fault=config.fault,
        world_size=config.world_size,
        transient=config.transient,
        approve_in_ui=config.approve_in_ui,
    )
    assert any(reason in p for p in problems), problems


def test_the_demo_refuses_a_sharded_layout_before_starting_anything() -> None:
    with pytest.raises(DemoError, match="needs --approve-in-ui"):
        _config(parallel="hsdp", fault="grad-nan").validate()
    _config(parallel="ddp", fault="weight-flip").validate()  # DDP: unchanged, no refusal
    # three replicas name a weight flip by their vote
    assert (
        parallel_problems(
            "hsdp", fault="weight-flip", world_size=6, transient=False, approve_in_ui=True
        )
        == []
    )
