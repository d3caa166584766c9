"""The RBAC of deploy/k8s (the base's rbac.yaml, a component's) as data, and the requests a
client sent, as RBAC asks."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

RBAC = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base" / "rbac.yaml"
OUR_NAMESPACE = "sdcguard"

_PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)"
    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$"
)
_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}

Permission = tuple[str, str, str]  # (apiGroup, resource[/sub], verb)


def rules_of(kind: str, name: str, path: Path = RBAC) -> set[Permission]:
    """Every (group, resource, verb) that role ``kind/name`` of ``path`` grants."""
    for doc in yaml.safe_load_all(path.read_text()):
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return {
                (group, resource, verb)
                for rule in doc["rules"]
                for group in rule["apiGroups"]
                for resource in rule["resources"]
                for verb in rule["verbs"]
            }
    raise KeyError(f"no {kind} {name} in {path}")


def permission(method: str, path: str) -> tuple[str, Permission] | None:
    """(namespace, permission) a request needs; None for a path outside the resource API."""
    match = _PATH.match(path)
    if match is None:
        return None
    resource = match["plural"] + (f"/{match['sub']}" if match["sub"] else "")
    verb = ("get" if match["name"] else "list") if method == "GET" else _VERBS[method]
    return match["ns"] or "", (match["group"] or "", resource, verb)


def denied(
    requests: Iterable[Any], cluster_rules: set[Permission], namespaced: set[Permission]
) -> list[str]:
    """The requests the recovery identity would be refused (``namespaced``: in our namespace)."""
    out = []
    for request in requests:
        needed = permission(request.method, request.path)
        if needed is None:
            continue
        namespace, perm = needed
        granted = cluster_rules | (namespaced if namespace == OUR_NAMESPACE else set())
        if perm not in granted:
            out.append(f"{request.method} {request.path} needs {perm}")
    return sorted(set(out))


def used(requests: Iterable[Any]) -> set[Permission]:
    return {p[1] for r in requests if (p := permission(r.method, r.path)) is not None}
