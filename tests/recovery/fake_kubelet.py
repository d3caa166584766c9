"""The controllers and kubelet of the fake cluster: jobs get pods, pods run the real command.

:class:`~tests.recovery.fake_kube.FakeKube` serves the API; this module makes the objects do
what they do in a cluster, so a test can run a user's training job end to end:

- a batch/v1 Job that is not suspended gets ``parallelism`` pods (labels
  ``batch.kubernetes.io/job-name`` and ``job-name``); a Kubeflow PyTorchJob gets one pod per
  replica (``training.kubeflow.org/job-name``, ``…/replica-type``, ``…/replica-index``) and the
  operator's rendezvous env (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``);
- each pod is placed on ``spec.nodeName``, else on the ``kubernetes.io/hostname In`` values of
  its node affinity, else on the kubelet's default nodes, rank by rank;
- its first container's ``command`` + ``args`` run as a local process with the container's env,
  downward-API ``fieldRef``\\s resolved (``spec.nodeName``, ``metadata.name``,
  ``metadata.namespace``, ``metadata.annotations['…']``), and ``python`` on ``PATH`` being this
  machine's interpreter (the "image"); its output is the pod log
  (``GET /api/v1/namespaces/{ns}/pods/{pod}/log``);
- a single-pod Job's ``MASTER_PORT`` on ``127.0.0.1`` is moved to a free port: in a cluster
  each pod has its own loopback, here all processes share the machine's;
- suspending a job kills its processes and deletes its pods (as the job controller and the
  training operator do); a process that exits marks its pod ``Succeeded``/``Failed`` and the job
  ``Complete``/``Succeeded`` or ``Failed`` once every pod is done.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.recovery.fake_kube import FakeKube, FakeResponse, RecordedRequest, _condition, _now

JSON = dict[str, Any]

_ANNOTATION_REF = re.compile(r"metadata\.annotations\['([^']+)'\]")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeKubelet:
    """Attach with :meth:`start`; :meth:`stop` kills every process still running."""

    def __init__(
        self,
        fake: FakeKube,
        workdir: Path,
        *,
        default_nodes: Sequence[str] = ("node-0",),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.fake = fake
        self.workdir = workdir
        self.default_nodes = list(default_nodes)
        self.env = dict(env or {})
        self.logs_dir = workdir / "pod-logs"
        self.bin_dir = workdir / "image-bin"
        self._procs: dict[tuple[str, str], subprocess.Popen[bytes]] = {}
        self._killed: set[tuple[str, str]] = set()
        self._threads: list[threading.Thread] = []
        self.launched: list[JSON] = []  # every pod started, in order

    def start(self) -> FakeKubelet:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self.bin_dir.mkdir(parents=True, exist_ok=True)
        wrapper = self.bin_dir / "python"
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        wrapper.chmod(0o755)
        self.fake.watch(self._on_event)
        self.fake.route(
            "GET", r"/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<pod>[^/]+)/log", self._log
        )
        # The exec websocket is not spoken here: refuse at once, as an API server that forbids it.
        self.fake.route(
            "GET", r"/api/v1/namespaces/[^/]+/pods/[^/]+/exec", lambda r, m: FakeResponse(
                403, {"kind": "Status", "code": 403, "reason": "Forbidden",
                      "message": "the fake kubelet serves no exec"})
        )  # fmt: skip
        return self

    def stop(self) -> None:
        for key in list(self._procs):
            self._kill(key)
        for thread in self._threads:
            thread.join(timeout=10)

    def log(self, namespace: str, pod: str) -> str:
        path = self.logs_dir / f"{namespace}_{pod}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- controllers -------------------------------------------------------------------
    def _on_event(self, verb: str, plural: str, old: JSON | None, new: JSON | None) -> None:
        if plural == "pods" and verb == "create" and new is not None:
            # A bare pod (no controller of ours): scheduled and running at once, no process.
            name, ns = new["metadata"]["name"], new["metadata"]["namespace"]
            self.fake.mutate(
                "/api/v1", "pods", name,
                lambda o: o.setdefault("status", {}).update(phase="Running", podIP="127.0.0.1"),
                namespace=ns,
            )  # fmt: skip
        elif plural == "jobs":
            was = old is not None and not old["spec"].get("suspend")
            now = new is not None and not new["spec"].get("suspend")
            obj = new or old
            assert obj is not None
            if now and not was:
                self._launch_batch(new)  # type: ignore[arg-type]
            elif was and not now:
                self._delete_pods(obj, "batch.kubernetes.io/job-name")
        elif plural == "pytorchjobs":

            def running(o: JSON | None) -> bool:
                return o is not None and not (o["spec"].get("runPolicy") or {}).get("suspend")

            obj = new or old
            assert obj is not None
            if running(new) and not running(old):
                self._launch_pytorchjob(new)  # type: ignore[arg-type]
            elif running(old) and not running(new):
                self._delete_pods(obj, "training.kubeflow.org/job-name")

    def _launch_batch(self, job: JSON) -> None:
        name, ns = job["metadata"]["name"], job["metadata"]["namespace"]
        template = job["spec"]["template"]
        for index in range(int(job["spec"].get("parallelism") or 1)):
            labels = {"batch.kubernetes.io/job-name": name, "job-name": name}
            pod = f"{name}-{index}-{os.urandom(2).hex()}"
            node = self._node_for(template, index)
            self._run_pod(ns, pod, node, template, labels, ("jobs", name), {})

    def _launch_pytorchjob(self, job: JSON) -> None:
        name, ns = job["metadata"]["name"], job["metadata"]["namespace"]
        specs = job["spec"]["pytorchReplicaSpecs"]
        order = sorted(specs, key=lambda t: (t != "Master", t))
        world = sum(int(specs[t].get("replicas") or 1) for t in order)
        port = _free_port()
        rank = 0
        for replica_type in order:
            template = specs[replica_type]["template"]
            for index in range(int(specs[replica_type].get("replicas") or 1)):
                pod = f"{name}-{replica_type.lower()}-{index}"
                labels = {
                    "training.kubeflow.org/job-name": name,
                    "training.kubeflow.org/replica-type": replica_type.lower(),
                    "training.kubeflow.org/replica-index": str(index),
                }
                env = {
                    "WORLD_SIZE": str(world),
                    "RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                }
                node = self._node_for(template, rank)
                self._run_pod(ns, pod, node, template, labels, ("pytorchjobs", name), env)
                rank += 1

    def _node_for(self, template: JSON, index: int) -> str:
        spec = template.get("spec") or {}
        if spec.get("nodeName"):
            return str(spec["nodeName"])
        affinity = (spec.get("affinity") or {}).get("nodeAffinity") or {}
        required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
        for term in required.get("nodeSelectorTerms") or []:
            for expr in term.get("matchExpressions") or []:
                if expr.get("key") == "kubernetes.io/hostname" and expr.get("operator") == "In":
                    values = list(expr["values"])
                    return str(values[index % len(values)])
        return self.default_nodes[index % len(self.default_nodes)]

    def _delete_pods(self, job: JSON, label: str) -> None:
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        for pod in self.fake.list_objects("/api/v1", "pods", ns):
            if (pod["metadata"].get("labels") or {}).get(label) == name:
                self._kill((ns, pod["metadata"]["name"]))
                self.fake.delete_object("/api/v1", "pods", pod["metadata"]["name"], ns)

    # -- the kubelet -------------------------------------------------------------------
    def _run_pod(
        self,
        ns: str,
        pod: str,
        node: str,
        template: JSON,
        labels: dict[str, str],
        owner: tuple[str, str],
        operator_env: dict[str, str],
    ) -> None:
        meta = template.get("metadata") or {}
        spec = template.get("spec") or {}
        container = spec["containers"][0]
        obj = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod,
                "namespace": ns,
                "labels": {**(meta.get("labels") or {}), **labels},
                "annotations": dict(meta.get("annotations") or {}),
            },
            "spec": {**spec, "nodeName": node},
            "status": {"phase": "Running", "startTime": _now()},
        }
        self.fake.add_object("/api/v1", "pods", obj)
        self.launched.append(obj)
        env = {
            **os.environ,
            **self.env,
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            **operator_env,
        }
        for entry in container.get("env") or []:
            env[entry["name"]] = self._env_value(entry, obj)
        if env.get("MASTER_ADDR") == "127.0.0.1" and owner[0] == "jobs":
            # A pod has a loopback of its own; processes of this machine share one. A port
            # fixed in the manifest would collide with any other process here, so it is moved.
            env["MASTER_PORT"] = str(_free_port())
        argv = [*(container.get("command") or []), *(container.get("args") or [])]
        log_path = self.logs_dir / f"{ns}_{pod}.log"
        with log_path.open("wb") as out:
            proc = subprocess.Popen(
                argv,
                cwd=self.workdir,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._procs[(ns, pod)] = proc
        thread = threading.Thread(
            target=self._reap, args=(ns, pod, proc, owner), name=f"kubelet-{pod}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    @staticmethod
    def _env_value(entry: JSON, pod: JSON) -> str:
        if "value" in entry:
            return str(entry["value"])
        path = ((entry.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath", "")
        if path == "spec.nodeName":
            return str(pod["spec"]["nodeName"])
        if path == "metadata.name":
            return str(pod["metadata"]["name"])
        if path == "metadata.namespace":
            return str(pod["metadata"]["namespace"])
        match = _ANNOTATION_REF.fullmatch(path)
        if match:
            return str(pod["metadata"]["annotations"].get(match[1], ""))
        raise ValueError(f"the fake kubelet cannot resolve env {entry}")

    def _kill(self, key: tuple[str, str]) -> None:
        proc = self._procs.get(key)
        if proc is None or proc.poll() is not None:
            return
        self._killed.add(key)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def _reap(
        self, ns: str, pod: str, proc: subprocess.Popen[bytes], owner: tuple[str, str]
    ) -> None:
        code = proc.wait()
        if (ns, pod) in self._killed:
            return
        phase = "Succeeded" if code == 0 else "Failed"
        try:
            self.fake.mutate(
                "/api/v1", "pods", pod, lambda o: o["status"].update(phase=phase), namespace=ns
            )
        except KeyError:
            return  # deleted meanwhile
        self._update_owner(ns, owner)

    def _update_owner(self, ns: str, owner: tuple[str, str]) -> None:
        plural, name = owner
        label = (
            "batch.kubernetes.io/job-name" if plural == "jobs" else "training.kubeflow.org/job-name"
        )
        pods = [
            p
            for p in self.fake.list_objects("/api/v1", "pods", ns)
            if (p["metadata"].get("labels") or {}).get(label) == name
        ]
        phases = [p["status"]["phase"] for p in pods]
        prefix = "/apis/batch/v1" if plural == "jobs" else "/apis/kubeflow.org/v1"

        def update(obj: JSON) -> None:
            status = obj.setdefault("status", {})
            conditions = status.setdefault("conditions", [])
            if plural == "jobs":
                status["succeeded"] = phases.count("Succeeded")
                status["failed"] = phases.count("Failed")
                status["active"] = phases.count("Running")
                if status["failed"]:
                    conditions.append(_condition("Failed", "True", "BackoffLimitExceeded"))
                elif not status["active"]:
                    conditions.append(_condition("Complete", "True", "Completed"))
            elif "Failed" in phases:
                conditions.append(_condition("Failed", "True", "PyTorchJobFailed"))
            elif all(p == "Succeeded" for p in phases):
                conditions.append(_condition("Succeeded", "True", "PyTorchJobSucceeded"))

        try:
            self.fake.mutate(prefix, plural, name, update, namespace=ns)
        except KeyError:
            return

    def _log(self, request: RecordedRequest, match: re.Match[str]) -> FakeResponse:
        if self.fake.pod(match["pod"], match["ns"]) is None:
            return FakeResponse(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
        return FakeResponse(
            200, self.log(match["ns"], match["pod"]), {"Content-Type": "text/plain"}
        )
