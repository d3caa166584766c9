"""An HTTP-level fake of the Kubernetes API server, for tests of the Kubernetes adapters.

No real kube-apiserver (nor kind, k3s or envtest) can be installed on the machines these tests
run on, so this module stands in for one. It speaks the wire protocol — real paths, real object
shapes with ``apiVersion``/``kind``/``metadata.resourceVersion``, real ``Status`` error bodies,
the patch content types — so the *official* ``kubernetes`` Python client is exercised for real:
its serialisation, content-type choice, error classes and connection handling all run, and only
the server side is simplified. Nothing of ours is monkeypatched.

What it serves (``ThreadingHTTPServer`` on 127.0.0.1, a free port):

- generic resources: GET item, GET list (``fieldSelector``: ``=``/``==``/``!=`` on dotted
  paths such as ``spec.nodeName``; ``labelSelector``: ``=``, ``!=``, ``in``, ``notin``,
  exists, ``!``), watch (the matching objects as ``ADDED`` events, then the stream ends, as at
  a ``timeoutSeconds``), POST create, PUT replace, PATCH, DELETE, and the ``status`` subresource —
  for nodes, pods, batch/v1 jobs and kubeflow.org/v1 pytorchjobs (``register`` adds more);
- PATCH content types: ``application/merge-patch+json`` (RFC 7386),
  ``application/strategic-merge-patch+json`` (built-in kinds only; custom resources answer 415
  as a real server does) and ``application/json-patch+json`` (RFC 6902 add/remove/replace/test).
  The strategic merge knows the merge keys of containers, env, volumes, volumeMounts, ports and
  conditions; every other list is replaced whole (true of node taints, which have no merge key);
- a ``metadata.resourceVersion`` in a PATCH/PUT body is a precondition: a stale one is a 409
  ``Conflict`` exactly like the real server's optimistic concurrency;
- ``POST /apis/authentication.k8s.io/v1/tokenreviews``: a token added with
  :meth:`FakeKube.add_token` is authenticated as its user, for its audiences (a review asking
  for another audience is refused, as the real server does); any other token is not;
- ``GET /api/v1/namespaces/{ns}/pods/{name}/exec`` as a websocket (``v4.channel.k8s.io``,
  :mod:`tests.recovery.fake_exec`), running the command :meth:`FakeKube.on_exec` gives;
- ``POST /api/v1/namespaces/{ns}/pods/{name}/eviction``: a pod under a disruption budget
  (:meth:`FakeKube.block_eviction`) is refused with 429 ``TooManyRequests`` (cause
  ``DisruptionBudget``) as many times as configured; an allowed eviction removes the pod and
  answers 201 with a ``Success`` Status;
- batch/v1 Job rules the adapters must respect: the pod template is immutable except for the
  scheduling directives (labels, annotations, nodeSelector, affinity, tolerations,
  schedulingGates) while the Job is suspended and has no ``status.startTime`` — 422 ``Invalid``
  otherwise; the job controller's reaction to ``spec.suspend`` (``Suspended`` condition,
  ``status.active``, ``startTime`` set again on resume) and the training operator's reaction to
  a PyTorchJob's ``spec.runPolicy.suspend`` happen at once, synchronously with the write.

Test controls: :meth:`FakeKube.fail_next` (answer the next matching requests with an error
``Status``), :attr:`FakeKube.requests` (what the client sent), seeders (``add_node``,
``add_pod``, ``add_job``, ``add_pytorchjob``, ``add_object``), readers (``node``, ``pod``,
``job``, ``pytorchjob``, ``get_object``), :meth:`FakeKube.mutate` and :meth:`FakeKube.route`
for custom handlers.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from tests.recovery.fake_exec import ExecHandler, serve_exec

__all__ = ["FakeKube", "FakeResponse", "RecordedRequest", "status_body"]

JSON = dict[str, Any]

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"

_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}

# Strategic-merge keys of the lists the adapters and tests touch (from the Kubernetes API's
# patchMergeKey tags); any other list is atomic and replaced whole.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "conditions": "type",
    "imagePullSecrets": "name",
}

# Pod-template fields of a suspended, not-started Job that may change (KEP-2926).
_JOB_MUTABLE_TEMPLATE_META = ("labels", "annotations")
_JOB_MUTABLE_TEMPLATE_SPEC = ("nodeSelector", "affinity", "tolerations", "schedulingGates")


def status_body(
    code: int, message: str, *, reason: str | None = None, details: JSON | None = None
) -> JSON:
    """A Kubernetes ``Status`` object (``kind: Status``) as the API server sends for errors."""
    body: JSON = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 400 else "Failure",
        "message": message,
        "reason": reason if reason is not None else _REASONS.get(code, ""),
        "code": code,
    }
    if details is not None:
        body["details"] = details
    return body


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the server received it (body parsed as JSON when it is JSON)."""

    method: str
    path: str
    query: Mapping[str, list[str]]
    content_type: str | None
    body: Any
    headers: Mapping[str, str]  # names lower-cased


@dataclass
class FakeResponse:
    """What a custom :meth:`FakeKube.route` handler answers."""

    status: int
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)


