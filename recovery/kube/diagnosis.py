"""The real diagnostic rerun backend: a Kubernetes Job pinned to one node.

Given the user's job template (:class:`~recovery.diagnosis.rerun.UserJobTemplate`, read from the
cluster by the job catalog) the Job runs *the user's own pod template* — image, command, env,
volumes — in the job's namespace, with the env that puts the guard into replay mode
(:mod:`detection.replay_mode`: ``SDCGUARD_RESUME_FROM`` and ``SDCGUARD_REPLAY_*``) and a
single-pod world (``WORLD_SIZE=1``, ``MASTER_ADDR=127.0.0.1``): every rank of the rerun runs on
the one node, on the node's GPUs (``nvidia.com/gpu``, as many as the job's pods asked for).
Without a template it runs ``python -m detection.harness`` in the configured image.

Either way ``nodeName`` is set, so the scheduler cannot move it, and a toleration for our
``sdcguard.io/suspect`` taint lets it run on the cordoned suspect node. Its trace and probe come
back through the pod log between two marker lines (printed by the guard): no object store or
volume is needed, and a rerun that failed leaves its log for the operator.

Invariant: every attempt creates a Job of its own name (a random suffix), so a re-run after a
crash never meets a 409; a re-run first reuses a *succeeded* Job of the same request (label
``sdcguard.io/replay-key``), so a finished replay is not paid twice.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

from kubernetes import client as k8s

from detection.guard.trace_mode import (
    END,
    PROBE_BEGIN,
    REPLAY_END_ENV,
    REPLAY_PROBE_STEP_ENV,
    REPLAY_START_ENV,
    TRACE_BEGIN,
)
from recovery.diagnosis.rerun import RerunRequest, RerunResult, StepRecord, harness_args
from recovery.errors import PermanentError, TemporaryError
from recovery.jobs import RESUME_ENV
from recovery.kube.client import call

__all__ = [
    "END",
    "PROBE_BEGIN",
    "TRACE_BEGIN",
    "KubeRerunner",
    "parse_rerun_log",
    "rerun_job_manifest",
    "rerun_key",
]

log = logging.getLogger(__name__)

GPU_RESOURCE = "nvidia.com/gpu"
REPLAY_KEY_LABEL = "sdcguard.io/replay-key"
SUSPECT_TAINT_KEY = "sdcguard.io/suspect"
_TRACE = "/tmp/sdcguard-trace.jsonl"
_PROBE = "/tmp/sdcguard-probe.json"


def rerun_key(request: RerunRequest) -> str:
    """What makes two rerun attempts the same rerun (a label value: 63 characters at most)."""
    raw = (
        f"{request.job_id}|{request.node}|{request.checkpoint_uri}|{request.checkpoint_step}|"
        f"{request.end}|{request.probe_step}"
    )
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def _job_name(request: RerunRequest, attempt: str) -> str:
    """Readable prefix, then the attempt's own suffix: unique per attempt, at most 63 chars."""
    raw = f"sdcguard-replay-{request.job_id}-{request.node}-{request.end}"
    if request.probe_step is not None:
        raw += f"-p{request.probe_step}"
    name = re.sub(r"[^a-z0-9-]+", "-", raw.lower()).strip("-")
    return f"{name[: 62 - len(attempt)].rstrip('-')}-{attempt}"


def _rerun_env(request: RerunRequest) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": RESUME_ENV, "value": request.checkpoint_uri},
        {"name": REPLAY_START_ENV, "value": str(request.start)},
        {"name": REPLAY_END_ENV, "value": str(request.end)},
        # One pod holds the whole rerun: the operator's rendezvous env would name pods that
        # do not exist.
        {"name": "WORLD_SIZE", "value": "1"},
        {"name": "RANK", "value": "0"},
        {"name": "MASTER_ADDR", "value": "127.0.0.1"},
        {"name": "MASTER_PORT", "value": "29500"},
        {"name": "PET_NNODES", "value": "1"},
        {"name": "PET_NODE_RANK", "value": "0"},
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]
    if request.probe_step is not None:
        env.append({"name": REPLAY_PROBE_STEP_ENV, "value": str(request.probe_step)})
    return env


def _user_containers(
    template: Mapping[str, Any], request: RerunRequest, gpus: int
) -> list[dict[str, Any]]:
    spec = template.get("spec") or {}
    containers = [copy.deepcopy(dict(c)) for c in spec.get("containers") or []]
    if not containers:
        raise PermanentError("replay", "plan", request.job_id, "the job template has no container")
    ours = {e["name"] for e in _rerun_env(request)}
    for index, container in enumerate(containers):
        kept = [e for e in container.get("env") or [] if e.get("name") not in ours]
        container["env"] = kept + (_rerun_env(request) if index == 0 else [])
        if index == 0 and gpus:
            resources = container.setdefault("resources", {})
            for part in ("limits", "requests"):
                if part == "limits" or GPU_RESOURCE in (resources.get(part) or {}):
                    resources.setdefault(part, {})[GPU_RESOURCE] = str(gpus)  # a quantity
    return containers


