"""KubeTelemetry's diagnostic pod end to end at the wire: the pod is created on the node, waited
for, and ``dcgmi diag``, ``dmesg`` and ``nvidia-smi`` run in it through the exec websocket of the
fake API (``tests/recovery/fake_exec.py``; the official client's ``kubernetes.stream``), whose
"container" answers with real tool outputs (the packaged fixture sets); the pod is deleted after.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from recovery.telemetry import Health, KubeTelemetry, SourceStatus, Tool
from tests.recovery.fake_exec import ExecResult
from tests.recovery.fake_kube import FakeKube
from tests.recovery.fake_kubelet import FakeKubelet
from tests.recovery.telemetry._files import PACKAGED

NODE = "hyperpod-i-0a1b2c3d4e5f60718"
# What each command of the diagnostic pod prints, from the fixture sets (file per tool).
FILES = {"dcgmi": "dcgmi-diag.json", "dmesg": "kmsg.log", "nvidia-smi": "nvidia-smi-q.xml"}


class _Exporter(http.server.BaseHTTPRequestHandler):
    body = (PACKAGED / "_default" / "dcgm-exporter.prom").read_bytes()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def exporter_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()


def _container(fixture_set: str, calls: list[tuple[str, str, tuple[str, ...]]]) -> Any:
    """The diagnostic container: each tool prints its file from ``fixture_set`` (falling back
    to ``_default`` as the fixture collector does); ``dcgmi diag`` exits 226 when a test failed,
    as DCGM does, still printing its JSON."""

    def run(namespace: str, pod: str, command: Sequence[str]) -> ExecResult:
        calls.append((namespace, pod, tuple(command)))
        name = FILES[command[0]]
        path = PACKAGED / fixture_set / name
        out = (path if path.is_file() else PACKAGED / "_default" / name).read_bytes()
        failed = command[0] == "dcgmi" and b'"FAIL"' in out
        return ExecResult(stdout=out, exit_code=226 if failed else 0)

    return run


def _collect(
    tmp_path: Path, fixture_set: str | None, exporter_port: int
) -> tuple[Any, FakeKube, list[tuple[str, str, tuple[str, ...]]]]:
    """Collect ``NODE``; ``fixture_set`` None: an image without the tools (exec answers 126)."""
    calls: list[tuple[str, str, tuple[str, ...]]] = []
    with FakeKube() as fake:
        fake.add_node(NODE)
        fake.add_pod(
            "dcgm-exporter-x1", namespace="gpu-operator", node=NODE,
            labels={"app": "nvidia-dcgm-exporter"},
        )  # fmt: skip
        fake.mutate(
            "/api/v1", "pods", "dcgm-exporter-x1",
            lambda o: o["status"].update(phase="Running", podIP="127.0.0.1"),
            namespace="gpu-operator",
        )  # fmt: skip
        if fixture_set is not None:
            fake.on_exec(_container(fixture_set, calls))
        kubelet = FakeKubelet(fake, tmp_path).start()  # marks the bare diagnostic pod Running
        try:
            from recovery.kube.client import api_client_for_host

            api_client: k8s.ApiClient = api_client_for_host(fake.url, token="t")
            telemetry = KubeTelemetry(
                api_client,
                namespace="sdcguard",
                exporter_namespace="gpu-operator",
                exporter_port=exporter_port,
                exec_timeout_s=30,
                pod_start_timeout_s=30,
            )
            snapshot = telemetry.collect(NODE)
        finally:
            kubelet.stop()
        return snapshot, fake, calls


def test_the_diagnostic_tools_run_over_exec_and_a_bad_gpu_is_unhealthy(
    tmp_path: Path, exporter_port: int
) -> None:
    snapshot, fake, calls = _collect(tmp_path, "unhealthy", exporter_port)

    for tool in (Tool.DCGM_EXPORTER, Tool.DCGMI_DIAG, Tool.KERNEL_LOG, Tool.NVIDIA_SMI):
        report = snapshot.source(tool)
        assert report is not None
        assert report.status is SourceStatus.OK, report
    assert snapshot.health is Health.FAILED, snapshot.reasons
    assert 79 in {event.xid for event in snapshot.kernel_xids}
    assert any("sm_stress" in reason for reason in snapshot.reasons), snapshot.reasons
    assert snapshot.nvidia_smi is not None  # the healthy _default output, through exec too
    assert snapshot.diag is not None
    # the three commands ran in the diagnostic pod in sdcguard's namespace, which is gone after
    (pod,) = {pod for _, pod, _ in calls}
    assert [(ns, cmd[0]) for ns, _, cmd in calls] == [
        ("sdcguard", "dcgmi"), ("sdcguard", "dmesg"), ("sdcguard", "nvidia-smi"),
    ]  # fmt: skip
    assert fake.pod(pod, namespace="sdcguard") is None
    execs = fake.requests_to("GET", rf"/api/v1/namespaces/sdcguard/pods/{pod}/exec")
    assert len(execs) == 3
    assert execs[0].query["command"] == ["dcgmi", "diag", "-r", "1", "-j"]


def test_a_healthy_node_over_exec_is_healthy_with_the_caveat(
    tmp_path: Path, exporter_port: int
) -> None:
    snapshot, _, calls = _collect(tmp_path, "_default", exporter_port)

    assert len(calls) == 3
    assert all(s.status is SourceStatus.OK for s in snapshot.sources), snapshot.sources
    assert snapshot.health is Health.HEALTHY, snapshot.reasons
    assert snapshot.kernel_xids == ()
    assert "does not clear" in snapshot.sdc_caveat


def test_an_image_without_the_tools_fails_each_exec_source_and_the_scrape_still_counts(
    tmp_path: Path, exporter_port: int
) -> None:
    snapshot, fake, _ = _collect(tmp_path, None, exporter_port)

    exporter = snapshot.source(Tool.DCGM_EXPORTER)
    assert exporter is not None
    assert exporter.status is SourceStatus.OK
    for tool in (Tool.DCGMI_DIAG, Tool.KERNEL_LOG, Tool.NVIDIA_SMI):
        report = snapshot.source(tool)
        assert report is not None
        assert (report.status, report.error_type) == (SourceStatus.FAILED, "TelemetryToolError")
        assert report.error is not None
        assert "exit 126" in report.error
    assert snapshot.health is Health.DEGRADED
    assert len(fake.requests_to("GET", r".*/exec")) == 3
