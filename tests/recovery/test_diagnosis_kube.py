"""The Kubernetes rerun backend against the HTTP-level fake API (no real cluster can run here).

The fake's "kubelet" is a route on Job creation: it runs the Job's container command as the
pod would — with this machine's Python as the image's ``python`` — stores a succeeded pod and
serves its log. So the real client, the real manifest and the real ``detection.harness`` run,
and only scheduling is simulated.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from recovery.diagnosis.rerun import JobSpec, RerunRequest, load_trace
from recovery.errors import PermanentError
from recovery.kube.diagnosis import (
    END,
    SUSPECT_TAINT_KEY,
    TRACE_BEGIN,
    KubeRerunner,
    parse_rerun_log,
    rerun_job_manifest,
)
from tests.recovery.fake_kube import FakeKube, FakeResponse, RecordedRequest

NS = "sdcguard"


def _request(checkpoint: Path, end: int = 5) -> RerunRequest:
    return RerunRequest(
        job_id="job-k",
        checkpoint_uri=str(checkpoint),
        checkpoint_step=2,
        end=end,
        node="gpu-node-7",
        spec=JobSpec(world_size=2, seed=5),
    )


def test_the_manifest_pins_the_node_and_tolerates_our_taint(tmp_path: Path) -> None:
    manifest = rerun_job_manifest(
        _request(tmp_path / "c.pt"), image="train:1", namespace=NS, gpus=8
    )
    pod = manifest["spec"]["template"]["spec"]
    assert pod["nodeName"] == "gpu-node-7"
    assert {"key": SUSPECT_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert pod["restartPolicy"] == "Never"
    assert manifest["spec"]["backoffLimit"] == 0
    (container,) = pod["containers"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "8"}}
    script = container["command"][-1]
    assert "'--nodes' 'gpu-node-7,gpu-node-7'" in script
    assert "'--resume-from'" in script
    assert re.fullmatch(r"[a-z0-9-]{1,63}", manifest["metadata"]["name"])


def test_a_log_without_the_markers_is_a_permanent_error() -> None:
    with pytest.raises(PermanentError, match="markers"):
        parse_rerun_log("Traceback (most recent call last): ...")
    steps, probe = parse_rerun_log(f"noise\n{TRACE_BEGIN}\n{END}\n")
    assert steps == []
    assert probe is None


class _Kubelet:
    """Runs a created rerun Job's container like a node would, then records its pod."""

    def __init__(self, fake: FakeKube, bin_dir: Path) -> None:
        self.fake = fake
        self.bin_dir = bin_dir
        self.logs: dict[str, str] = {}
        self.created: list[dict[str, Any]] = []

    def create_job(self, request: RecordedRequest, match: re.Match[str]) -> FakeResponse:
        response = self.fake.serve(request)
        if response.status != 201:
            return response
        job = request.body
        self.created.append(job)
        name = job["metadata"]["name"]
        (container,) = job["spec"]["template"]["spec"]["containers"]
        env = {**os.environ, "PATH": f"{self.bin_dir}{os.pathsep}{os.environ['PATH']}"}
        done = subprocess.run(
            container["command"], capture_output=True, text=True, env=env, timeout=300
        )
        pod = f"{name}-abcde"
        self.logs[pod] = done.stdout + done.stderr
        self.fake.add_pod(
            pod,
            namespace=NS,
            node=job["spec"]["template"]["spec"]["nodeName"],
            labels={"job-name": name, "batch.kubernetes.io/job-name": name},
            owner_kind="Job",
            owner_name=name,
            phase="Succeeded" if done.returncode == 0 else "Failed",
        )
        key = "succeeded" if done.returncode == 0 else "failed"
        self.fake.mutate(
            "/apis/batch/v1", "jobs", name, lambda o: o.update(status={key: 1}), namespace=NS
        )
        return response

    def pod_log(self, request: RecordedRequest, match: re.Match[str]) -> FakeResponse:
        return FakeResponse(200, self.logs[match["pod"]], {"Content-Type": "text/plain"})


