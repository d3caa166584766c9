"""Training-job control: stop a job, resume it from a verified checkpoint, ask its status.

Every operation is idempotent, because a retried or re-run incident flow calls it again:

- ``stop`` of a stopped job answers ``already-stopped`` and of a finished one ``not-running``;
  it never fails for being late;
- ``resume`` of a job already running from *that* checkpoint answers ``already-resumed`` and
  starts nothing; a job running from anything else is refused (stop it first) rather than
  silently left on the wrong weights.

Backends:

- :class:`PyTorchJobControl` — a Kubeflow ``PyTorchJob`` (training-operator v1.7+ for
  ``spec.runPolicy.suspend``): the checkpoint goes straight into every replica's container env
  (``SDCGUARD_RESUME_FROM``), since a custom resource's spec is mutable;
- :class:`BatchJobControl` — a ``batch/v1`` Job. Its pod template is immutable except for the
  scheduling directives (labels, annotations, nodeSelector, affinity, tolerations,
  schedulingGates), and those only while the Job is suspended and ``status.startTime`` is
  unset (KEP-2926). So the checkpoint travels as the pod-template annotation
  ``sdcguard.io/resume-from``, which the container reads through the downward API
  (:data:`RESUME_ENV_FROM_ANNOTATION` must be in the Job's manifest), and ``startTime`` is
  cleared through the status subresource before the template changes — as Kueue and JobSet do;
- :class:`LocalJobControl` — local ``sdcguard train`` process groups.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import fcntl
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from kubernetes import client as k8s

from recovery import kube
from recovery.errors import NotFoundError, PermanentError, TemporaryError

__all__ = [
    "ANNOTATION_RESUME_FROM",
    "ANNOTATION_RESUME_NODES",
    "ANNOTATION_RESUME_STEP",
    "RESUME_ENV",
    "RESUME_ENV_FROM_ANNOTATION",
    "BatchJobControl",
    "JobControl",
    "JobKind",
    "JobRef",
    "JobStatus",
    "LocalJobControl",
    "PyTorchJobControl",
    "ResumeOutcome",
    "ResumeResult",
    "StopOutcome",
    "StopResult",
    "resume_args",
]

log = logging.getLogger(__name__)

RESUME_ENV = "SDCGUARD_RESUME_FROM"
ANNOTATION_RESUME_FROM = "sdcguard.io/resume-from"
ANNOTATION_RESUME_STEP = "sdcguard.io/resume-step"
ANNOTATION_RESUME_NODES = "sdcguard.io/resume-nodes"
HOSTNAME_LABEL = "kubernetes.io/hostname"

RESUME_ENV_FROM_ANNOTATION: Mapping[str, Any] = {
    "name": RESUME_ENV,
    "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{ANNOTATION_RESUME_FROM}']"}},
}
"""The env entry a batch/v1 Job's training container must declare so that a resume reaches it."""

_MERGE_PATCH = "application/merge-patch+json"


class JobKind(StrEnum):
    PYTORCHJOB = "PyTorchJob"
    BATCH_JOB = "Job"
    LOCAL = "local"


class JobStatus(StrEnum):
    RUNNING = "running"
    SUSPENDED = "suspended"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"


class StopOutcome(StrEnum):
    STOPPED = "stopped"
    ALREADY_STOPPED = "already-stopped"
    NOT_RUNNING = "not-running"
    """The job had finished (succeeded or failed) on its own; nothing was stopped."""


class ResumeOutcome(StrEnum):
    RESUMED = "resumed"
    ALREADY_RESUMED = "already-resumed"


@dataclass(frozen=True)
class JobRef:
    """A training job. ``kind`` None means "whatever the backend controls"; a backend refuses
    a ref of another kind instead of touching a same-named object of the wrong type."""

    name: str
    namespace: str = "default"
    kind: JobKind | None = None

    def __str__(self) -> str:
        return self.name if self.kind is JobKind.LOCAL else f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class StopResult:
    job: JobRef
    outcome: StopOutcome
    detail: str = ""


@dataclass(frozen=True)
class ResumeResult:
    job: JobRef
    outcome: ResumeOutcome
    checkpoint_uri: str
    step: int
    nodes: tuple[str, ...] | None
    pid: int | None = None


@runtime_checkable
class JobControl(Protocol):
    """Stop, resume and observe one kind of training job (see the module docstring)."""

    def stop(self, job: JobRef) -> StopResult: ...

    def resume(
        self, job: JobRef, checkpoint_uri: str, step: int, nodes: list[str] | None
    ) -> ResumeResult: ...

    def status(self, job: JobRef) -> JobStatus: ...


