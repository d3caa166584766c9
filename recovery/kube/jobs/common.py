"""The shared half of the Kubernetes job-control backends, and the merge-patch helpers they use.

A backend reads the job object as a dict, decides, and sends a JSON merge patch conditioned on
the ``resourceVersion`` it read; on 409 it reads and decides again. So a concurrent writer is
never overwritten with a decision taken on a stale object.
"""

from __future__ import annotations

import abc
import copy
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client as k8s

from recovery.errors import PermanentError, TemporaryError
from recovery.jobs import (
    ANNOTATION_RESUME_FROM,
    ANNOTATION_RESUME_NODES,
    ANNOTATION_RESUME_STEP,
    JobKind,
    JobRef,
    JobStatus,
    ResumeOutcome,
    ResumeResult,
    StopOutcome,
    StopResult,
)
from recovery.kube import client as kube

log = logging.getLogger(__name__)

HOSTNAME_LABEL = "kubernetes.io/hostname"
MERGE_PATCH = "application/merge-patch+json"


class KubeJobControl(abc.ABC):
    """Shared logic of the two Kubernetes backends: read the object as a dict, decide, send a
    JSON merge patch conditioned on the ``resourceVersion`` read, re-decide on 409."""

    _kind: JobKind
    _label: str  # "pytorchjob" / "job", for error targets
    _pod_label: str  # the label its controller puts on the job's pods, value: the job's name

    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        conflict_retries: int = 5,
        conflict_backoff_s: float = 0.05,
        sleep: Callable[[float], None] = time.sleep,
        stop_timeout_s: float = 300.0,
        stop_poll_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api_client = api_client
        self._stop_timeout_s = stop_timeout_s
        self._stop_poll_s = stop_poll_s
        self._clock = clock
        self._core = k8s.CoreV1Api(api_client)
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
            body = deep_merge(self._suspend_patch(True), precondition(obj))
            self._patch(job, body)
            return StopResult(job, StopOutcome.STOPPED)

        result: StopResult = self._retry("stop", job, attempt)
        if result.outcome is not StopOutcome.NOT_RUNNING:
            self._wait_pods_gone(job)
        log.info("stop %s: %s", self._target(job), result.outcome, extra={"job": str(job)})
        return result

    def live_pods(self, job: JobRef) -> list[str]:
        """Names of the job's pods that may still compute: not finished, or being deleted."""
        pods = kube.call(
            "list-pods",
            self._target(job),
            lambda: self._core.list_namespaced_pod(
                job.namespace, label_selector=f"{self._pod_label}={job.name}"
            ),
        )
        live = []
        for pod in pods.items:
            phase = pod.status.phase if pod.status is not None else None
            meta = pod.metadata
            if meta is None:
                continue
            if phase not in ("Succeeded", "Failed") or meta.deletion_timestamp:
                live.append(str(meta.name))
        return live

    def _wait_pods_gone(self, job: JobRef) -> None:
        """A stop is done when no pod of the job can still write: the controller deletes them
        after the suspend, and until it has, the corrupting computation may go on."""
        deadline = self._clock() + self._stop_timeout_s
        while True:
            live = self.live_pods(job)
            if not live:
                return
            if self._clock() >= deadline:
                raise TemporaryError(
                    kube.SYSTEM,
                    "stop",
                    self._target(job),
                    f"suspended, but pod(s) {', '.join(sorted(live))} still exist after "
                    f"{self._stop_timeout_s:g} s",
                )
            self._sleep(self._stop_poll_s)

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
            body = deep_merge(
                self._resume_patch(job, obj, checkpoint_uri, step, nodes), precondition(obj)
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


def annotations_of(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """The object's annotations; empty, never None, when it has none."""
    return (obj.get("metadata") or {}).get("annotations") or {}


def true_conditions(obj: Mapping[str, Any]) -> set[str]:
    """The types of the object's status conditions that are ``True``."""
    conditions = (obj.get("status") or {}).get("conditions") or []
    return {str(c.get("type")) for c in conditions if c.get("status") == "True"}


def precondition(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The merge-patch part that makes the API server refuse (409) a write to a changed object."""
    version = (obj.get("metadata") or {}).get("resourceVersion")
    return {"metadata": {"resourceVersion": version}} if version else {}


def deep_merge(a: dict[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """``a`` with ``b`` merged in, recursively for dicts; ``a`` itself is left unchanged."""
    out = dict(a)
    for key, value in b.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def with_env(container: Mapping[str, Any], name: str, value: str) -> dict[str, Any]:
    """A copy of ``container`` whose env sets ``name`` to ``value``, once."""
    updated = copy.deepcopy(dict(container))
    env = [e for e in updated.get("env") or [] if e.get("name") != name]
    env.append({"name": name, "value": value})
    updated["env"] = env
    return updated


def pinned_affinity(affinity: Mapping[str, Any] | None, nodes: list[str] | None) -> dict[str, Any]:
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
