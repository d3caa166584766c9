"""The schedule of a diagnosis's reruns: different nodes at once, one node's one after the other,
and a verdict and a failure that read as if they ran one by one.

The runner here is an in-process stand-in for the cluster (what ``LocalRerunner`` and
``KubeRerunner`` do is tested in ``test_diagnosis_local.py`` and ``test_diagnosis_kube.py``): it
records which reruns overlapped, and computes "node-2" differently from step 5 on.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest

from recovery.diagnosis.batch import nodes_are_machines, rerun_all
from recovery.diagnosis.rerun import JobSpec, RerunRequest, RerunResult, StepRecord
from recovery.diagnosis.verdict import Verdict, VerdictResult, diagnose
from recovery.errors import PermanentError

FAULTY = "node-2"


def _steps(request: RerunRequest) -> tuple[StepRecord, ...]:
    def weights(step: int) -> str:
        bad = request.node == FAULTY and step >= 5
        return f"{step:016x}{1 if bad else 0:016x}"

    return tuple(
        StepRecord(step, (1.0 / step,), ("00" * 16,), weights(step))
        for step in range(request.start, request.end + 1)
    )


class OverlapRecorder:
    """A runner that takes ``hold_s`` a rerun and records, per node and overall, how many of
    its reruns ran at the same moment; ``fail`` names nodes whose reruns raise. With
    ``together=n`` every rerun of the first round (no probe) waits until ``n`` of them have
    started: reruns run one by one break that barrier (``BrokenBarrierError``) instead of
    passing."""

    parallel = True  # its nodes are separate machines, as KubeRerunner's are

    def __init__(
        self, hold_s: float = 0.2, fail: dict[str, str] | None = None, together: int = 0
    ) -> None:
        self.hold_s = hold_s
        self.fail = fail or {}
        self.barrier = threading.Barrier(together, timeout=30) if together else None
        self.lock = threading.Lock()
        self.running: dict[str, int] = defaultdict(int)
        self.most_per_node = 0
        self.most_at_once = 0
        self.calls: list[tuple[str, int | None]] = []

    def rerun(self, request: RerunRequest) -> RerunResult:
        with self.lock:
            self.calls.append((request.node, request.probe_step))
            self.running[request.node] += 1
            self.most_per_node = max(self.most_per_node, self.running[request.node])
            self.most_at_once = max(self.most_at_once, sum(self.running.values()))
        try:
            if self.barrier is not None and request.probe_step is None:
                self.barrier.wait()
            time.sleep(self.hold_s)
            if request.node in self.fail:
                raise PermanentError("replay", "run", request.node, self.fail[request.node])
            probe = {"step": request.probe_step} if request.probe_step is not None else None
            return RerunResult(request.node, _steps(request), probe)
        finally:
            with self.lock:
                self.running[request.node] -= 1


def _base() -> RerunRequest:
    return RerunRequest(
        job_id="job-b",
        checkpoint_uri="file:///ckpt-000002.pt",
        checkpoint_step=2,
        end=8,
        node="node-4",
        spec=JobSpec(world_size=2, seed=1),
    )


def _names_the_faulty_node_at_step_5(verdict: VerdictResult) -> None:
    """The verdict every schedule must reach on ``_base()``: the fault of ``FAULTY`` from
    step 5."""
    assert verdict.verdict is Verdict.HARDWARE
    assert verdict.node == FAULTY
    assert verdict.first_step == 5


def test_the_spares_and_the_suspects_replay_at_once_and_the_verdict_is_unchanged() -> None:
    runner = OverlapRecorder(together=4)
    verdict = diagnose(runner, _base(), ["node-1", FAULTY], ["node-4", "node-5"])

    _names_the_faulty_node_at_step_5(verdict)
    # two spares and two suspects, then the two probes of step 5: six reruns in two rounds
    first_round = [("node-4", None), ("node-5", None), ("node-1", None), (FAULTY, None)]
    assert sorted(runner.calls, key=repr) == sorted(
        [*first_round, (FAULTY, 5), ("node-4", 5)], key=repr
    )
    assert runner.most_at_once == 4
    assert runner.most_per_node == 1
    assert set(verdict.detail["replays"]) == {"node-4", "node-1", FAULTY}


def test_one_spare_replays_twice_one_after_the_other() -> None:
    runner = OverlapRecorder()
    verdict = diagnose(runner, _base(), [FAULTY], ["node-4"])

    assert verdict.verdict is Verdict.HARDWARE
    assert verdict.node == FAULTY
    assert runner.calls.count(("node-4", None)) == 2
    assert runner.most_per_node == 1  # never two reruns on the spare at once


def test_a_clean_suspect_is_inconclusive_after_one_round_of_three_replays_at_once() -> None:
    runner = OverlapRecorder(together=3)
    verdict = diagnose(runner, _base(), ["node-1"], ["node-4", "node-5"])

    assert verdict.verdict is Verdict.INCONCLUSIVE
    assert verdict.node is None
    assert len(runner.calls) == 3


def test_the_first_failure_in_request_order_is_raised_after_every_replay_ended() -> None:
    runner = OverlapRecorder(fail={"node-5": "spare b broke", FAULTY: "suspect broke"}, together=3)
    with pytest.raises(PermanentError, match="spare b broke"):
        diagnose(runner, _base(), [FAULTY], ["node-4", "node-5"])
    assert sorted(runner.calls) == sorted([("node-4", None), ("node-5", None), (FAULTY, None)])
    assert sum(runner.running.values()) == 0  # none left running


def test_replay_all_returns_results_in_request_order() -> None:
    base = _base()
    nodes = ["node-5", "node-4", "node-5", FAULTY]
    runner = OverlapRecorder(hold_s=0.05)
    results = rerun_all(runner, [replace(base, node=n) for n in nodes])
    assert [r.node for r in results] == nodes
    assert runner.most_per_node == 1


class SharedHost(OverlapRecorder):
    """The same runner on one host's cores (no ``parallel``), as ``LocalRerunner`` is."""

    parallel = False


