"""Collecting a node's telemetry: the :class:`TelemetryCollector` interface and its backends.

Every backend gathers the raw text of the four tools, then hands it to the same parsing and
judging code, so the local backend exercises exactly what the real one runs. A tool that
fails (no exporter pod, HTTP 500, unparseable output, ``dcgmi`` runtime error) is recorded in
the snapshot's ``sources`` with its error and the other tools still count; only errors that
are not about a tool's answer (a bug, a leaked diagnostic pod) propagate.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Final, Protocol

import httpx
from kubernetes import client as k8s
from kubernetes import watch
from kubernetes.client.exceptions import ApiException
from kubernetes.stream import stream
from urllib3.exceptions import HTTPError as Urllib3Error

from recovery.errors import (
    NotFoundError,
    PermanentError,
    RecoveryError,
    TemporaryError,
)
from recovery.kube.client import translate
from recovery.telemetry.dcgm_exporter import ExporterScrape, parse_dcgm_exporter
from recovery.telemetry.dcgmi_diag import DiagReport, parse_dcgmi_diag
from recovery.telemetry.errors import TelemetryToolError
from recovery.telemetry.nvidia_smi import (
    NvidiaSmiReport,
    parse_nvidia_smi_text,
    parse_nvidia_smi_xml,
)
from recovery.telemetry.snapshot import SourceReport, TelemetrySnapshot, Tool, build_snapshot
from recovery.telemetry.xid import KernelLog, parse_kernel_log

__all__ = [
    "DEFAULT_DIAG_IMAGE",
    "DEFAULT_NODE",
    "FIXTURE_FILES",
    "FixtureTelemetry",
    "KubeTelemetry",
    "TelemetryCollector",
    "packaged_fixture_root",
]

_LOG = logging.getLogger(__name__)

#: The ``<root>`` directory name whose files stand in for any node that lacks its own.
DEFAULT_NODE: Final = "_default"

#: File names per tool under ``<root>/<node>/``, in order of preference.
FIXTURE_FILES: Final[Mapping[Tool, tuple[str, ...]]] = {
    Tool.DCGM_EXPORTER: ("dcgm-exporter.prom",),
    Tool.DCGMI_DIAG: ("dcgmi-diag.json",),
    Tool.KERNEL_LOG: ("kmsg.log",),
    Tool.NVIDIA_SMI: ("nvidia-smi-q.xml", "nvidia-smi-q.txt"),
}

#: DCGM's own image: it has ``nv-hostengine``, ``dcgmi`` and util-linux ``dmesg``; the NVIDIA
#: container runtime injects ``nvidia-smi`` (``NVIDIA_DRIVER_CAPABILITIES=utility``).
DEFAULT_DIAG_IMAGE: Final = "nvcr.io/nvidia/cloud-native/dcgm:4.2.3-1-ubuntu22.04"

_NODE_NAME_RE: Final = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")


class TelemetryCollector(Protocol):
    """Gathers one :class:`TelemetrySnapshot` of a node; never raises for a failing tool."""

    def collect(self, node: str) -> TelemetrySnapshot: ...


def packaged_fixture_root() -> Path:
    """The fixture sets shipped in the package (``_default`` healthy, ``unhealthy``)."""
    return Path(str(resources.files("recovery").joinpath("fixtures", "telemetry")))


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class _Answer:
    """A tool's raw output, or why there is none."""

    origin: str
    text: str | None = None
    error: RecoveryError | None = None
    missing: str | None = None


def _parse_nvidia_smi(text: str, *, source: str) -> NvidiaSmiReport:
    if text.lstrip().startswith("<"):
        return parse_nvidia_smi_xml(text, source=source)
    return parse_nvidia_smi_text(text, source=source)


