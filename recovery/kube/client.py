"""Kubernetes client construction and the error handling every Kubernetes adapter shares.

Three ways to reach an API server, picked once when wiring up: in-cluster (the pod's service
account), a kubeconfig file (an operator's laptop, CI), or an explicit host (a test server, a
proxy). Whatever the way, the adapters in :mod:`recovery.nodes` and :mod:`recovery.jobs` take a
ready :class:`kubernetes.client.ApiClient` and never read the environment themselves.

Error mapping (the invariant flows rely on): every failure of a Kubernetes call leaves this
package as a :class:`~recovery.errors.RecoveryError` naming the verb and the target —
404 → :class:`NotFoundError`, 401/403 → :class:`ForbiddenError`, 409 → :class:`ConflictError`,
429 → :class:`ThrottledError`, 5xx and connection failures → :class:`TemporaryError`, anything
else (400, 415, 422, …) → :class:`PermanentError`. Read-modify-write updates go through
:func:`retry_on_conflict`, which re-reads and re-applies on 409 before giving up.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as Urllib3HTTPError

from recovery.errors import (
    ConflictError,
    ForbiddenError,
    NotFoundError,
    PermanentError,
    RecoveryError,
    TemporaryError,
    ThrottledError,
)

__all__ = [
    "SYSTEM",
    "api_client_for_host",
    "api_client_from_kubeconfig",
    "api_client_in_cluster",
    "call",
    "make_api_client",
    "retry_on_conflict",
    "status_message",
    "translate",
]

log = logging.getLogger(__name__)

SYSTEM = "kubernetes"
"""The ``system`` every error raised by the Kubernetes adapters names."""

_T = TypeVar("_T")


def api_client_in_cluster() -> k8s.ApiClient:
    """A client authenticated as the pod's service account (token and CA mounted by kubelet)."""
    configuration = k8s.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)
    except k8s_config.ConfigException as err:
        raise PermanentError(SYSTEM, "connect", "in-cluster", str(err)) from err
    return k8s.ApiClient(configuration)


def api_client_from_kubeconfig(
    path: str | Path | None = None, context: str | None = None
) -> k8s.ApiClient:
    """A client from a kubeconfig file (``$KUBECONFIG`` or ``~/.kube/config`` if ``path`` is None).

    ``persist_config=False``: refreshed credentials are never written back into the operator's
    kubeconfig by a recovery flow.
    """
    configuration = k8s.Configuration()
    try:
        k8s_config.load_kube_config(
            config_file=str(path) if path is not None else None,
            context=context,
            client_configuration=configuration,
            persist_config=False,
        )
    except (k8s_config.ConfigException, OSError) as err:
        target = f"kubeconfig {path or '(default)'}" + (f" context {context}" if context else "")
        raise PermanentError(SYSTEM, "connect", target, str(err)) from err
    return k8s.ApiClient(configuration)


def api_client_for_host(
    host: str,
    *,
    token: str | None = None,
    ca_cert: str | Path | None = None,
    verify_ssl: bool = True,
) -> k8s.ApiClient:
    """A client for an explicit API server URL, optionally with a bearer token and a CA bundle."""
    if not host.startswith(("http://", "https://")):
        raise ValueError(f"Kubernetes host must be an http(s) URL, got {host!r}")
    configuration = k8s.Configuration(
        host=host.rstrip("/"),
        ssl_ca_cert=str(ca_cert) if ca_cert is not None else None,
        verify_ssl=verify_ssl,
    )
    if token is not None:
        configuration.api_key = {"BearerToken": token}
        configuration.api_key_prefix = {"BearerToken": "Bearer"}
    return k8s.ApiClient(configuration)