def test_a_runner_on_one_host_replays_one_at_a_time_with_the_same_verdict() -> None:
    runner = SharedHost(hold_s=0.05)
    verdict = diagnose(runner, _base(), ["node-1", FAULTY], ["node-4", "node-5"])

    _names_the_faulty_node_at_step_5(verdict)
    assert runner.most_at_once == 1
    # in request order: the spares, the suspects, then the probes
    assert runner.calls == [
        ("node-4", None),
        ("node-5", None),
        ("node-1", None),
        (FAULTY, None),
        (FAULTY, 5),
        ("node-4", 5),
    ]


def test_the_local_runner_keeps_one_host_sequential_and_the_kube_runner_does_not(
    tmp_path: Path,
) -> None:
    from kubernetes import client as k8s

    from recovery.kube.diagnosis import KubeRerunner
    from recovery.local.diagnosis import LocalRerunner

    assert not nodes_are_machines(LocalRerunner(tmp_path))
    assert nodes_are_machines(KubeRerunner(k8s.ApiClient()))


def test_only_a_runner_that_says_parallel_is_true_runs_side_by_side() -> None:
    """An attribute that merely reads as true (a method, a string) is no such statement."""

    class Vague(SharedHost):
        parallel = "yes"  # type: ignore[assignment]

    assert nodes_are_machines(OverlapRecorder(hold_s=0.0))
    assert not nodes_are_machines(SharedHost(hold_s=0.0))
    assert not nodes_are_machines(Vague(hold_s=0.0))


def test_on_one_host_no_suspect_replays_when_the_spares_disagree() -> None:
    runner = SharedHost(hold_s=0.0)
    verdict = diagnose(runner, _base(), ["node-1"], ["node-4", FAULTY])

    assert verdict.verdict is Verdict.SOFTWARE
    assert runner.calls == [("node-4", None), (FAULTY, None)]  # the spares only


def test_on_one_host_replays_run_in_request_order_and_stop_at_the_first_failure() -> None:
    runner = SharedHost(hold_s=0.0, fail={"node-4": "spare a broke"})
    requests = [replace(_base(), node=n) for n in ("node-5", "node-4", "node-5", FAULTY)]
    with pytest.raises(PermanentError, match="spare a broke"):
        rerun_all(runner, requests)
    assert runner.calls == [("node-5", None), ("node-4", None)]