def _judge(
    node: str, collected_at: dt.datetime, answers: Mapping[Tool, _Answer]
) -> TelemetrySnapshot:
    """Parse every answer, record each tool's outcome, and build the snapshot."""
    sources: list[SourceReport] = []
    exporter: ExporterScrape | None = None
    diag: DiagReport | None = None
    kernel_log: KernelLog | None = None
    nvidia_smi: NvidiaSmiReport | None = None
    for tool in Tool:
        answer = answers[tool]
        if answer.missing is not None:
            sources.append(SourceReport.missing(tool, answer.origin, answer.missing))
            continue
        failure = answer.error
        if failure is None:
            text = answer.text or ""
            try:
                if tool is Tool.DCGM_EXPORTER:
                    exporter = parse_dcgm_exporter(text, source=answer.origin)
                elif tool is Tool.DCGMI_DIAG:
                    diag = parse_dcgmi_diag(text, source=answer.origin)
                elif tool is Tool.KERNEL_LOG:
                    kernel_log = parse_kernel_log(text)
                else:
                    nvidia_smi = _parse_nvidia_smi(text, source=answer.origin)
            except RecoveryError as err:
                failure = err
        if failure is not None:
            _LOG.warning(
                "telemetry tool failed",
                extra={
                    "node": node,
                    "tool": tool.value,
                    "origin": answer.origin,
                    "error": str(failure),
                },
            )
            sources.append(SourceReport.failed(tool, answer.origin, failure))
            continue
        sources.append(SourceReport.ok(tool, answer.origin))
    snapshot = build_snapshot(
        node,
        collected_at=collected_at,
        sources=sources,
        exporter=exporter,
        diag=diag,
        kernel_log=kernel_log,
        nvidia_smi=nvidia_smi,
    )
    _LOG.info(
        "telemetry collected",
        extra={"node": node, "health": snapshot.health.value, "reasons": len(snapshot.reasons)},
    )
    return snapshot


def _check_node_name(node: str) -> None:
    if not _NODE_NAME_RE.match(node):
        raise PermanentError("telemetry", "collect", repr(node), "not a Kubernetes node name")


class FixtureTelemetry:
    """Local backend: reads real tool outputs from ``<root>/<node>/``.

    Each file is looked up on its own, first under ``<root>/<node>/`` and then under
    ``<root>/_default/``, so a node's fixture set holds only what differs from a healthy node.
    A file found in neither place is recorded as ``missing`` (and degrades the snapshot).
    """

    def __init__(self, root: Path, *, clock: Callable[[], dt.datetime] = _utcnow) -> None:
        if not root.is_dir():
            raise NotFoundError("telemetry", "open fixtures", str(root), "not a directory")
        self._root = root
        self._clock = clock

    def collect(self, node: str) -> TelemetrySnapshot:
        _check_node_name(node)
        answers = {tool: self._answer(node, names) for tool, names in FIXTURE_FILES.items()}
        return _judge(node, self._clock(), answers)

    def _answer(self, node: str, names: tuple[str, ...]) -> _Answer:
        for directory in (self._root / node, self._root / DEFAULT_NODE):
            for name in names:
                path = directory / name
                if path.is_file():
                    return _Answer(origin=str(path), text=path.read_text(encoding="utf-8"))
        return _Answer(
            origin=str(self._root / node),
            missing=f"none of {', '.join(names)} under {node}/ or {DEFAULT_NODE}/",
        )


