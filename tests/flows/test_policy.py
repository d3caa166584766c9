"""The storm guard and the auto-approval rule: pure functions of ledger facts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from flows.incident.policy import (
    AlarmEvidence,
    IncidentPolicy,
    NodeAction,
    StormCheck,
    auto_approval,
    storm_guard,
    within_limits,
)
from flows.settings import PolicySettings

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
JOB_NODES = [f"node-{i}" for i in range(8)]


def _storm(
    implicated: list[str],
    recent: list[tuple[str, datetime]] | None = None,
    policy: IncidentPolicy | None = None,
    job_nodes: list[str] = JOB_NODES,
) -> StormCheck:
    return storm_guard(
        implicated=implicated,
        job_nodes=job_nodes,
        recent=recent or [],
        now=NOW,
        policy=policy or IncidentPolicy(),
    )


def _alarm(layer: str, nodes: tuple[str, ...], phase: str = "", **detail: object) -> AlarmEvidence:
    return AlarmEvidence(layer=layer, suspect_nodes=nodes, at=NOW, detail=detail, phase=phase)


def test_policy_defaults_are_the_safe_ones() -> None:
    policy = IncidentPolicy()
    assert policy.action is NodeAction.REPLACE
    assert policy.auto_approve is False
    assert policy.storm_node_share == 0.25
    assert policy.uncordon_on_reject is False


@pytest.mark.parametrize(
    "field",
    [
        {"storm_node_share": 0.0},
        {"storm_node_share": 1.5},
        {"approval_timeout_s": 0},
        {"task_retries": -1},
        {"storm_max_nodes_per_hour": 0},
        {"surprise": 1},
    ],
)
def test_policy_refuses_out_of_bounds_values(field: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        IncidentPolicy.model_validate(field)


def test_retry_delays_back_off_exponentially() -> None:
    assert IncidentPolicy(task_retries=3, retry_delay_s=0.5).retry_delays() == [0.5, 1.0, 2.0]
    assert IncidentPolicy(task_retries=0).retry_delays() == []


def test_one_node_of_eight_is_no_storm() -> None:
    check = _storm(["node-2"])
    assert not check.tripped
    assert check.share == pytest.approx(1 / 8)


def test_exactly_the_share_is_not_more_than_the_share() -> None:
    assert not _storm(["node-1", "node-2"]).tripped  # 2/8 = 25 %, not more


def test_more_than_a_quarter_of_the_job_is_a_storm() -> None:
    check = _storm(["node-1", "node-2", "node-3"])
    assert check.tripped
    assert "3 of the job's 8 nodes" in check.reason
    assert "software" in check.reason


@pytest.mark.parametrize("size", [1, 2, 3])
def test_one_implicated_node_of_a_small_job_is_no_storm(size: int) -> None:
    check = _storm(["node-0"], job_nodes=JOB_NODES[:size])
    assert not check.tripped
    assert check.share == pytest.approx(1 / size)
    assert f"1 of {size} nodes implicated" in check.reason


def test_two_implicated_nodes_of_a_three_node_job_are_a_storm() -> None:
    check = _storm(["node-0", "node-1"], job_nodes=JOB_NODES[:3])
    assert check.tripped
    assert "2 of the job's 3 nodes" in check.reason


def test_a_higher_minimum_count_lets_the_share_rule_wait() -> None:
    policy = IncidentPolicy(storm_min_nodes=3)
    assert not _storm(["node-0", "node-1"], job_nodes=JOB_NODES[:3], policy=policy).tripped
    assert _storm(["node-0", "node-1", "node-2"], job_nodes=JOB_NODES[:4], policy=policy).tripped


def test_a_small_job_still_trips_the_hourly_count() -> None:
    recent = [(f"other-{i}", NOW - timedelta(minutes=5)) for i in range(4)]
    check = _storm(["node-0"], recent, job_nodes=JOB_NODES[:3])
    assert check.tripped
    assert "of the job's" not in check.reason
    assert "5 distinct nodes" in check.reason


def test_the_minimum_count_is_at_least_two() -> None:
    with pytest.raises(ValidationError):
        IncidentPolicy(storm_min_nodes=1)


def test_too_many_nodes_in_the_window_is_a_storm_across_jobs() -> None:
    recent = [(f"other-{i}", NOW - timedelta(minutes=10 * i)) for i in range(4)]
    check = _storm(["node-0"], recent)
    assert check.tripped
    assert "5 distinct nodes" in check.reason


def test_alarms_outside_the_window_do_not_count() -> None:
    recent = [(f"other-{i}", NOW - timedelta(hours=2)) for i in range(10)]
    assert not _storm(["node-0"], recent).tripped


def test_a_job_without_registered_ranks_is_judged_by_the_hourly_count() -> None:
    check = _storm(["node-0", "node-1"], job_nodes=[])
    assert not check.tripped
    assert check.share is None


def test_auto_approval_is_off_by_default() -> None:
    result = auto_approval(
        policy=IncidentPolicy(),
        verdict="hardware",
        verdict_node="node-2",
        alarms=[_alarm("audit", ("node-2",))],
        storm=_storm(["node-2"]),
    )
    assert not result.approved


def test_auto_approval_takes_a_hardware_verdict_backed_by_a_ring_audit() -> None:
    result = auto_approval(
        policy=IncidentPolicy(auto_approve=True),
        verdict="hardware",
        verdict_node="node-2",
        alarms=[_alarm("audit", ("node-2",))],
        storm=_storm(["node-2"]),
    )
    assert result.approved
    assert "ring audit" in result.reason


def test_auto_approval_takes_a_strict_majority_vote() -> None:
    result = auto_approval(
        policy=IncidentPolicy(auto_approve=True),
        verdict="hardware",
        verdict_node="node-2",
        alarms=[_alarm("fingerprint", ("node-2",), majority=True)],
        storm=_storm(["node-2"]),
    )
    assert result.approved
    assert "strict-majority" in result.reason


def test_auto_approval_takes_a_non_finite_local_gradient_named_before_all_reduce() -> None:
    result = auto_approval(
        policy=IncidentPolicy(auto_approve=True),
        verdict="hardware",
        verdict_node="node-2",
        alarms=[_alarm("nonfinite", ("node-2",), phase="pre-allreduce")],
        storm=_storm(["node-2"]),
    )
    assert result.approved
    assert "before all-reduce" in result.reason


@pytest.mark.parametrize(
    ("verdict", "alarms"),
    [
        ("software", [_alarm("audit", ("node-2",))]),
        ("inconclusive", [_alarm("audit", ("node-2",))]),
        # two replicas: the vote names both, never which one
        ("hardware", [_alarm("fingerprint", ("node-1", "node-2"))]),
        ("hardware", [_alarm("fingerprint", ("node-2",), majority=False)]),
        # after all-reduce every replica holds the same non-finite sum: it names nobody
        ("hardware", [_alarm("nonfinite", ("node-2",), phase="post-allreduce")]),
        # the evidence names another node than the replay
        ("hardware", [_alarm("audit", ("node-3",))]),
    ],
)
def test_auto_approval_refuses_weaker_evidence(verdict: str, alarms: list[AlarmEvidence]) -> None:
    result = auto_approval(
        policy=IncidentPolicy(auto_approve=True),
        verdict=verdict,
        verdict_node="node-2" if verdict == "hardware" else None,
        alarms=alarms,
        storm=_storm(["node-2"]),
    )
    assert not result.approved
    assert "refused" in result.reason


@pytest.mark.parametrize(
    ("layer", "phase"),
    [
        ("gradstats", "pre-allreduce"),
        ("gradstats", "loss"),
        ("allreduce", "post-allreduce"),
        ("optstate", "optimizer-state"),
        ("abft", "forward"),
        ("abft", "backward"),
    ],
)
def test_a_per_step_finding_alone_is_never_auto_approved(layer: str, phase: str) -> None:
    """Statistical and algebraic findings of the per-step layer name exactly one node, yet are
    weaker evidence than a vote or an audit: a human decides."""
    result = auto_approval(
        policy=IncidentPolicy(auto_approve=True),
        verdict="hardware",
        verdict_node="node-2",
        alarms=[_alarm(layer, ("node-2",), phase=phase, statistic=12.5, threshold=2.08)],
        storm=_storm(["node-2"]),
    )
    assert not result.approved
    assert "per-step layer" in result.reason
    assert layer in result.reason


def test_a_per_step_finding_with_a_ring_audit_is_approved_by_the_audit() -> None:
    result = auto_approval(
        policy=IncidentPolicy(auto_approve=True),
        verdict="hardware",
        verdict_node="node-2",
        alarms=[
            _alarm("gradstats", ("node-2",), phase="pre-allreduce"),
            _alarm("audit", ("node-2",)),
        ],
        storm=_storm(["node-2"]),
    )
    assert result.approved
    assert result.reason.endswith("ring audit")


@pytest.mark.parametrize(
    ("source", "others"),
    [
        ("megatron", []),
        ("torchtitan", []),
        ("health", []),
        ("megatron", [("gradstats", "pre-allreduce")]),
    ],
)
def test_another_detectors_alarm_is_never_auto_approved(
    source: str, others: list[tuple[str, str]]
) -> None:
    """An external alarm naming exactly the replay's node, alone or with the per-step layer,
    still waits for a human: sdcguard cannot check how the other detector named the node."""
    result = auto_approval(
        policy=IncidentPolicy(auto_approve=True),
        verdict="hardware",
        verdict_node="node-2",
        alarms=[
            _alarm("external", ("node-2",), phase=source, kind="exit-17"),
            *(_alarm(layer, ("node-2",), phase=phase) for layer, phase in others),
        ],
        storm=_storm(["node-2"]),
    )
    assert not result.approved
    assert f"another detector's alarm ({source})" in result.reason


def test_an_external_alarm_beside_sdcguards_own_audit_is_approved_by_the_audit() -> None:
    result = auto_approval(
        policy=IncidentPolicy(auto_approve=True),
        verdict="hardware",
        verdict_node="node-2",
        alarms=[_alarm("external", ("node-2",), phase="megatron"), _alarm("audit", ("node-2",))],
        storm=_storm(["node-2"]),
    )
    assert result.approved
    assert result.reason.endswith("ring audit")


def test_auto_approval_never_during_a_storm() -> None:
    storm = _storm(["node-1", "node-2", "node-3"])
    result = auto_approval(
        policy=IncidentPolicy(auto_approve=True),
        verdict="hardware",
        verdict_node="node-2",
        alarms=[_alarm("audit", ("node-2",))],
        storm=storm,
    )
    assert not result.approved
    assert "storm" in result.reason


def test_server_limits_default_to_no_auto_approval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SDCGUARD_POLICY_AUTO_APPROVE", raising=False)
    assert PolicySettings().auto_approve is False
    monkeypatch.setenv("SDCGUARD_POLICY_AUTO_APPROVE", "true")
    monkeypatch.setenv("SDCGUARD_POLICY_STORM_NODE_SHARE", "0.1")
    assert PolicySettings().auto_approve is True
    assert PolicySettings().storm_node_share == 0.1


def test_a_run_parameter_cannot_loosen_the_server_limits() -> None:
    asked = IncidentPolicy(
        auto_approve=True,
        storm_node_share=0.9,
        storm_min_nodes=50,
        storm_max_nodes_per_hour=100,
        storm_window_s=60,
    )
    effective, refused = within_limits(asked, PolicySettings(auto_approve=False))

    assert effective.auto_approve is False
    assert effective.storm_node_share == 0.25
    assert effective.storm_min_nodes == 2
    assert effective.storm_max_nodes_per_hour == 4
    assert effective.storm_window_s == 3600
    assert len(refused) == 5
    assert any(line.startswith("auto_approve=True") for line in refused)
    # and the bounded policy does not auto-approve even the strongest evidence
    verdict = auto_approval(
        policy=effective,
        verdict="hardware",
        verdict_node="node-2",
        alarms=[_alarm("audit", ("node-2",))],
        storm=_storm(["node-2"]),
    )
    assert not verdict.approved


def test_a_run_parameter_may_make_the_policy_stricter() -> None:
    asked = IncidentPolicy(
        auto_approve=False, storm_node_share=0.1, storm_max_nodes_per_hour=2, storm_window_s=7200
    )
    effective, refused = within_limits(asked, PolicySettings(auto_approve=True))

    assert effective == asked
    assert refused == []
    allowed, _ = within_limits(IncidentPolicy(auto_approve=True), PolicySettings(auto_approve=True))
    assert allowed.auto_approve is True
