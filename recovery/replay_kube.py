"""The real diagnostic replay backend: a Kubernetes Job pinned to one node.

The Job runs the training image's own ``python -m detection.harness`` (the same code, library
versions and device model as the original run — a replay is only evidence if it is
deterministic) with ``nodeName`` set, so the scheduler cannot move it, and a toleration for our
``sdcguard.io/suspect`` taint, so it can run on the cordoned suspect node. Its trace and probe
come back through the pod log between two marker lines: no object store or volume is needed,
and a replay that failed leaves its log for the operator.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from typing import Any, cast

from kubernetes import client as k8s

from recovery.errors import PermanentError, TemporaryError
from recovery.kube import call
from recovery.replay import ReplayRequest, ReplayResult, StepRecord, harness_args

__all__ = ["KubeReplayRunner", "parse_replay_log", "replay_job_manifest"]

log = logging.getLogger(__name__)

TRACE_BEGIN = "=== sdcguard replay trace ==="
PROBE_BEGIN = "=== sdcguard replay probe ==="
END = "=== sdcguard replay end ==="
SUSPECT_TAINT_KEY = "sdcguard.io/suspect"
_TRACE = "/tmp/sdcguard-trace.jsonl"
_PROBE = "/tmp/sdcguard-probe.json"


def _job_name(request: ReplayRequest) -> str:
    raw = f"sdcguard-replay-{request.job_id}-{request.node}-{request.end}"
    if request.probe_step is not None:
        raw += f"-p{request.probe_step}"
    name = re.sub(r"[^a-z0-9-]+", "-", raw.lower()).strip("-")
    return name[:63].rstrip("-")


def replay_job_manifest(
    request: ReplayRequest,
    *,
    image: str,
    namespace: str,
    gpus: int = 0,
    service_account: str | None = None,
) -> dict[str, Any]:
    """The batch/v1 Job that replays ``request`` on ``request.node`` and prints its results."""
    harness = " ".join(
        _quote(a)
        for a in [
            "python",
            "-m",
            "detection.harness",
            *harness_args(request, trace=_TRACE, probe=_PROBE),
        ]
    )
    script = (
        f"set -e; rm -f {_TRACE} {_PROBE}; "
        f"{harness}; echo '{TRACE_BEGIN}'; cat {_TRACE}; "
        f"if [ -f {_PROBE} ]; then echo '{PROBE_BEGIN}'; "
        f"cat {_PROBE}; echo; fi; echo '{END}'"
    )
    container: dict[str, Any] = {
        "name": "replay",
        "image": image,
        "command": ["/bin/sh", "-c", script],
    }
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    pod_spec: dict[str, Any] = {
        "nodeName": request.node,
        "restartPolicy": "Never",
        "tolerations": [
            {"key": SUSPECT_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/unschedulable", "operator": "Exists"},
        ],
        "containers": [container],
    }
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": _job_name(request),
            "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": "sdcguard", "sdcguard.io/role": "replay"},
        },
        "spec": {
            "backoffLimit": 0,
            "ttlSecondsAfterFinished": 3600,
            "template": {
                "metadata": {"labels": {"sdcguard.io/role": "replay"}},
                "spec": pod_spec,
            },
        },
    }


def _quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\"'\"'") + "'"


def parse_replay_log(text: str) -> tuple[list[StepRecord], dict[str, Any] | None]:
    """Steps and probe from a replay pod's log; PermanentError if the markers are missing."""
    lines = text.splitlines()
    try:
        begin = lines.index(TRACE_BEGIN)
        end = lines.index(END, begin)
    except ValueError as err:
        raise PermanentError("replay", "read-log", "pod", "replay output markers missing") from err
    body = lines[begin + 1 : end]
    probe: dict[str, Any] | None = None
    if PROBE_BEGIN in body:
        cut = body.index(PROBE_BEGIN)
        probe_text = "\n".join(body[cut + 1 :]).strip()
        probe = json.loads(probe_text) if probe_text else None
        body = body[:cut]
    steps = [StepRecord.from_dict(json.loads(line)) for line in body if line.strip()]
    return steps, probe


class KubeReplayRunner:
    """Runs a replay as a Job pinned to the node, waits (bounded), reads the pod log back."""

    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        image: str,
        namespace: str = "sdcguard",
        gpus: int = 0,
        service_account: str | None = None,
        timeout_s: float = 3600.0,
        poll_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._batch = k8s.BatchV1Api(api_client)
        self._core = k8s.CoreV1Api(api_client)
        self._image = image
        self._namespace = namespace
        self._gpus = gpus
        self._service_account = service_account
        self._timeout_s = timeout_s
        self._poll_s = poll_interval_s
        self._clock = clock
        self._sleep = sleep

    def replay(self, request: ReplayRequest) -> ReplayResult:
        manifest = replay_job_manifest(
            request,
            image=self._image,
            namespace=self._namespace,
            gpus=self._gpus,
            service_account=self._service_account,
        )
        name = manifest["metadata"]["name"]
        target = f"job/{self._namespace}/{name}"
        extra = {"job": request.job_id, "node": request.node}
        log.info("starting replay job %s", name, extra=extra)
        call(
            "create",
            target,
            # The client serialises a plain manifest dict exactly like a V1Job model.
            lambda: self._batch.create_namespaced_job(self._namespace, cast(k8s.V1Job, manifest)),
        )
        self._wait(name, target)
        pods = call(
            "list-pods",
            target,
            lambda: self._core.list_namespaced_pod(
                self._namespace, label_selector=f"job-name={name}"
            ),
        )
        if not pods.items:
            raise PermanentError("replay", "read-log", target, "the replay job has no pod")
        meta = pods.items[0].metadata
        if meta is None or not meta.name:
            raise PermanentError("replay", "read-log", target, "the replay pod has no name")
        pod: str = meta.name
        text = call(
            "read-log",
            f"pod/{self._namespace}/{pod}",
            lambda: self._core.read_namespaced_pod_log(pod, self._namespace),
        )
        steps, probe = parse_replay_log(str(text))
        kept = tuple(s for s in steps if s.step >= request.start)
        return ReplayResult(request.node, kept, probe, log_path=f"{self._namespace}/{pod}")

    def _wait(self, name: str, target: str) -> None:
        deadline = self._clock() + self._timeout_s
        while True:
            job = call(
                "read",
                target,
                lambda: self._batch.read_namespaced_job_status(name, self._namespace),
            )
            status = job.status
            if status is not None and (status.succeeded or 0) > 0:
                return
            if status is not None and (status.failed or 0) > 0:
                raise PermanentError("replay", "run", target, "the replay pod failed; see its log")
            if self._clock() >= deadline:
                raise TemporaryError(
                    "replay", "wait", target, f"not finished after {self._timeout_s:.0f} s"
                )
            self._sleep(self._poll_s)
