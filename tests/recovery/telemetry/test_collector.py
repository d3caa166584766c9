"""The collectors: fixture directories with per-file fallback, and the Kubernetes backend's
pod lookup and scrape against real local HTTP servers (a tiny Kubernetes API and an exporter).

The diagnostic pod's exec path is a websocket that only a real API server speaks; here the
API refuses to create the pod, which is how the three exec tools are shown to be recorded as
failed while the scrape still counts.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from kubernetes import client as k8s

from recovery.errors import NotFoundError, PermanentError
from recovery.telemetry import (
    FixtureTelemetry,
    Health,
    KubeTelemetry,
    SourceStatus,
    Tool,
    packaged_fixture_root,
)
from tests.recovery.telemetry._files import FIXTURES, PACKAGED, read_fixture

AT = dt.datetime(2026, 1, 5, 9, 30, tzinfo=dt.UTC)


def _clock() -> dt.datetime:
    return AT


# ---------------------------------------------------------------- FixtureTelemetry


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A fixture root with the packaged healthy ``_default`` set and nothing else."""
    shutil.copytree(PACKAGED / "_default", tmp_path / "_default")
    return tmp_path


def test_each_file_falls_back_to_default_on_its_own(root: Path) -> None:
    (root / "node-a").mkdir()
    shutil.copy(PACKAGED / "unhealthy" / "kmsg.log", root / "node-a" / "kmsg.log")

    snapshot = FixtureTelemetry(root, clock=_clock).collect("node-a")

    origins = {report.tool: Path(report.origin) for report in snapshot.sources}
    assert origins == {
        Tool.KERNEL_LOG: root / "node-a" / "kmsg.log",
        Tool.DCGM_EXPORTER: root / "_default" / "dcgm-exporter.prom",
        Tool.DCGMI_DIAG: root / "_default" / "dcgmi-diag.json",
        Tool.NVIDIA_SMI: root / "_default" / "nvidia-smi-q.xml",
    }
    assert snapshot.health is Health.FAILED
    assert snapshot.gpus[0].xids == (48, 63, 79, 94)
    assert snapshot.node == "node-a"


def test_a_node_without_a_directory_reads_default(root: Path) -> None:
    snapshot = FixtureTelemetry(root, clock=_clock).collect("node-b")

    assert snapshot.health is Health.HEALTHY
    assert {Path(report.origin).parent for report in snapshot.sources} == {root / "_default"}


def test_a_file_missing_everywhere_is_recorded_as_missing_and_degrades(root: Path) -> None:
    (root / "_default" / "dcgmi-diag.json").unlink()

    snapshot = FixtureTelemetry(root, clock=_clock).collect("node-c")

    report = snapshot.source(Tool.DCGMI_DIAG)
    assert report is not None
    assert report.status is SourceStatus.MISSING
    assert report.error == "none of dcgmi-diag.json under node-c/ or _default/"
    assert snapshot.health is Health.DEGRADED
    assert snapshot.diag is None
    assert snapshot.exporter is not None


def test_a_broken_file_is_a_failed_source_and_the_other_tools_still_count(root: Path) -> None:
    (root / "node-d").mkdir()
    (root / "node-d" / "dcgmi-diag.json").write_text(
        read_fixture("dcgmi-diag-j_dcgm3.1.0_8gpu_pass.json")[:500], encoding="utf-8"
    )
    (root / "node-d" / "kmsg.log").write_text(
        read_fixture("kmsg_xid119_gsp-rpc-timeout_dmesg-ctime.log"), encoding="utf-8"
    )

    snapshot = FixtureTelemetry(root, clock=_clock).collect("node-d")

    report = snapshot.source(Tool.DCGMI_DIAG)
    assert report is not None
    assert (report.status, report.error_type) == (SourceStatus.FAILED, "TelemetryParseError")
    assert report.error is not None
    assert "invalid JSON" in report.error
    assert snapshot.health is Health.FAILED  # the Xid 119 still counts
    assert any("dcgmi-diag failed" in reason for reason in snapshot.reasons)