class KubeTelemetry:
    """Real backend: dcgm-exporter over HTTP, the other tools in a diagnostic pod on the node.

    The exporter pod is found with ``CoreV1Api.list_namespaced_pod`` (label selector plus
    ``fieldSelector=spec.nodeName=<node>``) and scraped at ``http://<podIP>:<port>/metrics``.
    ``dcgmi diag -r 1 -j``, ``dmesg --time-format iso`` and ``nvidia-smi -q -x`` run through the
    exec API (``kubernetes.stream.stream``, a websocket) in a short-lived privileged pod pinned
    to the node with ``nodeName`` and tolerating every taint, because the node is cordoned by
    then. The pod runs its own ``nv-hostengine`` and is deleted after the three commands;
    ``activeDeadlineSeconds`` ends it even if the delete is lost.

    The exec path is kept to pod create / wait / exec / delete, and all parsing lives in the
    shared code; it is tested at the wire against the fake API's exec websocket
    (``v4.channel.k8s.io``, ``tests/recovery/telemetry/test_collector_exec.py``).
    """

    _COMMANDS: Final[Mapping[Tool, tuple[str, ...]]] = {
        Tool.DCGMI_DIAG: ("dcgmi", "diag", "-r", "1", "-j"),
        Tool.KERNEL_LOG: ("dmesg", "--time-format", "iso"),
        Tool.NVIDIA_SMI: ("nvidia-smi", "-q", "-x"),
    }

    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        namespace: str,
        exporter_namespace: str | None = None,
        exporter_label_selector: str = "app=nvidia-dcgm-exporter",
        exporter_port: int = 9400,
        diag_image: str = DEFAULT_DIAG_IMAGE,
        service_account: str | None = None,
        http: httpx.Client | None = None,
        runtime_class_name: str | None = "nvidia",
        scrape_timeout_s: float = 10.0,
        pod_start_timeout_s: int = 180,
        exec_timeout_s: int = 600,
        clock: Callable[[], dt.datetime] = _utcnow,
    ) -> None:
        self._core = k8s.CoreV1Api(api_client)
        # The diagnostic pod runs in sdcguard's own namespace (whose Pod Security level admits a
        # privileged, hostPID pod), never in the training namespace; the exporter lives where
        # the GPU operator put it.
        self._namespace = namespace
        self._exporter_namespace = exporter_namespace or namespace
        self._service_account = service_account
        self._selector = exporter_label_selector
        self._port = exporter_port
        self._image = diag_image
        self._http = http
        self._runtime_class_name = runtime_class_name
        self._scrape_timeout_s = scrape_timeout_s
        self._pod_start_timeout_s = pod_start_timeout_s
        self._exec_timeout_s = exec_timeout_s
        self._clock = clock

    def collect(self, node: str) -> TelemetrySnapshot:
        _check_node_name(node)
        collected_at = self._clock()
        answers: dict[Tool, _Answer] = {Tool.DCGM_EXPORTER: self._exporter_answer(node)}
        answers.update(self._node_answers(node))
        return _judge(node, collected_at, answers)

    # ------------------------------------------------------------------ dcgm-exporter

    def exporter_url(self, node: str) -> str:
        """``/metrics`` URL of the running dcgm-exporter pod on ``node``."""
        target = f"{self._exporter_namespace}/pods[{self._selector}] on {node}"
        try:
            pods = self._core.list_namespaced_pod(
                self._exporter_namespace,
                label_selector=self._selector,
                field_selector=f"spec.nodeName={node}",
            )
        except ApiException as err:
            raise translate(err, verb="list pods", target=target) from err
        except Urllib3Error as err:
            raise TemporaryError("kubernetes", "list pods", target, str(err)) from err
        running: list[tuple[str, str]] = sorted(
            (str(pod.metadata.name if pod.metadata else ""), str(pod.status.pod_ip))
            for pod in pods.items
            if pod.status and pod.status.phase == "Running" and pod.status.pod_ip
        )
        if not running:
            raise NotFoundError(
                "kubernetes", "find dcgm-exporter pod", target, "no running pod with an IP"
            )
        if len(running) > 1:
            _LOG.warning(
                "several dcgm-exporter pods on one node; scraping the first by name",
                extra={"node": node, "pods": [name for name, _ in running]},
            )
        return f"http://{running[0][1]}:{self._port}/metrics"

    def scrape(self, url: str) -> str:
        """The exposition text at ``url``; HTTP and transport failures become typed errors."""
        try:
            if self._http is not None:
                response = self._http.get(url, timeout=self._scrape_timeout_s)
            else:
                with httpx.Client(timeout=self._scrape_timeout_s) as http:
                    response = http.get(url)
        except httpx.TransportError as err:
            raise TemporaryError("dcgm-exporter", "scrape", url, repr(err)) from err
        if response.status_code >= 500 or response.status_code == 429:
            raise TemporaryError("dcgm-exporter", "scrape", url, f"HTTP {response.status_code}")
        if response.status_code != 200:
            raise PermanentError("dcgm-exporter", "scrape", url, f"HTTP {response.status_code}")
        return response.text

    def _exporter_answer(self, node: str) -> _Answer:
        origin = f"dcgm-exporter on {node}"
        try:
            url = self.exporter_url(node)
            origin = url
            return _Answer(origin=url, text=self.scrape(url))
        except RecoveryError as err:
            return _Answer(origin=origin, error=err)

    # ------------------------------------------------------------------ diagnostic pod

    def _node_answers(self, node: str) -> dict[Tool, _Answer]:
        name = f"sdcguard-telemetry-{uuid.uuid4().hex[:10]}"
        origin = f"pod {self._namespace}/{name} on {node}"
        try:
            self._create_pod(node, name)
        except RecoveryError as err:
            return {tool: _Answer(origin=origin, error=err) for tool in self._COMMANDS}
        try:
            try:
                self._wait_running(name)
            except RecoveryError as err:
                return {tool: _Answer(origin=origin, error=err) for tool in self._COMMANDS}
            answers: dict[Tool, _Answer] = {}
            for tool, command in self._COMMANDS.items():
                where = f"{origin}: {' '.join(command)}"
                try:
                    answers[tool] = _Answer(origin=where, text=self._exec(name, tool, command))
                except RecoveryError as err:
                    answers[tool] = _Answer(origin=where, error=err)
            return answers
        finally:
            self._delete_pod(name)

    def _pod_manifest(self, node: str, name: str) -> dict[str, Any]:
        deadline = self._pod_start_timeout_s + len(self._COMMANDS) * self._exec_timeout_s + 60
        spec: dict[str, Any] = {
            "nodeName": node,
            "restartPolicy": "Never",
            "hostPID": True,
            "activeDeadlineSeconds": deadline,
            "tolerations": [{"operator": "Exists"}],
            "containers": [
                {
                    "name": "telemetry",
                    "image": self._image,
                    "command": ["nv-hostengine", "-n"],
                    "securityContext": {"privileged": True},
                    "env": [
                        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                        {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"},
                    ],
                }
            ],
        }
        if self._runtime_class_name:
            spec["runtimeClassName"] = self._runtime_class_name
        if self._service_account:
            spec["serviceAccountName"] = self._service_account
            spec["automountServiceAccountToken"] = False
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self._namespace,
                "labels": {
                    "app.kubernetes.io/name": "sdcguard-telemetry",
                    "app.kubernetes.io/managed-by": "sdcguard",
                },
            },
            "spec": spec,
        }

    def _create_pod(self, node: str, name: str) -> None:
        target = f"{self._namespace}/{name}"
        try:
            # The client serialises a plain manifest dict exactly as it would a V1Pod.
            self._core.create_namespaced_pod(self._namespace, self._pod_manifest(node, name))  # type: ignore[arg-type]
        except ApiException as err:
            raise translate(err, verb="create pod", target=target) from err
        except Urllib3Error as err:
            raise TemporaryError("kubernetes", "create pod", target, str(err)) from err
        _LOG.info("diagnostic pod created", extra={"node": node, "pod": target})

    def _wait_running(self, name: str) -> None:
        target = f"{self._namespace}/{name}"
        watcher = watch.Watch()
        try:
            for event in watcher.stream(
                self._core.list_namespaced_pod,
                self._namespace,
                field_selector=f"metadata.name={name}",
                timeout_seconds=self._pod_start_timeout_s,
            ):
                status = event["object"].status
                phase = status.phase if status is not None else None
                if phase == "Running":
                    return
                if phase in ("Failed", "Succeeded"):
                    raise PermanentError("kubernetes", "start pod", target, f"pod {phase}")
        except ApiException as err:
            raise translate(err, verb="watch pod", target=target) from err
        except Urllib3Error as err:
            raise TemporaryError("kubernetes", "watch pod", target, str(err)) from err
        finally:
            watcher.stop()
        raise TemporaryError(
            "kubernetes", "start pod", target, f"not running after {self._pod_start_timeout_s}s"
        )

    def _exec(self, name: str, tool: Tool, command: tuple[str, ...]) -> str:
        """Run ``command`` in the pod; its stdout, even on a non-zero exit (``dcgmi diag``
        exits non-zero when a test fails and still prints the JSON)."""
        target = f"{self._namespace}/{name}"
        try:
            websocket = stream(
                self._core.connect_get_namespaced_pod_exec,
                name,
                self._namespace,
                command=list(command),
                stderr=True,
                stdin=False,
                stdout=True,
                tty=False,
                _preload_content=False,
            )
            websocket.run_forever(timeout=self._exec_timeout_s)
            if websocket.is_open():
                websocket.close()
                raise TelemetryToolError(
                    tool.value, target, f"no exit after {self._exec_timeout_s}s"
                )
            stdout = str(websocket.read_stdout(timeout=0))
            stderr = str(websocket.read_stderr(timeout=0))
            returncode = websocket.returncode
        except ApiException as err:
            raise translate(err, verb="exec in pod", target=target) from err
        if returncode != 0:
            _LOG.warning(
                "telemetry command exited non-zero",
                extra={
                    "pod": target,
                    "tool": tool.value,
                    "returncode": returncode,
                    "stderr": stderr[-2000:],
                },
            )
            if not stdout.strip():
                raise TelemetryToolError(
                    tool.value, target, f"exit {returncode}, no output; stderr: {stderr[-500:]}"
                )
        return stdout

    def _delete_pod(self, name: str) -> None:
        target = f"{self._namespace}/{name}"
        try:
            self._core.delete_namespaced_pod(name, self._namespace, grace_period_seconds=0)
        except ApiException as err:
            if err.status == 404:
                return
            raise translate(err, verb="delete pod", target=target) from err
        except Urllib3Error as err:
            raise TemporaryError("kubernetes", "delete pod", target, str(err)) from err