@pytest.mark.slow
def test_a_replay_job_runs_on_the_node_and_its_trace_comes_back(
    tmp_path: Path, fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    root = tmp_path / "train"
    subprocess.run(
        [
            sys.executable, "-m", "detection.harness", "--world-size", "2", "--seed", "5",
            "--steps", "6", "--audit-every", "0", "--checkpoint-every", "2",
            "--checkpoint-dir", str(root / "ckpt"), "--trace", str(root / "trace.jsonl"),
        ],
        check=True,
        capture_output=True,
        timeout=180,
    )  # fmt: skip
    bin_dir = tmp_path / "image-bin"  # the image's ``python`` is this machine's
    bin_dir.mkdir()
    wrapper = bin_dir / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    kubelet = _Kubelet(fake_kube, bin_dir)
    fake_kube.route("POST", rf"/apis/batch/v1/namespaces/{NS}/jobs", kubelet.create_job)
    fake_kube.route("GET", rf"/api/v1/namespaces/{NS}/pods/(?P<pod>[^/]+)/log", kubelet.pod_log)

    runner = KubeRerunner(kube_client, image="train:1", namespace=NS, poll_interval_s=0.01)
    result = runner.rerun(_request(root / "ckpt" / "ckpt-000002.pt"))

    (job,) = kubelet.created
    assert job["spec"]["template"]["spec"]["nodeName"] == "gpu-node-7"
    assert [r.step for r in result.steps] == [3, 4, 5]
    reference = {r.step: r for r in load_trace(root / "trace.jsonl")}
    assert all(r.same_as(reference[r.step]) for r in result.steps)


def test_a_replay_rerun_after_a_crash_gets_a_job_of_its_own(
    tmp_path: Path, fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    """The user's template reruns under a fresh name per attempt: a crashed attempt's Job is
    left for the operator and the re-run meets no 409; a finished one is reused, not re-run."""
    from recovery.diagnosis.rerun import UserJobTemplate
    from tests.recovery.fake_kubelet import FakeKubelet

    healthy = tmp_path / "healthy"
    line = '{"step": 3, "losses": [1.0], "grad_fingerprints": [], "weight_fingerprint": "00"}'
    script = (
        "import os, pathlib, sys\n"
        f"if not pathlib.Path({str(healthy)!r}).exists(): sys.exit('node crashed')\n"
        f"print({TRACE_BEGIN!r}); print({line!r}); print({END!r})\n"
        "assert os.environ['SDCGUARD_RESUME_FROM'] and os.environ['SDCGUARD_REPLAY_END'] == '3'\n"
    )
    template = {"spec": {"containers": [{"name": "pytorch", "image": "u:1",
                                         "command": ["python", "-c", script]}]}}  # fmt: skip
    request = RerunRequest(
        job_id="job-k", checkpoint_uri="s3://b/ckpt-000002.pt", checkpoint_step=2, end=3,
        node="gpu-node-7",
        spec=JobSpec(world_size=1, seed=0, template=UserJobTemplate("job-k", "training",
                                                                    template, gpus=1)),
    )  # fmt: skip
    kubelet = FakeKubelet(fake_kube, tmp_path).start()
    try:
        runner = KubeRerunner(kube_client, poll_interval_s=0.01)
        with pytest.raises(PermanentError, match="failed"):
            runner.rerun(request)  # the first attempt crashes
        healthy.touch()
        result = runner.rerun(request)  # the re-run: a new Job, no 409
        assert [s.step for s in result.steps] == [3]
        again = runner.rerun(request)  # finished already: read back, not run again
        assert again.steps == result.steps
    finally:
        kubelet.stop()
    creates = fake_kube.requests_to("POST", r"/apis/batch/v1/namespaces/training/jobs$")
    names = [r.body["metadata"]["name"] for r in creates]
    assert len(names) == 2
    assert len(set(names)) == 2
    # Both creates were answered 201 (a 409 raises in the runner): distinct names, no collision.
    (pod,) = {p["spec"]["nodeName"] for p in kubelet.launched}
    assert pod == "gpu-node-7"
    assert kubelet.launched[-1]["spec"]["containers"][0]["resources"]["limits"] == {
        "nvidia.com/gpu": "1"
    }


def test_replays_of_two_nodes_run_as_jobs_side_by_side(
    tmp_path: Path, fake_kube: FakeKube, kube_client: k8s.ApiClient
) -> None:
    """A diagnosis's reruns of different nodes (``rerun_all`` on the parallel Kubernetes
    runner) are Jobs whose pods run at the same time. Each pod here waits until both pods run
    before it prints its trace: a rendezvous that Jobs run one after the other never reach (the
    first pod gives up after 30 s and fails, and so does the rerun)."""
    from recovery.diagnosis.batch import rerun_all
    from recovery.diagnosis.rerun import UserJobTemplate
    from tests.recovery.fake_kubelet import FakeKubelet

    running = tmp_path / "running"
    running.mkdir()
    line = '{"step": 3, "losses": [1.0], "grad_fingerprints": [], "weight_fingerprint": "00"}'
    script = (
        "import os, pathlib, sys, time\n"
        f"here = pathlib.Path({str(running)!r})\n"
        "(here / str(os.getpid())).touch()\n"
        "deadline = time.monotonic() + 30\n"
        "while len(list(here.iterdir())) < 2:\n"
        "    if time.monotonic() > deadline:\n"
        "        sys.exit('no other rerun ran alongside this one')\n"
        "    time.sleep(0.05)\n"
        f"print({TRACE_BEGIN!r}); print({line!r}); print({END!r})\n"
    )
    template = {"spec": {"containers": [{"name": "pytorch", "image": "u:1",
                                         "command": ["python", "-c", script]}]}}  # fmt: skip
    spec = JobSpec(
        world_size=1, seed=0, template=UserJobTemplate("job-k", "training", template, gpus=1)
    )
    nodes = ["gpu-node-7", "gpu-node-8"]
    requests = [
        RerunRequest("job-k", "s3://b/ckpt-000002.pt", 2, 3, node=node, spec=spec) for node in nodes
    ]
    kubelet = FakeKubelet(fake_kube, tmp_path).start()
    try:
        results = rerun_all(KubeRerunner(kube_client, poll_interval_s=0.01), requests)
    finally:
        kubelet.stop()
    assert [r.node for r in results] == nodes
    assert [[s.step for s in r.steps] for r in results] == [[3], [3]]
    assert sorted(p["spec"]["nodeName"] for p in kubelet.launched) == nodes
    assert len(list(running.iterdir())) == 2  # one pod each, both running at once