def test_plain_nvidia_smi_text_is_read_when_there_is_no_xml(root: Path) -> None:
    (root / "_default" / "nvidia-smi-q.xml").unlink()
    (root / "h100").mkdir()
    shutil.copy(
        FIXTURES / "nvidia-smi-q_H100-80GB-HBM3-x8_driver535.161.08.txt",
        root / "h100" / "nvidia-smi-q.txt",
    )

    snapshot = FixtureTelemetry(root, clock=_clock).collect("h100")

    assert snapshot.nvidia_smi is not None
    assert snapshot.nvidia_smi.format == "text"
    assert len(snapshot.nvidia_smi.gpus) == 8


def test_node_names_cannot_leave_the_root(root: Path) -> None:
    with pytest.raises(PermanentError, match="not a Kubernetes node name"):
        FixtureTelemetry(root).collect("../etc")


def test_a_missing_root_is_refused_up_front(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        FixtureTelemetry(tmp_path / "nowhere")


def test_packaged_root_has_the_two_documented_sets() -> None:
    root = packaged_fixture_root()

    assert sorted(path.name for path in root.iterdir() if path.is_dir()) == [
        "_default",
        "unhealthy",
    ]


# ---------------------------------------------------------------- KubeTelemetry


@dataclass
class _Server:
    """One local HTTP server whose answers a test sets and whose requests it reads."""

    pods: list[dict[str, Any]] = field(default_factory=list)
    metrics: str = ""
    metrics_status: int = 200
    requests: list[tuple[str, str, dict[str, list[str]], Any]] = field(default_factory=list)
    port: int = 0


def _handler(state: _Server) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
            del format, args

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _status(self, code: int, reason: str, message: str) -> None:
            body = {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": message,
                "reason": reason,
                "code": code,
            }
            self._reply(code, json.dumps(body).encode(), "application/json")

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            query = parse_qs(url.query)
            state.requests.append(("GET", url.path, query, None))
            if url.path == "/metrics":
                self._reply(
                    state.metrics_status,
                    state.metrics.encode(),
                    "text/plain; version=0.0.4; charset=utf-8",
                )
                return
            parts = url.path.strip("/").split("/")
            if parts[:3] == ["api", "v1", "namespaces"] and parts[4:] == ["pods"]:
                items = [pod for pod in state.pods if pod["metadata"]["namespace"] == parts[3]]
                for selector in query.get("fieldSelector", []):
                    key, _, value = selector.partition("=")
                    assert key == "spec.nodeName"
                    items = [pod for pod in items if pod["spec"]["nodeName"] == value]
                for selector in query.get("labelSelector", []):
                    key, _, value = selector.partition("=")
                    items = [pod for pod in items if pod["metadata"]["labels"].get(key) == value]
                body = {
                    "kind": "PodList",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": "1"},
                    "items": items,
                }
                self._reply(200, json.dumps(body).encode(), "application/json")
                return
            self._status(404, "NotFound", f"{url.path} not found")

        def do_POST(self) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length) or b"null")
            state.requests.append(("POST", url.path, {}, body))
            self._status(
                403,
                "Forbidden",
                'pods is forbidden: User "system:serviceaccount:sdcguard:flow" cannot '
                'create resource "pods" in namespace "gpu-operator"',
            )

    return Handler


@pytest.fixture
def server() -> Iterator[_Server]:
    state = _Server()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    state.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


@pytest.fixture
def api_client(server: _Server) -> Iterator[k8s.ApiClient]:
    configuration = k8s.Configuration()
    configuration.host = f"http://127.0.0.1:{server.port}"
    client = k8s.ApiClient(configuration)
    try:
        yield client
    finally:
        client.close()


def _pod(
    name: str, node: str, phase: str, ip: str | None, labels: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "gpu-operator",
            "labels": labels if labels is not None else {"app": "nvidia-dcgm-exporter"},
        },
        "spec": {"nodeName": node, "containers": [{"name": "exporter", "image": "dcgm-exporter"}]},
        "status": {"phase": phase, "podIP": ip},
    }


def _telemetry(server: _Server, api_client: k8s.ApiClient, **kwargs: Any) -> KubeTelemetry:
    return KubeTelemetry(
        api_client, namespace="gpu-operator", exporter_port=server.port, clock=_clock, **kwargs
    )