# -- Kubernetes backends -----------------------------------------------------------------


class _KubeJobControl(abc.ABC):
    """Shared logic of the two Kubernetes backends: read the object as a dict, decide, send a
    JSON merge patch conditioned on the ``resourceVersion`` read, re-decide on 409."""

    _kind: JobKind
    _label: str  # "pytorchjob" / "job", for error targets

    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        conflict_retries: int = 5,
        conflict_backoff_s: float = 0.05,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._api_client = api_client
        self._conflict_retries = conflict_retries
        self._conflict_backoff_s = conflict_backoff_s
        self._sleep = sleep
        self._custom = k8s.CustomObjectsApi(api_client)
        self._batch = k8s.BatchV1Api(api_client)

    # backend specifics
    @abc.abstractmethod
    def _read(self, job: JobRef) -> dict[str, Any]:
        """The job object as a JSON dict, as the API server sent it."""

    @abc.abstractmethod
    def _patch(self, job: JobRef, body: dict[str, Any]) -> None:
        """Send a JSON merge patch to the job."""

    @abc.abstractmethod
    def _suspended(self, obj: Mapping[str, Any]) -> bool:
        """Whether the spec asks for the job to be suspended."""

    @abc.abstractmethod
    def _suspend_patch(self, value: bool) -> dict[str, Any]:
        """The merge patch that sets the suspend flag to ``value``."""

    @abc.abstractmethod
    def _status_of(self, obj: Mapping[str, Any]) -> JobStatus:
        """The job's status, from its conditions first."""

    @abc.abstractmethod
    def _resume_patch(
        self, job: JobRef, obj: Mapping[str, Any], uri: str, step: int, nodes: list[str] | None
    ) -> dict[str, Any]:
        """The merge patch that unsuspends the job with the checkpoint in place."""

    def _before_resume(self, job: JobRef, obj: Mapping[str, Any]) -> bool:
        """Prepare a suspended job for a template change; True if it wrote anything."""
        return False

    # the protocol
    def status(self, job: JobRef) -> JobStatus:
        self._check(job)
        obj = kube.call("status", self._target(job), lambda: self._read(job))
        return self._status_of(obj)

    def stop(self, job: JobRef) -> StopResult:
        self._check(job)

        def attempt() -> StopResult:
            obj = self._read(job)
            state = self._status_of(obj)
            if state in (JobStatus.SUCCEEDED, JobStatus.FAILED):
                return StopResult(job, StopOutcome.NOT_RUNNING, f"job has {state}")
            if self._suspended(obj):
                return StopResult(job, StopOutcome.ALREADY_STOPPED)
            body = _deep_merge(self._suspend_patch(True), _precondition(obj))
            self._patch(job, body)
            return StopResult(job, StopOutcome.STOPPED)

        result = self._retry("stop", job, attempt)
        log.info("stop %s: %s", self._target(job), result.outcome, extra={"job": str(job)})
        return result

    def resume(
        self, job: JobRef, checkpoint_uri: str, step: int, nodes: list[str] | None
    ) -> ResumeResult:
        self._check(job)
        pinned = tuple(dict.fromkeys(nodes)) if nodes is not None else None

        def attempt() -> ResumeResult:
            obj = self._read(job)
            state = self._status_of(obj)
            annotations = (obj.get("metadata") or {}).get("annotations") or {}
            if not self._suspended(obj):
                if annotations.get(ANNOTATION_RESUME_FROM) == checkpoint_uri:
                    return ResumeResult(
                        job, ResumeOutcome.ALREADY_RESUMED, checkpoint_uri, step, pinned
                    )
                raise PermanentError(
                    kube.SYSTEM,
                    "resume",
                    self._target(job),
                    f"job is {state}, not suspended, and not resumed from {checkpoint_uri}: "
                    "stop it first",
                )
            if state in (JobStatus.SUCCEEDED, JobStatus.FAILED):
                raise PermanentError(
                    kube.SYSTEM, "resume", self._target(job), f"job has {state}; it cannot resume"
                )
            if self._before_resume(job, obj):
                obj = self._read(job)
            body = _deep_merge(
                self._resume_patch(job, obj, checkpoint_uri, step, nodes), _precondition(obj)
            )
            self._patch(job, body)
            return ResumeResult(job, ResumeOutcome.RESUMED, checkpoint_uri, step, pinned)

        result = self._retry("resume", job, attempt)
        log.info(
            "resume %s from %s (step %d): %s",
            self._target(job),
            checkpoint_uri,
            step,
            result.outcome,
            extra={"job": str(job), "step": step},
        )
        return result

    # helpers
    def _retry(self, verb: str, job: JobRef, attempt: Callable[[], Any]) -> Any:
        return kube.retry_on_conflict(
            verb,
            self._target(job),
            attempt,
            retries=self._conflict_retries,
            backoff_s=self._conflict_backoff_s,
            sleep=self._sleep,
            extra={"job": str(job)},
        )

    def _check(self, job: JobRef) -> None:
        if job.kind is not None and job.kind is not self._kind:
            raise ValueError(f"{type(self).__name__} controls {self._kind} jobs, not {job.kind}")

    def _target(self, job: JobRef) -> str:
        return f"{self._label}/{job.namespace}/{job.name}"

    def _resume_annotations(
        self, obj: Mapping[str, Any], uri: str, step: int, nodes: list[str] | None
    ) -> dict[str, Any]:
        annotations: dict[str, Any] = {
            ANNOTATION_RESUME_FROM: uri,
            ANNOTATION_RESUME_STEP: str(step),
        }
        had_pin = ANNOTATION_RESUME_NODES in ((obj.get("metadata") or {}).get("annotations") or {})
        if nodes is not None:
            annotations[ANNOTATION_RESUME_NODES] = ",".join(dict.fromkeys(nodes))
        elif had_pin:
            annotations[ANNOTATION_RESUME_NODES] = None
        return annotations