def rerun_job_manifest(
    request: RerunRequest,
    *,
    image: str | None,
    namespace: str,
    gpus: int = 0,
    service_account: str | None = None,
    attempt: str | None = None,
) -> dict[str, Any]:
    """The batch/v1 Job that reruns ``request`` on ``request.node`` and prints its results."""
    attempt = attempt or secrets.token_hex(3)
    template = request.spec.template
    if template is not None:
        return _user_job_manifest(request, attempt, gpus or template.gpus)
    if not image:
        raise PermanentError(
            "replay", "plan", request.job_id, "no job template and no replay image configured"
        )
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
        container["resources"] = {"limits": {GPU_RESOURCE: str(gpus)}}  # a quantity
    pod_spec: dict[str, Any] = {"containers": [container]}
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    return _job(request, attempt, namespace, pod_spec, {})


def _user_job_manifest(request: RerunRequest, attempt: str, gpus: int) -> dict[str, Any]:
    template = request.spec.template
    assert template is not None
    pod_spec = copy.deepcopy(dict(template.pod_template.get("spec") or {}))
    pod_spec["containers"] = _user_containers(template.pod_template, request, gpus)
    # The node is chosen, not scheduled: the job's own placement rules no longer apply.
    for key in ("affinity", "nodeSelector", "schedulerName", "priorityClassName"):
        pod_spec.pop(key, None)
    meta = template.pod_template.get("metadata") or {}
    return _job(request, attempt, template.namespace, pod_spec, dict(meta.get("annotations") or {}))


def _job(
    request: RerunRequest,
    attempt: str,
    namespace: str,
    pod_spec: dict[str, Any],
    annotations: dict[str, Any],
) -> dict[str, Any]:
    pod_spec["nodeName"] = request.node
    pod_spec["restartPolicy"] = "Never"
    tolerations = [dict(t) for t in pod_spec.get("tolerations") or []]
    tolerations += [
        {"key": SUSPECT_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"},
        {"key": "node.kubernetes.io/unschedulable", "operator": "Exists"},
    ]
    pod_spec["tolerations"] = tolerations
    labels = {
        "app.kubernetes.io/managed-by": "sdcguard",
        "sdcguard.io/role": "replay",
        REPLAY_KEY_LABEL: rerun_key(request),
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": _job_name(request, attempt), "namespace": namespace, "labels": labels},
        "spec": {
            "backoffLimit": 0,
            "ttlSecondsAfterFinished": 3600,
            "template": {
                "metadata": {"labels": {"sdcguard.io/role": "replay"}, "annotations": annotations},
                "spec": pod_spec,
            },
        },
    }


def _quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\"'\"'") + "'"


def parse_rerun_log(text: str) -> tuple[list[StepRecord], dict[str, Any] | None]:
    """Steps and probe from a rerun pod's log; PermanentError if the markers are missing."""
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


class KubeRerunner:
    """Runs a rerun as a Job pinned to the node, waits (bounded), reads the pod log back.

    Each node is a machine of its own: a diagnosis runs its reruns of different nodes at once
    (``parallel``), so the verdict waits for the longest Job, not for their sum."""

    parallel = True

    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        image: str | None = None,
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

    def rerun(self, request: RerunRequest) -> RerunResult:
        manifest = rerun_job_manifest(
            request,
            image=self._image,
            namespace=self._namespace,
            gpus=self._gpus,
            service_account=self._service_account,
        )
        namespace = str(manifest["metadata"]["namespace"])
        extra = {"job": request.job_id, "node": request.node}
        name = self._finished_attempt(namespace, request)
        if name is not None:
            log.info("reusing the finished rerun job %s", name, extra=extra)
            target = f"job/{namespace}/{name}"
        else:
            name = str(manifest["metadata"]["name"])
            target = f"job/{namespace}/{name}"
            log.info("starting rerun job %s", name, extra=extra)
            call(
                "create",
                target,
                # The client serialises a plain manifest dict exactly like a V1Job model.
                lambda: self._batch.create_namespaced_job(namespace, cast(k8s.V1Job, manifest)),
            )
            self._wait(name, namespace, target)
        pods = call(
            "list-pods",
            target,
            lambda: self._core.list_namespaced_pod(
                namespace, label_selector=f"batch.kubernetes.io/job-name={name}"
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
            f"pod/{namespace}/{pod}",
            lambda: self._core.read_namespaced_pod_log(pod, namespace),
        )
        steps, probe = parse_rerun_log(str(text))
        kept = tuple(s for s in steps if s.step >= request.start)
        return RerunResult(request.node, kept, probe, log_path=f"{namespace}/{pod}")

    def _finished_attempt(self, namespace: str, request: RerunRequest) -> str | None:
        """A succeeded Job of an earlier attempt at this very rerun, if one is left."""
        jobs = call(
            "list",
            f"jobs/{namespace}",
            lambda: self._batch.list_namespaced_job(
                namespace, label_selector=f"{REPLAY_KEY_LABEL}={rerun_key(request)}"
            ),
        )
        for job in jobs.items:
            if job.status is not None and (job.status.succeeded or 0) > 0 and job.metadata:
                return str(job.metadata.name)
        return None

    def _wait(self, name: str, namespace: str, target: str) -> None:
        deadline = self._clock() + self._timeout_s
        while True:
            job = call(
                "read",
                target,
                lambda: self._batch.read_namespaced_job_status(name, namespace),
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