def test_scrape_of_the_exporter_on_the_node_and_exec_tools_recorded_as_failed(
    server: _Server, api_client: k8s.ApiClient
) -> None:
    server.metrics = read_fixture("dcgm-exporter_metrics_L4_dcgm-exporter4x_kops.prom")
    server.pods = [
        _pod("dcgm-exporter-aaaaa", "node-0", "Running", "10.9.9.9"),
        _pod("dcgm-exporter-bbbbb", "node-1", "Pending", None),
        _pod("dcgm-exporter-ccccc", "node-1", "Running", "127.0.0.1"),
        _pod("node-feature-discovery", "node-1", "Running", "10.9.9.8", {"app": "nfd"}),
    ]

    snapshot = _telemetry(server, api_client).collect("node-1")

    exporter = snapshot.source(Tool.DCGM_EXPORTER)
    assert exporter is not None
    assert exporter.status is SourceStatus.OK
    assert exporter.origin == f"http://127.0.0.1:{server.port}/metrics"
    assert snapshot.exporter is not None
    assert snapshot.exporter.gpus[0].uuid == "GPU-c2f76b33-7953-256e-8f33-1343419b1a1c"
    assert snapshot.gpus[0].temperature_c == 31
    for tool in (Tool.DCGMI_DIAG, Tool.KERNEL_LOG, Tool.NVIDIA_SMI):
        report = snapshot.source(tool)
        assert report is not None
        assert (report.status, report.error_type) == (SourceStatus.FAILED, "ForbiddenError")
        assert report.error is not None
        assert "HTTP 403" in report.error
    assert snapshot.health is Health.DEGRADED
    assert snapshot.collected_at == AT

    listing = next(req for req in server.requests if req[1].endswith("/pods") and req[0] == "GET")
    assert listing[1] == "/api/v1/namespaces/gpu-operator/pods"
    assert listing[2]["fieldSelector"] == ["spec.nodeName=node-1"]
    assert listing[2]["labelSelector"] == ["app=nvidia-dcgm-exporter"]
    (create,) = [req for req in server.requests if req[0] == "POST"]
    manifest = create[3]
    assert manifest["spec"]["nodeName"] == "node-1"
    assert manifest["spec"]["tolerations"] == [{"operator": "Exists"}]
    assert manifest["spec"]["containers"][0]["securityContext"] == {"privileged": True}
    assert manifest["spec"]["containers"][0]["image"].startswith(
        "nvcr.io/nvidia/cloud-native/dcgm:"
    )
    assert manifest["spec"]["activeDeadlineSeconds"] > 0


def test_no_exporter_pod_on_the_node_is_a_failed_source(
    server: _Server, api_client: k8s.ApiClient
) -> None:
    server.pods = [_pod("dcgm-exporter-aaaaa", "node-0", "Running", "127.0.0.1")]

    snapshot = _telemetry(server, api_client).collect("node-1")

    report = snapshot.source(Tool.DCGM_EXPORTER)
    assert report is not None
    assert (report.status, report.error_type) == (SourceStatus.FAILED, "NotFoundError")
    assert report.error is not None
    assert "no running pod with an IP" in report.error
    assert snapshot.exporter is None


def test_an_exporter_answering_500_is_a_temporary_failure_recorded_in_sources(
    server: _Server, api_client: k8s.ApiClient
) -> None:
    server.pods = [_pod("dcgm-exporter-ccccc", "node-1", "Running", "127.0.0.1")]
    server.metrics_status = 500
    server.metrics = "collector failed"

    with httpx.Client() as http:
        snapshot = _telemetry(server, api_client, http=http).collect("node-1")

    report = snapshot.source(Tool.DCGM_EXPORTER)
    assert report is not None
    assert (report.status, report.error_type) == (SourceStatus.FAILED, "TemporaryError")
    assert report.error == f"dcgm-exporter: scrape http://127.0.0.1:{server.port}/metrics: HTTP 500"
    assert any(r.startswith("dcgm-exporter failed (http://127.0.0.1:") for r in snapshot.reasons)


def test_an_unparseable_scrape_is_a_failed_source(
    server: _Server, api_client: k8s.ApiClient
) -> None:
    server.pods = [_pod("dcgm-exporter-ccccc", "node-1", "Running", "127.0.0.1")]
    server.metrics = read_fixture("dcgm-exporter_metrics_L4_dcgm-exporter4x_kops.prom")[:400]

    snapshot = _telemetry(server, api_client).collect("node-1")

    report = snapshot.source(Tool.DCGM_EXPORTER)
    assert report is not None
    assert (report.status, report.error_type) == (SourceStatus.FAILED, "TelemetryParseError")