class PyTorchJobControl(_KubeJobControl):
    """:class:`JobControl` for Kubeflow ``PyTorchJob`` (kubeflow.org/v1, ``pytorchjobs``).

    Needs RBAC ``get``/``patch`` on ``pytorchjobs.kubeflow.org``. Stop sets
    ``spec.runPolicy.suspend: true`` (the operator deletes the pods); resume writes the
    checkpoint into every replica container's ``SDCGUARD_RESUME_FROM``, the job annotations and,
    given ``nodes``, a ``kubernetes.io/hostname In nodes`` node-affinity term, then unsuspends.
    """

    _kind = JobKind.PYTORCHJOB
    _label = "pytorchjob"
    GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"

    def _read(self, job: JobRef) -> dict[str, Any]:
        obj = self._custom.get_namespaced_custom_object(
            self.GROUP, self.VERSION, job.namespace, self.PLURAL, job.name
        )
        if not isinstance(obj, dict):
            raise PermanentError(
                kube.SYSTEM, "read", self._target(job), f"unexpected answer {type(obj).__name__}"
            )
        return obj

    def _patch(self, job: JobRef, body: dict[str, Any]) -> None:
        # Custom resources take JSON merge patches (strategic merge is for built-in kinds only).
        self._custom.patch_namespaced_custom_object(
            self.GROUP,
            self.VERSION,
            job.namespace,
            self.PLURAL,
            job.name,
            body,
            _content_type=_MERGE_PATCH,
        )

    def _suspended(self, obj: Mapping[str, Any]) -> bool:
        return bool(((obj.get("spec") or {}).get("runPolicy") or {}).get("suspend"))

    def _suspend_patch(self, value: bool) -> dict[str, Any]:
        return {"spec": {"runPolicy": {"suspend": value}}}

    def _status_of(self, obj: Mapping[str, Any]) -> JobStatus:
        conditions = _true_conditions(obj)
        if "Succeeded" in conditions:
            return JobStatus.SUCCEEDED
        if "Failed" in conditions:
            return JobStatus.FAILED
        if "Suspended" in conditions:
            return JobStatus.SUSPENDED
        if "Running" in conditions or "Restarting" in conditions:
            return JobStatus.RUNNING
        if self._suspended(obj):
            return JobStatus.SUSPENDED
        return JobStatus.UNKNOWN

    def _resume_patch(
        self, job: JobRef, obj: Mapping[str, Any], uri: str, step: int, nodes: list[str] | None
    ) -> dict[str, Any]:
        replica_specs = (obj.get("spec") or {}).get("pytorchReplicaSpecs") or {}
        if not replica_specs:
            raise PermanentError(
                kube.SYSTEM, "resume", self._target(job), "spec.pytorchReplicaSpecs is empty"
            )
        unpin = nodes is None and ANNOTATION_RESUME_NODES in _annotations(obj)
        patched_specs: dict[str, Any] = {}
        for replica_type, replica in replica_specs.items():
            pod_spec = copy.deepcopy(((replica.get("template") or {}).get("spec")) or {})
            # A merge patch replaces lists whole: send each full container list, env updated.
            containers = [_with_env(c, RESUME_ENV, uri) for c in pod_spec.get("containers", [])]
            template_spec: dict[str, Any] = {"containers": containers}
            if nodes is not None or unpin:
                template_spec["affinity"] = _pinned_affinity(pod_spec.get("affinity"), nodes)
            patched_specs[replica_type] = {"template": {"spec": template_spec}}
        return {
            "metadata": {"annotations": self._resume_annotations(obj, uri, step, nodes)},
            "spec": {"runPolicy": {"suspend": False}, "pytorchReplicaSpecs": patched_specs},
        }


