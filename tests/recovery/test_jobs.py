"""Training-job control: PyTorchJob and batch Job through the official client against the fake
API, and local process groups for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from recovery.errors import ConflictError, NotFoundError, PermanentError
from recovery.jobs import (
    ANNOTATION_RESUME_FROM,
    ANNOTATION_RESUME_NODES,
    ANNOTATION_RESUME_STEP,
    RESUME_ENV,
    RESUME_ENV_FROM_ANNOTATION,
    JobKind,
    JobRef,
    JobStatus,
    ResumeOutcome,
    StopOutcome,
)
from recovery.kube.jobs import BatchJobControl, PyTorchJobControl
from recovery.local import LocalJobControl
from recovery.local.train_args import resume_args
from tests.recovery.fake_kube import FakeKube

CKPT = "s3://ckpt-bucket/run-1/ckpt-000030.pt"
CKPT_OLD = "s3://ckpt-bucket/run-1/ckpt-000020.pt"
PTJ_PATH = r"^/apis/kubeflow\.org/v1/namespaces/ml/pytorchjobs/llm$"
JOB_PATH = r"^/apis/batch/v1/namespaces/ml/jobs/train$"
HOSTNAME = "kubernetes.io/hostname"


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in container.get("env", [])}


def _host_pin(pod_spec: dict[str, Any]) -> list[list[str]]:
    """The hostname values each required node-selector term allows."""
    required = (
        pod_spec.get("affinity", {})
        .get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution")
    )
    if not required:
        return []
    return [
        e["values"]
        for term in required["nodeSelectorTerms"]
        for e in term.get("matchExpressions", [])
        if e["key"] == HOSTNAME
    ]


# -- PyTorchJob ----------------------------------------------------------------------------


@pytest.fixture
def ptj(fake_kube: FakeKube, kube_client: k8s.ApiClient) -> PyTorchJobControl:
    fake_kube.add_pytorchjob(
        "llm",
        namespace="ml",
        replicas={"Master": 1, "Worker": 3},
        containers=[
            {
                "name": "pytorch",
                "image": "train:1",
                "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
            },
            {"name": "sidecar", "image": "logs:1"},
        ],
    )
    return PyTorchJobControl(kube_client, conflict_backoff_s=0.0)


JOB = JobRef("llm", namespace="ml", kind=JobKind.PYTORCHJOB)


def test_pytorchjob_stop_suspends_once(fake_kube: FakeKube, ptj: PyTorchJobControl) -> None:
    assert ptj.status(JOB) is JobStatus.RUNNING

    assert ptj.stop(JOB).outcome is StopOutcome.STOPPED
    assert fake_kube.pytorchjob("llm", "ml")["spec"]["runPolicy"]["suspend"] is True
    assert ptj.status(JOB) is JobStatus.SUSPENDED

    assert ptj.stop(JOB).outcome is StopOutcome.ALREADY_STOPPED
    patches = fake_kube.requests_to("PATCH", PTJ_PATH)
    assert len(patches) == 1
    assert patches[0].content_type == "application/merge-patch+json"  # CRDs: no strategic merge
    assert patches[0].body["metadata"]["resourceVersion"]


def test_pytorchjob_resume_sets_checkpoint_on_every_replica(
    fake_kube: FakeKube, ptj: PyTorchJobControl
) -> None:
    ptj.stop(JOB)

    result = ptj.resume(JOB, CKPT, 30, ["node-0", "node-1", "node-1", "node-6"])

    assert result.outcome is ResumeOutcome.RESUMED
    assert result.nodes == ("node-0", "node-1", "node-6")
    obj = fake_kube.pytorchjob("llm", "ml")
    assert obj["spec"]["runPolicy"]["suspend"] is False
    assert obj["metadata"]["annotations"][ANNOTATION_RESUME_FROM] == CKPT
    assert obj["metadata"]["annotations"][ANNOTATION_RESUME_STEP] == "30"
    assert obj["metadata"]["annotations"][ANNOTATION_RESUME_NODES] == "node-0,node-1,node-6"
    for replica in obj["spec"]["pytorchReplicaSpecs"].values():
        pod_spec = replica["template"]["spec"]
        assert [c["name"] for c in pod_spec["containers"]] == ["pytorch", "sidecar"]
        for container in pod_spec["containers"]:
            assert _env(container)[RESUME_ENV] == {"name": RESUME_ENV, "value": CKPT}
        assert _env(pod_spec["containers"][0])["NCCL_DEBUG"]["value"] == "WARN"  # kept
        assert _host_pin(pod_spec) == [["node-0", "node-1", "node-6"]]
    assert ptj.status(JOB) is JobStatus.RUNNING


def test_pytorchjob_resume_is_idempotent_and_refuses_other_checkpoints(
    fake_kube: FakeKube, ptj: PyTorchJobControl
) -> None:
    ptj.stop(JOB)
    ptj.resume(JOB, CKPT, 30, None)
    fake_kube.clear_requests()

    again = ptj.resume(JOB, CKPT, 30, None)
    assert again.outcome is ResumeOutcome.ALREADY_RESUMED
    assert fake_kube.requests_to("PATCH", PTJ_PATH) == []

    with pytest.raises(PermanentError, match="stop it first") as caught:
        ptj.resume(JOB, CKPT_OLD, 20, None)
    assert (caught.value.verb, caught.value.target) == ("resume", "pytorchjob/ml/llm")


def test_pytorchjob_resume_without_nodes_removes_our_pin(
    fake_kube: FakeKube, ptj: PyTorchJobControl
) -> None:
    ptj.stop(JOB)
    ptj.resume(JOB, CKPT_OLD, 20, ["node-0", "node-2"])
    ptj.stop(JOB)

    ptj.resume(JOB, CKPT, 30, None)

    obj = fake_kube.pytorchjob("llm", "ml")
    assert ANNOTATION_RESUME_NODES not in obj["metadata"]["annotations"]
    for replica in obj["spec"]["pytorchReplicaSpecs"].values():
        assert _host_pin(replica["template"]["spec"]) == []
        assert _env(replica["template"]["spec"]["containers"][0])[RESUME_ENV]["value"] == CKPT


def test_pytorchjob_finished_job_is_not_stopped(
    fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    fake_kube.add_pytorchjob(
        "done",
        namespace="ml",
        conditions=[{"type": "Succeeded", "status": "True", "reason": "PyTorchJobSucceeded"}],
    )
    control = PyTorchJobControl(kube_client)
    job = JobRef("done", namespace="ml")

    assert control.status(job) is JobStatus.SUCCEEDED
    assert control.stop(job).outcome is StopOutcome.NOT_RUNNING
    assert fake_kube.requests_to("PATCH", "pytorchjobs/done") == []


def test_pytorchjob_errors_are_typed(fake_kube: FakeKube, ptj: PyTorchJobControl) -> None:
    with pytest.raises(NotFoundError) as caught:
        ptj.stop(JobRef("nope", namespace="ml"))
    assert (caught.value.verb, caught.value.target) == ("stop", "pytorchjob/ml/nope")

    fake_kube.fail_next("PATCH", PTJ_PATH, 409, times=2)
    assert ptj.stop(JOB).outcome is StopOutcome.STOPPED
    assert len(fake_kube.requests_to("PATCH", PTJ_PATH)) == 3

    fake_kube.fail_next("PATCH", PTJ_PATH, 409, times=None)
    with pytest.raises(ConflictError):
        ptj.resume(JOB, CKPT, 30, None)

    with pytest.raises(ValueError, match="controls PyTorchJob"):
        ptj.stop(JobRef("train", namespace="ml", kind=JobKind.BATCH_JOB))


# -- batch/v1 Job --------------------------------------------------------------------------


@pytest.fixture
def batch(fake_kube: FakeKube, kube_client: k8s.ApiClient) -> BatchJobControl:
    fake_kube.add_job(
        "train",
        namespace="ml",
        parallelism=4,
        containers=[
            {
                "name": "trainer",
                "image": "train:1",
                "env": [{"name": "WORLD_SIZE", "value": "4"}, dict(RESUME_ENV_FROM_ANNOTATION)],
            }
        ],
    )
    return BatchJobControl(kube_client, conflict_backoff_s=0.0)


BJOB = JobRef("train", namespace="ml")


def test_batch_job_stop_and_resume_through_the_annotation(
    fake_kube: FakeKube, batch: BatchJobControl
) -> None:
    assert batch.status(BJOB) is JobStatus.RUNNING
    assert batch.stop(BJOB).outcome is StopOutcome.STOPPED
    assert batch.status(BJOB) is JobStatus.SUSPENDED
    assert fake_kube.job("train", "ml")["status"]["startTime"]  # the controller keeps it
    assert batch.stop(BJOB).outcome is StopOutcome.ALREADY_STOPPED

    result = batch.resume(BJOB, CKPT, 30, ["node-0", "node-6"])

    assert result.outcome is ResumeOutcome.RESUMED
    status_patch, job_patch = fake_kube.requests_to("PATCH", JOB_PATH.rstrip("$") + "(/status)?$")[
        -2:
    ]
    assert status_patch.path.endswith("/status")
    assert status_patch.body == {"status": {"startTime": None}}
    assert job_patch.content_type == "application/merge-patch+json"
    job = fake_kube.job("train", "ml")
    template = job["spec"]["template"]
    assert job["spec"]["suspend"] is False
    assert template["metadata"]["annotations"][ANNOTATION_RESUME_FROM] == CKPT
    assert template["metadata"]["annotations"][ANNOTATION_RESUME_STEP] == "30"
    assert job["metadata"]["annotations"][ANNOTATION_RESUME_FROM] == CKPT
    # The container's env is untouched (immutable) and resolves the checkpoint from the
    # annotation through the downward API.
    env = _env(template["spec"]["containers"][0])
    assert env[RESUME_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == (
        f"metadata.annotations['{ANNOTATION_RESUME_FROM}']"
    )
    assert env["WORLD_SIZE"]["value"] == "4"
    assert _host_pin(template["spec"]) == [["node-0", "node-6"]]
    assert batch.status(BJOB) is JobStatus.RUNNING
    assert batch.resume(BJOB, CKPT, 30, ["node-0", "node-6"]).outcome is (
        ResumeOutcome.ALREADY_RESUMED
    )


def test_batch_job_template_really_is_immutable_while_started(
    fake_kube: FakeKube, batch: BatchJobControl, kube_client: k8s.ApiClient
) -> None:
    """Why the checkpoint does not go into a Job's env: the API server (and this fake) refuse
    such a change, and refuse even annotation changes until startTime is cleared."""
    batch.stop(BJOB)
    api = k8s.BatchV1Api(kube_client)
    env_change = {
        "spec": {
            "template": {
                "spec": {"containers": [{"name": "trainer", "image": "train:1", "env": []}]}
            }
        }
    }
    annotation_change = {
        "spec": {"template": {"metadata": {"annotations": {ANNOTATION_RESUME_FROM: CKPT}}}}
    }
    for body in (env_change, annotation_change):
        with pytest.raises(ApiException) as caught:
            api.patch_namespaced_job(
                "train", "ml", body, _content_type="application/merge-patch+json"
            )
        assert caught.value.status == 422


def test_batch_job_without_the_downward_env_is_refused_untouched(
    fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    fake_kube.add_job("plain", namespace="ml", suspend=True, started=True)
    control = BatchJobControl(kube_client)
    fake_kube.clear_requests()

    with pytest.raises(PermanentError, match=RESUME_ENV) as caught:
        control.resume(JobRef("plain", namespace="ml"), CKPT, 30, None)

    assert caught.value.target == "job/ml/plain"
    assert [r.method for r in fake_kube.requests] == ["GET"]


def test_batch_job_never_started_needs_no_status_patch(
    fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    fake_kube.add_job(
        "queued",
        namespace="ml",
        suspend=True,
        started=False,
        containers=[
            {"name": "trainer", "image": "train:1", "env": [dict(RESUME_ENV_FROM_ANNOTATION)]}
        ],
    )
    control = BatchJobControl(kube_client)

    assert control.resume(JobRef("queued", namespace="ml"), CKPT, 30, None).outcome is (
        ResumeOutcome.RESUMED
    )
    assert fake_kube.requests_to("PATCH", "/status$") == []
    assert fake_kube.job("queued", "ml")["spec"]["template"]["metadata"]["annotations"] == {
        ANNOTATION_RESUME_FROM: CKPT,
        ANNOTATION_RESUME_STEP: "30",
    }


def test_batch_job_running_is_not_resumed_from_elsewhere(batch: BatchJobControl) -> None:
    with pytest.raises(PermanentError, match="not suspended"):
        batch.resume(BJOB, CKPT, 30, None)


# -- local process groups ------------------------------------------------------------------

# A stand-in for `python -m detection.harness`: records its arguments and process group, starts
# a grandchild in the same group, then waits for a signal. `--exit N` exits at once with N;
# `--stubborn` ignores SIGTERM (and so needs SIGKILL).
_TRAINER = """
import json, os, signal, subprocess, sys, time
args = sys.argv[1:]
if "--exit" in args:
    sys.exit(int(args[args.index("--exit") + 1]))