def make_api_client(
    *,
    host: str | None = None,
    token: str | None = None,
    ca_cert: str | Path | None = None,
    verify_ssl: bool = True,
    kubeconfig: str | Path | None = None,
    context: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> k8s.ApiClient:
    """Pick the way to the API server: explicit host, else in-cluster when running in a pod,
    else kubeconfig.

    The order matters: an explicit host always wins (tests, proxies), and inside a pod the
    service account is preferred over any kubeconfig that happens to be baked into the image.
    """
    env = os.environ if environ is None else environ
    if host is not None:
        return api_client_for_host(host, token=token, ca_cert=ca_cert, verify_ssl=verify_ssl)
    if kubeconfig is None and env.get("KUBERNETES_SERVICE_HOST"):
        return api_client_in_cluster()
    # $KUBECONFIG as it is now: the client library reads it once, at its import.
    return api_client_from_kubeconfig(kubeconfig or env.get("KUBECONFIG") or None, context)


def status_message(err: ApiException) -> str:
    """The human message of a Kubernetes ``Status`` error body, or the HTTP reason phrase."""
    body = err.body
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if isinstance(body, str) and body:
        try:
            parsed = json.loads(body)
        except ValueError:
            return body[:500]
        if isinstance(parsed, dict) and parsed.get("message"):
            return str(parsed["message"])
    return f"HTTP {err.status} {err.reason or ''}".strip()


def translate(err: BaseException, *, verb: str, target: str, system: str = SYSTEM) -> RecoveryError:
    """Map a client failure to the typed error flows act on (see the module docstring)."""
    if isinstance(err, RecoveryError):
        return err
    if isinstance(err, ApiException):
        status = err.status or 0
        reason = f"HTTP {status}: {status_message(err)}" if status else status_message(err)
        if status == 404:
            return NotFoundError(system, verb, target, reason)
        if status in (401, 403):
            return ForbiddenError(system, verb, target, reason)
        if status == 409:
            return ConflictError(system, verb, target, reason)
        if status == 429:
            return ThrottledError(system, verb, target, reason)
        if status == 0 or status >= 500:
            return TemporaryError(system, verb, target, reason)
        return PermanentError(system, verb, target, reason)
    if isinstance(err, Urllib3HTTPError | OSError):
        return TemporaryError(system, verb, target, f"connection failed: {err}")
    return PermanentError(system, verb, target, f"{type(err).__name__}: {err}")


def call(verb: str, target: str, fn: Callable[[], _T]) -> _T:
    """Run one API call; any client failure leaves as a typed error naming verb and target."""
    try:
        return fn()
    except (ApiException, Urllib3HTTPError, OSError) as err:
        raise translate(err, verb=verb, target=target) from err


def retry_on_conflict(
    verb: str,
    target: str,
    attempt: Callable[[], _T],
    *,
    retries: int,
    backoff_s: float = 0.05,
    max_backoff_s: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
    extra: Mapping[str, object] | None = None,
) -> _T:
    """Run a read-modify-write ``attempt``; on HTTP 409 run it again, up to ``retries`` times.

    ``attempt`` must re-read the object each time and send the ``resourceVersion`` it read: a
    conflict then means "someone wrote in between", and the only correct reaction is to decide
    again on fresh state. After the last conflict a :class:`ConflictError` (still temporary:
    a flow may retry the whole action later) is raised, chained to the last 409.
    """
    if retries < 0:
        raise ValueError("retries must be >= 0")
    delay = backoff_s
    for number in range(retries + 1):
        try:
            return attempt()
        except ApiException as err:
            if err.status != 409:
                raise translate(err, verb=verb, target=target) from err
            if number == retries:
                raise ConflictError(
                    SYSTEM,
                    verb,
                    target,
                    f"still conflicting after {retries + 1} attempts: {status_message(err)}",
                ) from err
            log.info(
                "conflict on %s %s, re-reading (attempt %d of %d)",
                verb,
                target,
                number + 1,
                retries + 1,
                extra=dict(extra or {}),
            )
            # Jitter keeps several writers that conflicted once from conflicting again in step.
            sleep(delay * random.uniform(0.5, 1.0))
            delay = min(max_backoff_s, delay * 2)
        except (Urllib3HTTPError, OSError) as err:
            raise translate(err, verb=verb, target=target) from err
    raise AssertionError("unreachable")  # pragma: no cover - the loop always returns or raises