class BatchJobControl(_KubeJobControl):
    """:class:`JobControl` for a ``batch/v1`` Job (see the module docstring for why the
    checkpoint reaches the container through a pod-template annotation).

    Needs RBAC ``get``/``patch`` on ``jobs`` and ``patch`` on ``jobs/status``.
    """

    _kind = JobKind.BATCH_JOB
    _label = "job"

    def _read(self, job: JobRef) -> dict[str, Any]:
        raw = self._batch.read_namespaced_job(job.name, job.namespace)
        obj: dict[str, Any] = self._api_client.sanitize_for_serialization(raw)
        return obj

    def _patch(self, job: JobRef, body: dict[str, Any]) -> None:
        self._batch.patch_namespaced_job(job.name, job.namespace, body, _content_type=_MERGE_PATCH)

    def _suspended(self, obj: Mapping[str, Any]) -> bool:
        return bool((obj.get("spec") or {}).get("suspend"))

    def _suspend_patch(self, value: bool) -> dict[str, Any]:
        return {"spec": {"suspend": value}}

    def _status_of(self, obj: Mapping[str, Any]) -> JobStatus:
        conditions = _true_conditions(obj)
        if "Complete" in conditions or "SuccessCriteriaMet" in conditions:
            return JobStatus.SUCCEEDED
        if "Failed" in conditions or "FailureTarget" in conditions:
            return JobStatus.FAILED
        status = obj.get("status") or {}
        if int(status.get("active") or 0) > 0:
            return JobStatus.RUNNING
        if self._suspended(obj) or "Suspended" in conditions:
            return JobStatus.SUSPENDED
        if status.get("startTime"):
            return JobStatus.RUNNING
        return JobStatus.UNKNOWN

    def _before_resume(self, job: JobRef, obj: Mapping[str, Any]) -> bool:
        containers = (((obj.get("spec") or {}).get("template") or {}).get("spec") or {}).get(
            "containers"
        ) or []
        missing = [c.get("name", "?") for c in containers if not _reads_resume_annotation(c)]
        if missing or not containers:
            raise PermanentError(
                kube.SYSTEM,
                "resume",
                self._target(job),
                f"container(s) {', '.join(missing) or '(none)'} do not read {RESUME_ENV} from the "
                f"pod annotation {ANNOTATION_RESUME_FROM}; a Job's env is immutable, so its "
                f"manifest must declare {json.dumps(dict(RESUME_ENV_FROM_ANNOTATION))}",
            )
        if not (obj.get("status") or {}).get("startTime"):
            return False
        # The API server lets the template's scheduling directives change only on a suspended
        # Job without startTime; the job controller sets it again when the Job resumes.
        self._batch.patch_namespaced_job_status(
            job.name,
            job.namespace,
            {"status": {"startTime": None}},
            _content_type=_MERGE_PATCH,
        )
        return True

    def _resume_patch(
        self, job: JobRef, obj: Mapping[str, Any], uri: str, step: int, nodes: list[str] | None
    ) -> dict[str, Any]:
        template = (obj.get("spec") or {}).get("template") or {}
        template_patch: dict[str, Any] = {
            "metadata": {
                "annotations": {ANNOTATION_RESUME_FROM: uri, ANNOTATION_RESUME_STEP: str(step)}
            }
        }
        unpin = nodes is None and ANNOTATION_RESUME_NODES in _annotations(obj)
        if nodes is not None or unpin:
            template_patch["spec"] = {
                "affinity": _pinned_affinity((template.get("spec") or {}).get("affinity"), nodes)
            }
        return {
            "metadata": {"annotations": self._resume_annotations(obj, uri, step, nodes)},
            "spec": {"suspend": False, "template": template_patch},
        }