if "--stubborn" in args:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen(["sleep", "600"])
record = {"pid": os.getpid(), "pgid": os.getpgid(0), "grandchild": grandchild.pid, "args": args}
out = os.path.join(os.environ["TRAINER_OUT"], f"{os.getppid()}.json")
with open(out + ".tmp", "w") as handle:
    json.dump(record, handle)
os.replace(out + ".tmp", out)
while True:
    signal.pause()
"""

ARGS = [
    "--world-size",
    "2",
    "--steps",
    "50",
    "--resume-from",
    "/old/ckpt.pt",
    "--nodes=node-0,node-1",
]
LJOB = JobRef("local-7", kind=JobKind.LOCAL)


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def _live(pid: int) -> bool:
    """A process that exists and is not a zombie (an unreaped zombie has already ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except FileNotFoundError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                members.append(int(entry.name))
    return members


class LocalRig:
    def __init__(self, tmp_path: Path, **kwargs: Any) -> None:
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.log = tmp_path / "logs" / "train.log"
        self.state_dir = tmp_path / "jobs"
        self.control = LocalJobControl(
            self.state_dir,
            command=[sys.executable, "-c", _TRAINER],
            env={"TRAINER_OUT": str(self.out)},
            **kwargs,
        )

    def kill_leftovers(self) -> None:
        """After a failed test: SIGKILL the process groups this rig launched, by their ids."""
        for state in self.state_dir.glob("*.json"):
            for launch in json.loads(state.read_text())["launches"]:
                if _group_members(launch["pgid"]):
                    os.killpg(launch["pgid"], signal.SIGKILL)

    def started(self, pid: int) -> dict[str, Any]:
        path = self.out / f"{pid}.json"
        _wait_for(path.exists)
        record: dict[str, Any] = json.loads(path.read_text())
        return record


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[LocalRig]:
    rig = LocalRig(tmp_path, stop_timeout_s=10.0)
    yield rig
    rig.kill_leftovers()


def test_resume_args_replace_resume_and_nodes() -> None:
    assert resume_args(ARGS, "/ckpt/ckpt-000030.pt", ["node-0", "node-6"]) == [
        "--world-size",
        "2",
        "--steps",
        "50",
        "--resume-from",
        "/ckpt/ckpt-000030.pt",
        "--nodes",
        "node-0,node-6",
    ]
    assert resume_args(["--steps", "5", "--resume-from=/x"], "/y", None) == [
        "--steps",
        "5",
        "--resume-from",
        "/y",
    ]


def test_resume_args_keep_the_original_run_outputs() -> None:
    args = ["--report", "/runs/report.json", "--trace=/runs/trace.jsonl", "--steps", "9"]
    assert resume_args(args, "/c.pt", None, output_tag="resumed-4") == [
        "--report",
        "/runs/report.resumed-4.json",
        "--trace=/runs/trace.resumed-4.jsonl",
        "--steps",
        "9",
        "--resume-from",
        "/c.pt",
    ]


class _Terminated(BaseException):
    """What a command's SIGTERM handler raises (``sdcguard demo`` has one)."""


def _raise_terminated(_signum: int, _frame: object) -> None:
    raise _Terminated


def test_sigterm_between_the_fork_and_the_record_still_leaves_a_job_stop_can_find(
    rig: LocalRig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM that lands while the job is being started (here: the moment the process
    exists, before its record is written) reaches the caller only after the launch is
    recorded, so the caller's cleanup stops it. Before, the launch unwound with the group
    running and unrecorded: ``stop()`` said "never launched" and the training lived on."""
    real_popen = subprocess.Popen

    class PopenThenSigterm(real_popen):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            signal.raise_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        monkeypatch.setattr(subprocess, "Popen", PopenThenSigterm)
        with pytest.raises(_Terminated):
            rig.control.launch("local-7", ARGS, rig.log)
        monkeypatch.setattr(subprocess, "Popen", real_popen)
        assert signal.getsignal(signal.SIGTERM) is _raise_terminated  # the caller's, back
    finally:
        signal.signal(signal.SIGTERM, previous)
    pid = rig.control.pid(LJOB)
    rig.started(pid)
    assert _group_members(pid)

    assert rig.control.stop(LJOB).outcome is StopOutcome.STOPPED
    assert _group_members(pid) == []


def test_a_launch_whose_record_cannot_be_written_leaves_no_run_behind(
    rig: LocalRig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started means recorded: a record that cannot reach the disk (here: ``fsync`` failing as
    on a full disk) kills the run it would have named, and the launch fails with the error."""

    def full_disk(_fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        rig.control.launch("local-7", ARGS, rig.log)
    monkeypatch.undo()

    exit_path = str(rig.state_dir / "local-7.1.exit")
    _wait_for(lambda: not _processes_mentioning(exit_path), timeout_s=10)
    with pytest.raises(NotFoundError):
        rig.control.stop(LJOB)  # nothing was recorded, and nothing runs


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line holds ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _live(int(entry.name)):
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return found


def test_local_launch_stop_resume(rig: LocalRig) -> None:
    control = rig.control
    pid = control.launch("local-7", ARGS, rig.log)
    first = rig.started(pid)
    assert first["pgid"] == pid  # its own process group, led by the launch
    assert first["args"] == ARGS
    assert control.status(LJOB) is JobStatus.RUNNING
    assert control.launch("local-7", ARGS, rig.log) == pid  # idempotent
    assert set(_group_members(pid)) == {pid, first["pid"], first["grandchild"]}

    stopped = control.stop(LJOB)

    assert stopped.outcome is StopOutcome.STOPPED
    assert "SIGTERM" in stopped.detail
    assert _group_members(pid) == []  # the whole group, grandchild included, is gone
    assert not any(_live(p) for p in (pid, first["pid"], first["grandchild"]))
    assert control.status(LJOB) is JobStatus.SUSPENDED
    assert control.stop(LJOB).outcome is StopOutcome.ALREADY_STOPPED

    resumed = control.resume(LJOB, "/ckpt/ckpt-000030.pt", 30, ["node-0", "node-6"])

    assert resumed.outcome is ResumeOutcome.RESUMED
    assert resumed.pid is not None
    assert resumed.pid != pid
    second = rig.started(resumed.pid)
    assert second["args"] == resume_args(
        ARGS, "/ckpt/ckpt-000030.pt", ["node-0", "node-6"], output_tag="resumed-30"
    )
    assert control.status(LJOB) is JobStatus.RUNNING

    again = control.resume(LJOB, "/ckpt/ckpt-000030.pt", 30, ["node-0", "node-6"])
    assert again.outcome is ResumeOutcome.ALREADY_RESUMED
    assert again.pid == resumed.pid
    assert len(list(rig.out.glob("*.json"))) == 2  # no third process was started
    with pytest.raises(PermanentError, match="stop it first"):
        control.resume(LJOB, "/ckpt/ckpt-000020.pt", 20, None)

    # Another process (here: another handle on the same state directory) sees the same job.
    other = LocalJobControl(rig.state_dir, command=["unused"])
    assert other.status(LJOB) is JobStatus.RUNNING
    assert other.stop(LJOB).outcome is StopOutcome.STOPPED
    assert _group_members(resumed.pid) == []
    assert control.status(LJOB) is JobStatus.SUSPENDED
    assert "Traceback" not in rig.log.read_text()


def test_local_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    rig = LocalRig(tmp_path, stop_timeout_s=0.5)
    pid = rig.control.launch("stubborn", ["--stubborn"], rig.log)
    try:
        started = rig.started(pid)
        result = rig.control.stop(JobRef("stubborn"))
    finally:
        rig.kill_leftovers()

    assert result.outcome is StopOutcome.STOPPED
    assert "SIGKILL" in result.detail
    assert _group_members(pid) == []
    assert not _live(started["pid"])
    assert rig.control.status(JobRef("stubborn")) is JobStatus.SUSPENDED


@pytest.mark.parametrize(("code", "expected"), [(0, JobStatus.SUCCEEDED), (3, JobStatus.FAILED)])
def test_local_finished_job_status(rig: LocalRig, code: int, expected: JobStatus) -> None:
    rig.control.launch("short", ["--exit", str(code)], rig.log)
    job = JobRef("short")

    assert rig.control.wait(job, timeout_s=20) is expected
    assert rig.control.status(job) is expected
    assert rig.control.stop(job).outcome is StopOutcome.NOT_RUNNING


def test_local_unknown_job_and_bad_refs(rig: LocalRig) -> None:
    with pytest.raises(NotFoundError) as caught:
        rig.control.stop(JobRef("never"))
    assert (caught.value.verb, caught.value.target) == ("stop", "job/never")
    with pytest.raises(ValueError, match="local jobs"):
        rig.control.status(JobRef("x", kind=JobKind.PYTORCHJOB))
    with pytest.raises(ValueError, match="names files"):
        rig.control.launch("../escape", [], rig.log)


def test_local_pid_is_not_confused_with_a_stranger(rig: LocalRig) -> None:
    """A record whose leader pid was reused by an unrelated process is not "running"."""
    pid = rig.control.launch("reused", ["--exit", "0"], rig.log)
    rig.control.wait(JobRef("reused"), timeout_s=20)
    state = rig.state_dir / "reused.json"
    record = json.loads(state.read_text())
    record["launches"][-1]["pid"] = record["launches"][-1]["pgid"] = os.getpid()
    state.write_text(json.dumps(record))

    assert pid != os.getpid()
    assert rig.control.status(JobRef("reused")) is JobStatus.SUCCEEDED  # not RUNNING