class _ApiError(Exception):
    def __init__(
        self, code: int, message: str, *, reason: str | None = None, details: JSON | None = None
    ) -> None:
        super().__init__(message)
        self.body = status_body(code, message, reason=reason, details=details)
        self.code = code


@dataclass(frozen=True)
class _Resource:
    prefix: str  # "/api/v1" or "/apis/<group>/<version>"
    plural: str
    kind: str
    namespaced: bool
    custom: bool

    @property
    def api_version(self) -> str:
        return "v1" if self.prefix == "/api/v1" else self.prefix.removeprefix("/apis/")

    @property
    def group(self) -> str:
        return "" if self.prefix == "/api/v1" else self.api_version.split("/")[0]

    def qualified(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural


@dataclass
class _Fault:
    method: str
    pattern: re.Pattern[str]
    status: int
    remaining: int | None
    message: str | None
    reason: str | None


@dataclass
class _Route:
    method: str
    pattern: re.Pattern[str]
    handler: Callable[[RecordedRequest, re.Match[str]], FakeResponse]


_PATH = re.compile(
    r"^(?P<prefix>/api/v1|/apis/[^/]+/[^/]+)"
    r"(?:/namespaces/(?P<namespace>[^/]+))?"
    r"/(?P<plural>[^/]+)(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$"
)


class FakeKube:
    """The fake API server; start with :meth:`start` (or use as a context manager)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._objects: dict[tuple[str, str, str], JSON] = {}  # (resource key, namespace, name)
        self._resources: dict[tuple[str, str], _Resource] = {}
        self._versions = itertools.count(1)
        self._faults: list[_Fault] = []
        self._routes: list[_Route] = []
        self._eviction_blocks: dict[tuple[str, str], tuple[int | None, str]] = {}
        self._requests: list[RecordedRequest] = []
        self._tokens: dict[str, tuple[str, tuple[str, ...]]] = {}
        self._watchers: list[Callable[[str, str, JSON | None, JSON | None], None]] = []
        self._exec: ExecHandler | None = None
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.register("/api/v1", "nodes", "Node", namespaced=False)
        self.register("/api/v1", "pods", "Pod")
        self.register("/apis/batch/v1", "jobs", "Job")
        self.register("/apis/kubeflow.org/v1", "pytorchjobs", "PyTorchJob", custom=True)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> FakeKube:
        handler = type("_BoundHandler", (_Handler,), {"fake": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},  # shutdown() waits up to one poll interval
            name="fake-kube",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FakeKube:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("fake Kubernetes API is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    # -- test controls -----------------------------------------------------------------

    def register(
        self, prefix: str, plural: str, kind: str, *, namespaced: bool = True, custom: bool = False
    ) -> None:
        """Serve another resource type (``custom``: a CRD, which refuses strategic merge)."""
        self._resources[(prefix, plural)] = _Resource(prefix, plural, kind, namespaced, custom)

    def add_token(
        self, token: str, username: str, audiences: Iterable[str] = ("sdcguard",)
    ) -> None:
        """Make TokenReview authenticate ``token`` as ``username`` for ``audiences``."""
        with self._lock:
            self._tokens[token] = (username, tuple(audiences))

    def _token_review(self, body: Any) -> FakeResponse:
        spec = body.get("spec") if isinstance(body, dict) else None
        if not isinstance(spec, dict) or not isinstance(spec.get("token"), str):
            raise _ApiError(422, "TokenReview.authentication.k8s.io is invalid: spec.token")
        wanted = spec.get("audiences") or []
        known = self._tokens.get(spec["token"])
        status: JSON = {"authenticated": False, "error": "invalid bearer token"}
        if known is not None:
            username, audiences = known
            if not wanted or set(wanted) & set(audiences):
                status = {
                    "authenticated": True,
                    "user": {"username": username, "groups": ["system:serviceaccounts"]},
                    "audiences": [a for a in audiences if not wanted or a in wanted],
                }
            else:
                status = {"authenticated": False, "error": "token audiences are invalid"}
        answer = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "metadata": {"creationTimestamp": None},
            "spec": {"token": spec["token"], "audiences": wanted},
            "status": status,
        }
        return FakeResponse(201, answer)

    def fail_next(
        self,
        method: str,
        path_regex: str,
        status: int,
        times: int | None = 1,
        *,
        message: str | None = None,
        reason: str | None = None,
    ) -> None:
        """Answer the next ``times`` requests whose method and path match (``re.search``) with
        an error ``Status`` of code ``status`` (``times=None``: every such request)."""
        with self._lock:
            self._faults.append(
                _Fault(method.upper(), re.compile(path_regex), status, times, message, reason)
            )

    def block_eviction(
        self,
        namespace: str,
        pod: str,
        times: int | None = None,
        *,
        budget: str = "training-pdb",
    ) -> None:
        """Refuse evictions of ``namespace/pod`` with the disruption-budget 429 ``times`` times
        (None: always), as a PodDisruptionBudget with no disruptions allowed does."""
        message = f"The disruption budget {budget} needs 1 healthy pods and has 1 currently"
        with self._lock:
            self._eviction_blocks[(namespace, pod)] = (times, message)

    def route(
        self,
        method: str,
        path_regex: str,
        handler: Callable[[RecordedRequest, re.Match[str]], FakeResponse],
    ) -> None:
        """Serve ``method`` on paths matching ``path_regex`` (``re.fullmatch``) with ``handler``
        before the built-in routes: for endpoints this fake does not model (exec, logs, …)."""
        with self._lock:
            self._routes.append(_Route(method.upper(), re.compile(path_regex), handler))

    def on_exec(self, run: ExecHandler) -> None:
        """Run exec requests with ``run(namespace, pod, command) -> ExecResult``: what the
        fake container prints for a command (see :mod:`tests.recovery.fake_exec`)."""
        with self._lock:
            self._exec = run

    def watch(self, fn: Callable[[str, str, JSON | None, JSON | None], None]) -> None:
        """Call ``fn(verb, plural, old, new)`` after every create/update/delete through the API
        (verb ``create``/``update``/``delete``), under the server lock: a controller's reaction
        (see ``tests/recovery/fake_kubelet.py``) happens before the client hears the answer."""
        with self._lock:
            self._watchers.append(fn)

    def _notify(self, verb: str, plural: str, old: JSON | None, new: JSON | None) -> None:
        for fn in list(self._watchers):
            fn(verb, plural, copy.deepcopy(old), copy.deepcopy(new))

    def delete_object(self, prefix: str, plural: str, name: str, namespace: str = "") -> None:
        """Remove a stored object as a controller would (no watcher is told)."""
        resource = self._resource(prefix, plural)
        with self._lock:
            self._objects.pop((self._key(resource), namespace, name), None)

    def list_objects(self, prefix: str, plural: str, namespace: str = "") -> list[JSON]:
        resource = self._resource(prefix, plural)
        with self._lock:
            return [
                copy.deepcopy(o)
                for (key, ns, _), o in sorted(self._objects.items())
                if key == self._key(resource) and (not namespace or ns == namespace)
            ]

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    def requests_to(self, method: str, path_regex: str) -> list[RecordedRequest]:
        """The recorded requests with this method whose path matches ``path_regex``."""
        pattern = re.compile(path_regex)
        return [r for r in self.requests if r.method == method.upper() and pattern.search(r.path)]

    def clear_requests(self) -> None:
        with self._lock:
            self._requests.clear()

    # -- seeding and reading -----------------------------------------------------------

    def add_object(self, prefix: str, plural: str, obj: JSON) -> JSON:
        """Store ``obj`` as is (metadata filled in); returns a copy of the stored object."""
        resource = self._resource(prefix, plural)
        with self._lock:
            stored = self._create(resource, obj.get("metadata", {}).get("namespace", ""), obj)
            return copy.deepcopy(stored)

    def add_node(
        self,
        name: str,
        *,
        instance_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        taints: Iterable[Mapping[str, str]] = (),
        unschedulable: bool = False,
        ready: bool = True,
        provider_id: str | None = None,
    ) -> JSON:
        spec: JSON = {"taints": [dict(t) for t in taints]} if taints else {}
        if unschedulable:
            spec["unschedulable"] = True
        if provider_id is None and instance_id is not None:
            provider_id = f"aws:///us-west-2a/{instance_id}"
        if provider_id is not None:
            spec["providerID"] = provider_id
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {"kubernetes.io/hostname": name, **dict(labels or {})},
                "annotations": dict(annotations or {}),
            },
            "spec": spec,
            "status": {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True" if ready else "False",
                        "reason": "KubeletReady" if ready else "KubeletNotReady",
                        "lastTransitionTime": _now(),
                    }
                ]
            },
        }
        return self.add_object("/api/v1", "nodes", node)

    def add_pod(
        self,
        name: str,
        *,
        namespace: str = "default",
        node: str | None = None,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        owner_kind: str | None = None,
        owner_name: str | None = None,
        phase: str = "Running",
    ) -> JSON:
        metadata: JSON = {
            "name": name,
            "namespace": namespace,
            "labels": dict(labels or {}),
            "annotations": dict(annotations or {}),
        }
        if owner_kind is not None:
            metadata["ownerReferences"] = [
                {
                    "apiVersion": "apps/v1" if owner_kind != "Job" else "batch/v1",
                    "kind": owner_kind,
                    "name": owner_name or f"{name}-owner",
                    "uid": str(uuid.uuid4()),
                    "controller": True,
                }
            ]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": metadata,
            "spec": {
                "nodeName": node,
                "containers": [{"name": "main", "image": "registry.example/train:1"}],
            },
            "status": {"phase": phase},
        }
        return self.add_object("/api/v1", "pods", pod)

    def add_job(
        self,
        name: str,
        *,
        namespace: str = "default",
        containers: list[JSON] | None = None,
        suspend: bool = False,
        parallelism: int = 1,
        started: bool | None = None,
        annotations: Mapping[str, str] | None = None,
        template_annotations: Mapping[str, str] | None = None,
        conditions: list[JSON] | None = None,
    ) -> JSON:
        """A batch/v1 Job; ``started`` (default: not suspended) sets ``status.startTime``."""
        started = (not suspend) if started is None else started
        status: JSON = {"active": 0 if suspend else parallelism}
        if started:
            status["startTime"] = _now()
        if suspend:
            status["conditions"] = [_condition("Suspended", "True", "JobSuspended")]
        if conditions is not None:
            status["conditions"] = conditions
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "annotations": dict(annotations or {}),
            },
            "spec": {
                "suspend": suspend,
                "parallelism": parallelism,
                "completions": parallelism,
                "template": {
                    "metadata": {
                        "labels": {"batch.kubernetes.io/job-name": name},
                        "annotations": dict(template_annotations or {}),
                    },
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": containers
                        or [{"name": "trainer", "image": "registry.example/train:1"}],
                    },
                },
            },
            "status": status,
        }
        return self.add_object("/apis/batch/v1", "jobs", job)

    def add_pytorchjob(
        self,
        name: str,
        *,
        namespace: str = "default",
        replicas: Mapping[str, int] | None = None,
        containers: list[JSON] | None = None,
        suspend: bool = False,
        conditions: list[JSON] | None = None,
    ) -> JSON:
        """A kubeflow.org/v1 PyTorchJob with one pod template per replica type."""
        specs = {}
        for replica_type, count in (replicas or {"Master": 1, "Worker": 2}).items():
            specs[replica_type] = {
                "replicas": count,
                "restartPolicy": "OnFailure",
                "template": {
                    "spec": {
                        "containers": copy.deepcopy(containers or [])
                        or [{"name": "pytorch", "image": "registry.example/train:1"}]
                    }
                },
            }
        if conditions is None:
            conditions = [_condition("Created", "True", "PyTorchJobCreated")]
            conditions.append(
                _condition("Suspended", "True", "PyTorchJobSuspended")
                if suspend
                else _condition("Running", "True", "PyTorchJobRunning")
            )
        job = {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"runPolicy": {"suspend": suspend}, "pytorchReplicaSpecs": specs},
            "status": {"conditions": conditions},
        }
        return self.add_object("/apis/kubeflow.org/v1", "pytorchjobs", job)

    def get_object(self, prefix: str, plural: str, name: str, namespace: str = "") -> JSON | None:
        resource = self._resource(prefix, plural)
        with self._lock:
            obj = self._objects.get((self._key(resource), namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def node(self, name: str) -> JSON:
        obj = self.get_object("/api/v1", "nodes", name)
        if obj is None:
            raise KeyError(f"no node {name}")
        return obj

    def pod(self, name: str, namespace: str = "default") -> JSON | None:
        return self.get_object("/api/v1", "pods", name, namespace)

    def job(self, name: str, namespace: str = "default") -> JSON:
        obj = self.get_object("/apis/batch/v1", "jobs", name, namespace)
        if obj is None:
            raise KeyError(f"no job {namespace}/{name}")
        return obj

    def pytorchjob(self, name: str, namespace: str = "default") -> JSON:
        obj = self.get_object("/apis/kubeflow.org/v1", "pytorchjobs", name, namespace)
        if obj is None:
            raise KeyError(f"no pytorchjob {namespace}/{name}")
        return obj

    def mutate(
        self, prefix: str, plural: str, name: str, fn: Callable[[JSON], None], namespace: str = ""
    ) -> JSON:
        """Change a stored object in place as a controller would (bumps resourceVersion)."""
        resource = self._resource(prefix, plural)
        with self._lock:
            obj = self._objects[(self._key(resource), namespace, name)]
            fn(obj)
            obj["metadata"]["resourceVersion"] = str(next(self._versions))
            return copy.deepcopy(obj)

    def serve(self, request: RecordedRequest) -> FakeResponse:
        """The built-in answer to ``request`` (no injected faults, no custom routes): lets a
        :meth:`route` handler wrap the default behaviour, e.g. to race a concurrent writer."""
        with self._lock:
            try:
                return self._dispatch(request)
            except _ApiError as err:
                return FakeResponse(err.code, err.body)

    # -- request handling (called from the server threads) ------------------------------

    def _handle(self, request: RecordedRequest) -> FakeResponse:
        with self._lock:
            self._requests.append(request)
            for fault in self._faults:
                if fault.method == request.method and fault.pattern.search(request.path):
                    if fault.remaining is not None:
                        fault.remaining -= 1
                        if fault.remaining <= 0:
                            self._faults.remove(fault)
                    message = fault.message or _default_message(fault.status, request)
                    return FakeResponse(
                        fault.status, status_body(fault.status, message, reason=fault.reason)
                    )
            for route in self._routes:
                if route.method == request.method:
                    match = route.pattern.fullmatch(request.path)
                    if match:
                        return route.handler(request, match)
            return self.serve(request)

    def _dispatch(self, request: RecordedRequest) -> FakeResponse:
        if request.path == "/apis/authentication.k8s.io/v1/tokenreviews":
            if request.method != "POST":
                raise _ApiError(405, f"method {request.method} not allowed on tokenreviews")
            return self._token_review(request.body)
        match = _PATH.match(request.path)
        resource = None
        if match:
            resource = self._resources.get((match["prefix"], match["plural"]))
        if match is None or resource is None:
            raise _ApiError(
                404, f"the server could not find the requested resource ({request.path})"
            )
        namespace = unquote(match["namespace"] or "")
        name = unquote(match["name"]) if match["name"] else None
        sub = match["sub"]
        if resource.namespaced and name is not None and not namespace:
            raise _ApiError(
                404, f"the server could not find the requested resource ({request.path})"
            )
        method = request.method
        if name is None:
            if method == "GET":
                listed = self._list(resource, namespace, request.query)
                if (request.query.get("watch") or [""])[0].lower() in ("true", "1"):
                    return _watch_answer(listed)
                return FakeResponse(200, listed)
            if method == "POST":
                created = copy.deepcopy(self._create(resource, namespace, request.body))
                self._notify("create", resource.plural, None, created)
                return FakeResponse(201, created)
            raise _ApiError(405, f"method {method} not allowed on a collection")
        if sub == "eviction" and resource.plural == "pods" and method == "POST":
            return self._evict(namespace, name)
        if sub not in (None, "status"):
            raise _ApiError(
                404, f"the server could not find the requested resource ({request.path})"
            )
        key = (self._key(resource), namespace, name)
        current = self._objects.get(key)
        if current is None and method != "POST":
            raise _ApiError(
                404,
                f'{resource.qualified()} "{name}" not found',
                details={"name": name, "group": resource.group, "kind": resource.plural},
            )
        if method == "GET":
            return FakeResponse(200, copy.deepcopy(current))
        assert current is not None
        if method == "DELETE":
            self._check_delete_preconditions(resource, name, current, request.body)
            del self._objects[key]
            self._notify("delete", resource.plural, current, None)
            return FakeResponse(200, copy.deepcopy(current))
        if method == "PATCH":
            updated = self._patched(resource, current, request)
        elif method == "PUT":
            updated = copy.deepcopy(request.body)
        else:
            raise _ApiError(405, f"method {method} not allowed")
        if not isinstance(updated, dict):
            raise _ApiError(400, "the object must be a JSON object")
        self._check_precondition(resource, name, current, updated)
        if sub == "status":
            # The status subresource changes status only; the spec stays as stored.
            updated = {**copy.deepcopy(current), "status": updated.get("status", {})}
        else:
            updated["status"] = copy.deepcopy(current.get("status", {}))
        self._validate_update(resource, name, current, updated)
        self._react(resource, current, updated)
        old = copy.deepcopy(current)
        stored = copy.deepcopy(self._store(resource, namespace, name, updated))
        self._notify("update", resource.plural, old, stored)
        return FakeResponse(200, stored)

    # -- behaviour ---------------------------------------------------------------------

    def _patched(self, resource: _Resource, current: JSON, request: RecordedRequest) -> Any:
        kind = (request.content_type or "").split(";")[0].strip()
        body = request.body
        if kind == MERGE_PATCH:
            return _merge_patch(copy.deepcopy(current), body)
        if kind == STRATEGIC_MERGE_PATCH:
            if resource.custom:
                raise _ApiError(
                    415,
                    "the body of the request was in an unknown format - accepted media types "
                    "include: application/json-patch+json, application/merge-patch+json, "
                    "application/apply-patch+yaml",
                )
            return _strategic_merge(copy.deepcopy(current), body)
        if kind == JSON_PATCH:
            return _json_patch(copy.deepcopy(current), body)
        raise _ApiError(415, f"the body of the request was in an unknown format: {kind!r}")

    def _check_precondition(
        self, resource: _Resource, name: str, current: JSON, updated: JSON
    ) -> None:
        wanted = (updated.get("metadata") or {}).get("resourceVersion")
        stored = current["metadata"]["resourceVersion"]
        if wanted is not None and str(wanted) != stored:
            raise _ApiError(
                409,
                f'Operation cannot be fulfilled on {resource.qualified()} "{name}": the object '
                "has been modified; please apply your changes to the latest version and try again",
                reason="Conflict",
                details={"name": name, "group": resource.group, "kind": resource.plural},
            )

    def _check_delete_preconditions(
        self, resource: _Resource, name: str, current: JSON, body: Any
    ) -> None:
        # DeleteOptions.preconditions: the delete applies only to the object with this uid (or
        # resourceVersion); another object under the same name answers 409, as the real server.
        wanted = (body or {}).get("preconditions") if isinstance(body, dict) else None
        if not wanted:
            return
        for field_name, stored in (
            ("uid", current["metadata"].get("uid")),
            ("resourceVersion", current["metadata"].get("resourceVersion")),
        ):
            if wanted.get(field_name) is not None and wanted[field_name] != stored:
                raise _ApiError(
                    409,
                    f"Precondition failed: {field_name}: {wanted[field_name]}, "
                    f"ObjectMeta.{field_name}: {stored}",
                    reason="Conflict",
                    details={"name": name, "group": resource.group, "kind": resource.plural},
                )

    def _validate_update(self, resource: _Resource, name: str, old: JSON, new: JSON) -> None:
        for field_name in ("name", "namespace", "uid"):
            if old["metadata"].get(field_name) != (new.get("metadata") or {}).get(
                field_name, old["metadata"].get(field_name)
            ):
                raise _ApiError(
                    422,
                    f'{resource.kind} "{name}" is invalid: metadata.{field_name}: '
                    "field is immutable",
                )
        if resource.plural == "jobs" and resource.group == "batch":
            self._validate_job_template(name, old, new)

    @staticmethod
    def _validate_job_template(name: str, old: JSON, new: JSON) -> None:
        old_template = copy.deepcopy(old["spec"]["template"])
        new_template = copy.deepcopy((new.get("spec") or {}).get("template"))
        if old_template == new_template:
            return
        suspended = bool(old["spec"].get("suspend"))
        not_started = not (old.get("status") or {}).get("startTime")
        if suspended and not_started and isinstance(new_template, dict):
            for template in (old_template, new_template):
                meta = template.setdefault("metadata", {})
                spec = template.setdefault("spec", {})
                for key in _JOB_MUTABLE_TEMPLATE_META:
                    meta.pop(key, None)
                for key in _JOB_MUTABLE_TEMPLATE_SPEC:
                    spec.pop(key, None)
            if old_template == new_template:
                return
        raise _ApiError(
            422,
            f'Job.batch "{name}" is invalid: spec.template: Invalid value: '
            '"core.PodTemplateSpec{...}": field is immutable',
            details={
                "name": name,
                "group": "batch",
                "kind": "Job",
                "causes": [
                    {
                        "reason": "FieldValueInvalid",
                        "message": "Invalid value: field is immutable",
                        "field": "spec.template",
                    }
                ],
            },
        )

    def _react(self, resource: _Resource, old: JSON, new: JSON) -> None:
        """What the job controller / training operator would do next, done at once."""
        if resource.plural == "jobs" and resource.group == "batch":
            was, now = bool(old["spec"].get("suspend")), bool(new["spec"].get("suspend"))
            status = new.setdefault("status", {})
            if now and not was:
                status["active"] = 0
                _set_condition(status, _condition("Suspended", "True", "JobSuspended"))
            elif was and not now:
                status["active"] = int(new["spec"].get("parallelism", 1))
                status["startTime"] = _now()
                _set_condition(status, _condition("Suspended", "False", "JobResumed"))
        elif resource.plural == "pytorchjobs":
            run_old = (old["spec"].get("runPolicy") or {}).get("suspend")
            run_new = (new["spec"].get("runPolicy") or {}).get("suspend")
            status = new.setdefault("status", {})
            if run_new and not run_old:
                _set_condition(status, _condition("Suspended", "True", "PyTorchJobSuspended"))
                _set_condition(status, _condition("Running", "False", "PyTorchJobSuspended"))
            elif run_old and not run_new:
                _set_condition(status, _condition("Suspended", "False", "PyTorchJobResumed"))
                _set_condition(status, _condition("Running", "True", "PyTorchJobRunning"))

    def _evict(self, namespace: str, name: str) -> FakeResponse:
        key = (self._key(self._resource("/api/v1", "pods")), namespace, name)
        if key not in self._objects:
            raise _ApiError(404, f'pods "{name}" not found', details={"name": name, "kind": "pods"})
        block = self._eviction_blocks.get((namespace, name))
        if block is not None:
            remaining, message = block
            if remaining is None or remaining > 0:
                if remaining is not None:
                    self._eviction_blocks[(namespace, name)] = (remaining - 1, message)
                raise _ApiError(
                    429,
                    "Cannot evict pod as it would violate the pod's disruption budget.",
                    details={"causes": [{"reason": "DisruptionBudget", "message": message}]},
                )
        del self._objects[key]
        return FakeResponse(201, status_body(201, "", reason=""))

    def _list(self, resource: _Resource, namespace: str, query: Mapping[str, list[str]]) -> JSON:
        field_selector = _parse_field_selector((query.get("fieldSelector") or [""])[0])
        label_selector = _parse_label_selector((query.get("labelSelector") or [""])[0])
        items = []
        for (key, ns, _), obj in sorted(self._objects.items()):
            if key != self._key(resource) or (namespace and ns != namespace):
                continue
            if all(test(obj) for test in field_selector) and all(
                test((obj.get("metadata") or {}).get("labels") or {}) for test in label_selector
            ):
                items.append(copy.deepcopy(obj))
        return {
            "apiVersion": resource.api_version,
            "kind": f"{resource.kind}List",
            "metadata": {"resourceVersion": str(next(self._versions))},
            "items": items,
        }

    def _create(self, resource: _Resource, namespace: str, obj: Any) -> JSON:
        if not isinstance(obj, dict):
            raise _ApiError(400, "the object must be a JSON object")
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        name = meta.get("name")
        if not name:
            raise _ApiError(422, f"{resource.kind} is invalid: metadata.name: Required value")
        if resource.namespaced:
            namespace = namespace or meta.get("namespace") or "default"
            meta["namespace"] = namespace
        else:
            namespace = ""
        if (self._key(resource), namespace, name) in self._objects:
            raise _ApiError(
                409,
                f'{resource.qualified()} "{name}" already exists',
                reason="AlreadyExists",
                details={"name": name, "group": resource.group, "kind": resource.plural},
            )
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        obj["apiVersion"] = resource.api_version
        obj["kind"] = resource.kind
        return self._store(resource, namespace, name, obj)

    def _store(self, resource: _Resource, namespace: str, name: str, obj: JSON) -> JSON:
        obj["metadata"]["resourceVersion"] = str(next(self._versions))
        self._objects[(self._key(resource), namespace, name)] = obj
        return obj

    def _resource(self, prefix: str, plural: str) -> _Resource:
        try:
            return self._resources[(prefix, plural)]
        except KeyError:
            raise KeyError(f"resource {prefix}/{plural} is not registered") from None

    @staticmethod
    def _key(resource: _Resource) -> str:
        return f"{resource.prefix}/{resource.plural}"


_EXEC_PATH = re.compile(r"/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<pod>[^/]+)/exec")


class _Handler(BaseHTTPRequestHandler):
    fake: FakeKube
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return  # keep test output clean; requests are in FakeKube.requests

    def _serve(self) -> None:
        parts = urlsplit(self.path)
        if (self.headers.get("Upgrade") or "").lower() == "websocket":
            self._serve_websocket(parts.path, parse_qs(parts.query))
            return
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode("utf-8", "replace")
        request = RecordedRequest(
            method=self.command,
            path=parts.path,
            query=parse_qs(parts.query),
            content_type=self.headers.get("Content-Type"),
            body=body,
            headers={k.lower(): v for k, v in self.headers.items()},
        )
        response = self.fake._handle(request)
        headers = dict(response.headers)
        content_type = headers.pop("Content-Type", "application/json")
        if response.body is None:
            payload = b""
        elif isinstance(response.body, bytes):
            payload = response.body
        elif isinstance(response.body, str) and not content_type.startswith("application/json"):
            payload = response.body.encode()  # e.g. a pod log (text/plain)
        else:
            payload = json.dumps(response.body).encode()
        self.send_response(response.status, HTTPStatus(response.status).phrase)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)

    def _serve_websocket(self, path: str, query: Mapping[str, list[str]]) -> None:
        """The exec subresource: recorded like any request, 404 for a pod that is not there."""
        request = RecordedRequest(
            method=self.command,
            path=path,
            query=query,
            content_type=None,
            body=None,
            headers={k.lower(): v for k, v in self.headers.items()},
        )
        match = _EXEC_PATH.fullmatch(path)
        with self.fake._lock:
            self.fake._requests.append(request)
            pod = (
                self.fake._objects.get(("/api/v1/pods", match["ns"], match["pod"]))
                if match
                else None
            )
            run = self.fake._exec
        if match is None or pod is None:
            payload = json.dumps(status_body(404, f"not found: {path}")).encode()
            self.send_response(404, "Not Found")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.wfile.flush()
        serve_exec(
            self.connection, self.path, list(self.headers.items()),
            match["ns"], match["pod"], query.get("command", []), run,
        )  # fmt: skip
        self.close_connection = True

    do_GET = _serve
    do_POST = _serve
    do_PUT = _serve
    do_PATCH = _serve
    do_DELETE = _serve


def _watch_answer(listed: JSON) -> FakeResponse:
    """A watch as a stream that ends at once: one ``ADDED`` event per object that matches now
    (what a real server sends first), then the end a server's ``timeoutSeconds`` gives."""
    events = [json.dumps({"type": "ADDED", "object": item}) for item in listed["items"]]
    return FakeResponse(200, "".join(f"{e}\n" for e in events).encode())


# -- patch semantics ---------------------------------------------------------------------


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge recursively, null deletes, anything else
    (lists included) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if not isinstance(target, dict):
        target = {}
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = _merge_patch(target.get(key), value)
    return target


def _strategic_merge(target: Any, patch: Any, field_name: str | None = None) -> Any:
    """Kubernetes strategic merge patch, for the merge keys in ``_MERGE_KEYS``."""
    if isinstance(patch, dict):
        if not isinstance(target, dict):
            target = {}
        for key, value in patch.items():
            if value is None:
                target.pop(key, None)
            else:
                target[key] = _strategic_merge(target.get(key), value, key)
        return target
    if isinstance(patch, list) and field_name in _MERGE_KEYS and isinstance(target, list):
        merge_key = _MERGE_KEYS[field_name]
        merged = [copy.deepcopy(item) for item in target]
        for item in patch:
            if not isinstance(item, dict) or merge_key not in item:
                raise _ApiError(400, f"{field_name}: every element needs the merge key {merge_key}")
            if item.get("$patch") == "delete":
                merged = [m for m in merged if m.get(merge_key) != item[merge_key]]
                continue
            for index, existing in enumerate(merged):
                if existing.get(merge_key) == item[merge_key]:
                    merged[index] = _strategic_merge(existing, item, None)
                    break
            else:
                merged.append(copy.deepcopy(item))
        return merged
    return copy.deepcopy(patch)


def _json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902 JSON patch: ``add``, ``remove``, ``replace`` and ``test``."""
    if not isinstance(operations, list):
        raise _ApiError(400, "a JSON patch is a list of operations")
    for operation in operations:
        op, path = operation.get("op"), operation.get("path", "")
        tokens = [t.replace("~1", "/").replace("~0", "~") for t in path.split("/")[1:]]
        if not tokens:
            raise _ApiError(422, f"cannot {op} the document root")
        parent = target
        for token in tokens[:-1]:
            parent = parent[int(token)] if isinstance(parent, list) else parent.get(token)
            if parent is None:
                raise _ApiError(422, f"path {path} does not exist")
        last = tokens[-1]
        if op == "test":
            actual = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if actual != operation.get("value"):
                raise _ApiError(422, f"test failed at {path}")
        elif op == "remove":
            if isinstance(parent, list):
                del parent[int(last)]
            elif last in parent:
                del parent[last]
            else:
                raise _ApiError(422, f"path {path} does not exist")
        elif op in ("add", "replace"):
            value = copy.deepcopy(operation.get("value"))
            if isinstance(parent, list):
                if last == "-":
                    parent.append(value)
                elif op == "add":
                    parent.insert(int(last), value)
                else:
                    parent[int(last)] = value
            else:
                if op == "replace" and last not in parent:
                    raise _ApiError(422, f"path {path} does not exist")
                parent[last] = value
        else:
            raise _ApiError(400, f"unsupported JSON patch operation {op!r}")
    return target


# -- selectors ---------------------------------------------------------------------------


def _parse_field_selector(text: str) -> list[Callable[[JSON], bool]]:
    tests: list[Callable[[JSON], bool]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        match = re.fullmatch(r"([\w.]+)\s*(!=|==|=)\s*(.*)", term)
        if not match:
            raise _ApiError(400, f"invalid field selector term {term!r}")
        path, op, value = match.groups()

        def test(obj: JSON, path: str = path, op: str = op, value: str = value) -> bool:
            current: Any = obj
            for part in path.split("."):
                current = current.get(part) if isinstance(current, dict) else None
            text = "" if current is None else str(current)
            return (text == value) if op in ("=", "==") else (text != value)

        tests.append(test)
    return tests


def _split_selector(text: str) -> list[str]:
    terms, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            terms.append(text[start:index])
            start = index + 1
    terms.append(text[start:])
    return [t.strip() for t in terms if t.strip()]


def _parse_label_selector(text: str) -> list[Callable[[Mapping[str, str]], bool]]:
    return [_label_requirement(term) for term in _split_selector(text)]


def _label_requirement(term: str) -> Callable[[Mapping[str, str]], bool]:
    """One term of a label selector: ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``,
    ``k notin (a,b)``, ``k`` (exists) or ``!k`` (does not exist)."""
    if match := re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)", term):
        key, op, raw_values = match.groups()
        values = {v.strip() for v in raw_values.split(",") if v.strip()}
        wanted = op == "in"

        def in_set(labels: Mapping[str, str]) -> bool:
            return (labels.get(key) in values) is wanted

        return in_set
    if match := re.fullmatch(r"([\w./-]+)\s*(!=|==|=)\s*([\w.-]*)", term):
        key, op, value = match.groups()
        equal = op != "!="

        def compare(labels: Mapping[str, str]) -> bool:
            return (labels.get(key) == value) is equal

        return compare
    if match := re.fullmatch(r"(!?)\s*([\w./-]+)", term):
        negated, key = match.groups()

        def exists(labels: Mapping[str, str]) -> bool:
            return (key in labels) is not bool(negated)

        return exists
    raise _ApiError(400, f"invalid label selector term {term!r}")


# -- small helpers -----------------------------------------------------------------------


def _condition(kind: str, status: str, reason: str) -> JSON:
    now = _now()
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "lastUpdateTime": now,
        "lastTransitionTime": now,
    }


def _set_condition(status: JSON, condition: JSON) -> None:
    conditions = status.setdefault("conditions", [])
    for index, existing in enumerate(conditions):
        if existing.get("type") == condition["type"]:
            conditions[index] = condition
            return
    conditions.append(condition)


def _default_message(status: int, request: RecordedRequest) -> str:
    match = _PATH.match(request.path)
    what = f'{match["plural"]} "{match["name"]}"' if match and match["name"] else request.path
    verb = {
        "GET": "get",
        "PATCH": "patch",
        "PUT": "update",
        "POST": "create",
        "DELETE": "delete",
    }.get(request.method, request.method.lower())
    if status == 403:
        resource = match["plural"] if match else request.path
        return (
            f'{what} is forbidden: User "system:serviceaccount:sdcguard:sdcguard" cannot '
            f'{verb} resource "{resource}"'
        )
    if status == 404:
        return f"{what} not found"
    if status == 409:
        return (
            f"Operation cannot be fulfilled on {what}: the object has been modified; please "
            "apply your changes to the latest version and try again"
        )
    if status == 429:
        return "Too many requests, please try again later."
    if status >= 500:
        return "Internal error occurred: injected by the test"
    return HTTPStatus(status).phrase