def _annotations(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return (obj.get("metadata") or {}).get("annotations") or {}


def _true_conditions(obj: Mapping[str, Any]) -> set[str]:
    conditions = (obj.get("status") or {}).get("conditions") or []
    return {str(c.get("type")) for c in conditions if c.get("status") == "True"}


def _precondition(obj: Mapping[str, Any]) -> dict[str, Any]:
    version = (obj.get("metadata") or {}).get("resourceVersion")
    return {"metadata": {"resourceVersion": version}} if version else {}


def _deep_merge(a: dict[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, value in b.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _with_env(container: Mapping[str, Any], name: str, value: str) -> dict[str, Any]:
    updated = copy.deepcopy(dict(container))
    env = [e for e in updated.get("env") or [] if e.get("name") != name]
    env.append({"name": name, "value": value})
    updated["env"] = env
    return updated


def _reads_resume_annotation(container: Mapping[str, Any]) -> bool:
    for entry in container.get("env") or []:
        if entry.get("name") == RESUME_ENV:
            field_path = ((entry.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
            return bool(field_path) and ANNOTATION_RESUME_FROM in str(field_path)
    return False


def _pinned_affinity(affinity: Mapping[str, Any] | None, nodes: list[str] | None) -> dict[str, Any]:
    """``affinity`` with every required node-selector term restricted to ``nodes`` by hostname
    (terms are ORed, expressions ANDed, so each term gets the expression); ``nodes`` None
    removes our hostname pin again. Other parts of the affinity are kept."""
    out = copy.deepcopy(dict(affinity or {}))
    node_affinity = out.setdefault("nodeAffinity", {})
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = [copy.deepcopy(t) for t in required.get("nodeSelectorTerms") or []]
    if nodes is not None and not terms:
        terms = [{}]
    kept_terms = []
    for term in terms:
        expressions = [
            e for e in term.get("matchExpressions") or [] if e.get("key") != HOSTNAME_LABEL
        ]
        if nodes is not None:
            expressions.append(
                {"key": HOSTNAME_LABEL, "operator": "In", "values": list(dict.fromkeys(nodes))}
            )
        if expressions:
            term["matchExpressions"] = expressions
        else:
            term.pop("matchExpressions", None)
        if term:
            kept_terms.append(term)
    if kept_terms:
        node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {
            "nodeSelectorTerms": kept_terms
        }
    else:
        # None deletes the key under a JSON merge patch.
        node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = None
    return out


# -- local backend -----------------------------------------------------------------------

SYSTEM_LOCAL = "local-jobs"
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# The supervisor every local job runs under, as its process-group leader: it runs the real
# command, waits for it, and records the exit status in a file, so any process (the flow, the
# demo, the webhook) can tell "succeeded" from "failed" later — not only the one that started
# it. It survives the SIGTERM that stops the group (a Python handler, which — unlike SIG_IGN —
# is not inherited across exec), so the child's status is still written; only SIGKILL of the
# whole group leaves no record, and stop() records that itself.
_SUPERVISOR = """\
import json, os, signal, subprocess, sys
signal.signal(signal.SIGTERM, lambda *_: None)
signal.signal(signal.SIGINT, lambda *_: None)
exit_path = sys.argv[1]
try:
    returncode = subprocess.Popen(sys.argv[2:]).wait()
except OSError as err:
    print(f"sdcguard: cannot start {sys.argv[2]!r}: {err}", file=sys.stderr, flush=True)
    returncode = 127
with open(exit_path + ".tmp", "w") as handle:
    json.dump({"returncode": returncode}, handle)
os.replace(exit_path + ".tmp", exit_path)
sys.exit(returncode if returncode >= 0 else 128 - returncode)
"""

# Processes this Python process started: polled so that they never linger as zombies, which
# would still count as members of their process group.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
_CHILDREN_LOCK = threading.Lock()


_OUTPUT_OPTIONS = ("--report", "--trace", "--probe")


def resume_args(
    args: Sequence[str],
    checkpoint_uri: str,
    nodes: Sequence[str] | None,
    *,
    output_tag: str | None = None,
) -> list[str]:
    """``args`` without any ``--resume-from``/``--nodes`` (both ``--opt v`` and ``--opt=v``
    forms), plus ``--resume-from <checkpoint_uri>`` and, given ``nodes``, ``--nodes a,b,c``.

    With ``output_tag``, the run's output files (``--report``, ``--trace``, ``--probe``) get the
    tag before their suffix (``report.json`` → ``report.<tag>.json``): a resumed run must never
    overwrite the report and trace of the run it recovers from — they are the incident's
    evidence.
    """
    stripped: list[str] = []
    skip_next = False
    retag = False
    for arg in args:
        if skip_next:
            skip_next = False
            continue
        if retag:
            retag = False
            stripped.append(_tagged(arg, output_tag))
            continue
        if arg in ("--resume-from", "--nodes"):
            skip_next = True
            continue
        if arg.startswith(("--resume-from=", "--nodes=")):
            continue
        if output_tag and arg in _OUTPUT_OPTIONS:
            retag = True
        elif output_tag and arg.startswith(tuple(f"{o}=" for o in _OUTPUT_OPTIONS)):
            option, _, value = arg.partition("=")
            arg = f"{option}={_tagged(value, output_tag)}"
        stripped.append(arg)
    stripped += ["--resume-from", checkpoint_uri]
    if nodes is not None:
        stripped += ["--nodes", ",".join(nodes)]
    return stripped


def _tagged(path: str, tag: str | None) -> str:
    if not tag:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{tag}{p.suffix}"))


class LocalJobControl:
    """:class:`JobControl` for local training runs, one process group per launch.

    State lives in ``<state_dir>/<job_id>.json`` (command, original arguments, every launch
    with pid, process group, start time and how it was stopped), so another process holding a
    ``LocalJobControl`` on the same directory controls the same jobs. Launch, stop and resume of
    one job are serialised by a ``flock`` on ``<job_id>.lock``.
    """

    def __init__(
        self,
        state_dir: Path,
        python: str = sys.executable,
        *,
        command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        stop_timeout_s: float = 10.0,
        kill_timeout_s: float = 5.0,
        poll_interval_s: float = 0.02,
    ) -> None:
        self._dir = Path(state_dir)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._python = python
        self._command = (
            list(command) if command is not None else [python, "-m", "detection.harness"]
        )
        self._env = dict(env or {})
        self._stop_timeout_s = stop_timeout_s
        self._kill_timeout_s = kill_timeout_s
        self._poll_s = poll_interval_s

    # -- launching ---------------------------------------------------------------------

    def launch(self, job_id: str, args: list[str], log_path: Path) -> int:
        """Start ``command + args`` in a new session (its own process group); return the pid
        of the group leader. Idempotent: if the job runs with these very arguments already,
        its pid is returned; with other arguments the call is refused."""
        _check_job_id(job_id)
        with self._job_lock(job_id):
            record = self._load(job_id)
            if record is not None and record["launches"]:
                last = record["launches"][-1]
                if self._alive(last):
                    if last["args"] == list(args):
                        return int(last["pid"])
                    raise PermanentError(
                        SYSTEM_LOCAL,
                        "launch",
                        f"job/{job_id}",
                        f"already running as pid {last['pid']} with other arguments",
                    )
            history = record["launches"] if record is not None else []
            record = {
                "job_id": job_id,
                "command": self._command,
                "original_args": list(args),
                "log_path": str(Path(log_path).resolve()),
                "launches": history,
            }
            launch = self._start(record, list(args), resume=None)
            self._save(job_id, record)
        log.info("launched %s as pid %d", job_id, launch["pid"], extra={"job": job_id})
        return int(launch["pid"])

    # -- the protocol ------------------------------------------------------------------

    def status(self, job: JobRef) -> JobStatus:
        job_id = self._job_id(job)
        record = self._require(job_id, "status")
        return self._launch_status(job_id, record["launches"][-1])

    def stop(self, job: JobRef) -> StopResult:
        """SIGTERM the process group, wait (bounded), SIGKILL what is left, record it."""
        job_id = self._job_id(job)
        with self._job_lock(job_id):
            record = self._require(job_id, "stop")
            launch = record["launches"][-1]
            if not self._alive(launch):
                if launch.get("stopped_at"):
                    return StopResult(job, StopOutcome.ALREADY_STOPPED)
                state = self._launch_status(job_id, launch)
                return StopResult(job, StopOutcome.NOT_RUNNING, f"job has {state}")
            pgid = int(launch["pgid"])
            extra = {"job": job_id}
            log.info("stopping %s: SIGTERM to process group %d", job_id, pgid, extra=extra)
            used = "SIGTERM"
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                state = self._launch_status(job_id, launch)
                return StopResult(job, StopOutcome.NOT_RUNNING, f"job has {state}")
            except PermissionError as err:
                raise PermanentError(
                    SYSTEM_LOCAL, "stop", f"job/{job_id}", f"not allowed to signal group {pgid}"
                ) from err
            if not self._wait_gone(launch, self._stop_timeout_s):
                used = "SIGKILL"
                log.warning(
                    "%s still alive %.1fs after SIGTERM: SIGKILL to group %d",
                    job_id,
                    self._stop_timeout_s,
                    pgid,
                    extra=extra,
                )
                with contextlib.suppress(ProcessLookupError):  # it may end in between: fine
                    os.killpg(pgid, signal.SIGKILL)
                if not self._wait_gone(launch, self._kill_timeout_s):
                    raise TemporaryError(
                        SYSTEM_LOCAL,
                        "stop",
                        f"job/{job_id}",
                        f"process group {pgid} still alive after SIGKILL",
                    )
            launch["stopped_at"] = _utcnow()
            launch["stop_signal"] = used
            self._save(job_id, record)
        log.info("stopped %s (%s)", job_id, used, extra=extra)
        return StopResult(job, StopOutcome.STOPPED, f"process group {pgid} ended by {used}")

    def resume(
        self, job: JobRef, checkpoint_uri: str, step: int, nodes: list[str] | None
    ) -> ResumeResult:
        """Launch again with the original arguments, resumed from ``checkpoint_uri`` (and on
        ``nodes``, one name per rank). A second call while — or after — that very run does
        nothing and says so."""
        job_id = self._job_id(job)
        pinned = tuple(nodes) if nodes is not None else None
        with self._job_lock(job_id):
            record = self._require(job_id, "resume")
            wanted = resume_args(
                record["original_args"], checkpoint_uri, nodes, output_tag=f"resumed-{step}"
            )
            last = record["launches"][-1]
            if self._alive(last):
                if last["args"] == wanted:
                    return ResumeResult(
                        job,
                        ResumeOutcome.ALREADY_RESUMED,
                        checkpoint_uri,
                        step,
                        pinned,
                        last["pid"],
                    )
                raise PermanentError(
                    SYSTEM_LOCAL,
                    "resume",
                    f"job/{job_id}",
                    f"job is running as pid {last['pid']} with other arguments: stop it first",
                )
            if last["args"] == wanted and self._launch_status(job_id, last) is JobStatus.SUCCEEDED:
                return ResumeResult(
                    job, ResumeOutcome.ALREADY_RESUMED, checkpoint_uri, step, pinned, last["pid"]
                )
            launch = self._start(
                record, wanted, resume={"checkpoint_uri": checkpoint_uri, "step": step}
            )
            self._save(job_id, record)
        log.info(
            "resumed %s from %s (step %d) as pid %d",
            job_id,
            checkpoint_uri,
            step,
            launch["pid"],
            extra={"job": job_id, "step": step},
        )
        return ResumeResult(
            job, ResumeOutcome.RESUMED, checkpoint_uri, step, pinned, int(launch["pid"])
        )

    def wait(self, job: JobRef, timeout_s: float) -> JobStatus:
        """Wait until the job's current run ends (or ``timeout_s`` passes); return its status."""
        job_id = self._job_id(job)
        record = self._require(job_id, "wait")
        launch = record["launches"][-1]
        self._wait_gone(launch, timeout_s)
        return self._launch_status(job_id, launch)

    def pid(self, job: JobRef) -> int:
        """The process-group leader of the job's current run."""
        job_id = self._job_id(job)
        return int(self._require(job_id, "pid")["launches"][-1]["pid"])

    # -- internals ---------------------------------------------------------------------

    def _start(
        self, record: dict[str, Any], args: list[str], resume: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        job_id = record["job_id"]
        number = len(record["launches"]) + 1
        exit_path = self._dir / f"{job_id}.{number}.exit"
        with contextlib.suppress(FileNotFoundError):
            exit_path.unlink()  # a stale file from an earlier state directory would lie
        log_path = Path(record["log_path"])
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self._env}
        argv = [self._python, "-c", _SUPERVISOR, str(exit_path), *record["command"], *args]
        with open(log_path, "ab") as log_file:
            try:
                process = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=env,
                )
            except OSError as err:
                raise PermanentError(
                    SYSTEM_LOCAL, "launch", f"job/{job_id}", f"cannot start {argv[0]}: {err}"
                ) from err
        with _CHILDREN_LOCK:
            _CHILDREN[process.pid] = process
        launch = {
            "number": number,
            "args": args,
            "pid": process.pid,
            "pgid": process.pid,  # start_new_session: the leader's pid is the group id
            "start_ticks": _start_ticks(process.pid),
            "started_at": _utcnow(),
            "exit_path": str(exit_path),
            "resume": dict(resume) if resume is not None else None,
            "stopped_at": None,
            "stop_signal": None,
        }
        record["launches"].append(launch)
        return launch

    def _launch_status(self, job_id: str, launch: Mapping[str, Any]) -> JobStatus:
        if self._alive(launch):
            return JobStatus.RUNNING
        returncode = _read_returncode(Path(launch["exit_path"]))
        if returncode == 0:
            return JobStatus.SUCCEEDED
        if launch.get("stopped_at"):
            return JobStatus.SUSPENDED
        if returncode is not None:
            return JobStatus.FAILED
        log.warning(
            "%s: run %s ended without an exit record",
            job_id,
            launch["number"],
            extra={"job": job_id},
        )
        return JobStatus.UNKNOWN

    def _alive(self, launch: Mapping[str, Any]) -> bool:
        _reap_children()
        pgid = int(launch["pgid"])
        ticks = _start_ticks(pgid)
        if ticks is not None and launch.get("start_ticks") not in (None, ticks):
            # The leader's pid now names another process: our group ended long ago.
            return False
        return _group_alive(pgid)

    def _wait_gone(self, launch: Mapping[str, Any], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with _CHILDREN_LOCK:
            child = _CHILDREN.get(int(launch["pid"]))
        if child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=max(0.0, timeout_s))
        while self._alive(launch):
            if time.monotonic() >= deadline:
                return False
            time.sleep(self._poll_s)
        return True

    def _job_id(self, job: JobRef) -> str:
        if job.kind is not None and job.kind is not JobKind.LOCAL:
            raise ValueError(f"LocalJobControl controls local jobs, not {job.kind}")
        _check_job_id(job.name)
        return job.name

    def _require(self, job_id: str, verb: str) -> dict[str, Any]:
        record = self._load(job_id)
        if record is None or not record.get("launches"):
            raise NotFoundError(SYSTEM_LOCAL, verb, f"job/{job_id}", "never launched here")
        return record

    def _load(self, job_id: str) -> dict[str, Any] | None:
        path = self._dir / f"{job_id}.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except ValueError as err:
            raise PermanentError(
                SYSTEM_LOCAL, "read", str(path), f"corrupt job record: {err}"
            ) from err
        if not isinstance(raw, dict):
            raise PermanentError(SYSTEM_LOCAL, "read", str(path), "corrupt job record")
        return raw

    def _save(self, job_id: str, record: Mapping[str, Any]) -> None:
        path = self._dir / f"{job_id}.json"
        fd, tmp = tempfile.mkstemp(prefix=f"{job_id}.", suffix=".tmp", dir=self._dir)
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(record, handle, indent=1)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def _job_lock(self, job_id: str) -> Iterator[None]:
        fd = os.open(self._dir / f"{job_id}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def _check_job_id(job_id: str) -> None:
    if not _JOB_ID.match(job_id):
        raise ValueError(f"job id {job_id!r} must match {_JOB_ID.pattern} (it names files)")


def _utcnow() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _reap_children() -> None:
    with _CHILDREN_LOCK:
        for pid, process in list(_CHILDREN.items()):
            if process.poll() is not None:
                del _CHILDREN[pid]


def _read_returncode(path: Path) -> int | None:
    try:
        return int(json.loads(path.read_text())["returncode"])
    except FileNotFoundError:
        return None


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (state first), or None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rsplit(")", 1)[1].split()


def _start_ticks(pid: int) -> int | None:
    fields = _proc_stat(pid)
    # starttime is field 22 of stat; fields[0] here is field 3 (state).
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def _group_alive(pgid: int) -> bool:
    """True if a live (non-zombie) process is still in process group ``pgid``."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        fields = _proc_stat(int(entry.name))
        # fields: state, ppid, pgrp, …; a zombie has exited and only awaits its parent.
        if (
            fields is not None
            and len(fields) > 2
            and int(fields[2]) == pgid
            and fields[0] not in ("Z", "X")
        ):
            return True
    return False
