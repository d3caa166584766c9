"""The kustomizations of ``deploy/k8s``, rendered by ``kubectl kustomize`` as ``kubectl apply -k``
renders them.

A patch file is a fragment, not an object: validating or scanning it alone checks nothing real
(a fragment has no security context of its own). So every kustomization (the base and each
overlay) is rendered whole by kustomize itself, and the rendered objects are what is checked —
by ``tests/deploy/test_manifests.py`` (kubernetes-validate) and by ``make scan`` (checkov), which
runs ``python -m tests.deploy.overlays OUT``: it writes each kustomization, rendered, under
``OUT`` and prints the patch files' paths, which the scan skips in favour of the rendered
objects. ``scripts/ensure-kubectl.sh`` (run by ``.ci/run``) installs Debian's kubectl.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "DEPLOY",
    "KUSTOMIZATIONS",
    "MANIFESTS",
    "PATCHES",
    "KustomizeError",
    "docs",
    "render",
]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
_ALL_KUSTOMIZATIONS = sorted(k.parent for k in (DEPLOY / "k8s").rglob("kustomization.yaml"))
KUSTOMIZATIONS = [
    k
    for k in _ALL_KUSTOMIZATIONS
    if (yaml.safe_load((k / "kustomization.yaml").read_text()) or {}).get("kind") != "Component"
]
"""Every folder ``kubectl apply -k`` can be pointed at: the base and each overlay (a
component is rendered inside the overlays that name it, never alone)."""
PATCHES = sorted(
    (folder / patch["path"]).resolve()
    for folder in _ALL_KUSTOMIZATIONS
    for patch in (yaml.safe_load((folder / "kustomization.yaml").read_text()) or {}).get(
        "patches", []
    )
    if "path" in patch
)
"""Patch files named by a kustomization (inline JSON patches are not files)."""
MANIFESTS = sorted(
    p
    for p in (DEPLOY / "k8s").rglob("*.yaml")
    if p.name != "kustomization.yaml" and p.resolve() not in PATCHES
)
"""Every whole object of deploy/k8s as written: the base's manifests."""


class KustomizeError(RuntimeError):
    """``kubectl kustomize`` is missing or refused a kustomization (the reason is kustomize's)."""


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise KustomizeError(
            "kubectl is not on PATH: run scripts/ensure-kubectl.sh (Debian's kubectl package)"
        )
    return kubectl


def render(folder: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl apply -k folder`` would apply, rendered by kustomize itself."""
    result = subprocess.run(
        [_kubectl(), "kustomize", str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        raise KustomizeError(f"kubectl kustomize {folder}: {result.stderr.strip()}")
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def main(out: Path) -> None:
    """Write each kustomization, rendered, to ``out/<name>.yaml`` (graph checks such as a
    Deployment's NetworkPolicy see every object of it), and print the patch files' paths."""
    out.mkdir(parents=True, exist_ok=True)
    for folder in KUSTOMIZATIONS:
        name = folder.relative_to(DEPLOY / "k8s").as_posix().replace("/", "-")
        (out / f"{name}.yaml").write_text(yaml.safe_dump_all(render(folder), sort_keys=False))
    for path in PATCHES:
        print(path.relative_to(ROOT))


if __name__ == "__main__":  # pragma: no cover
    main(Path(sys.argv[1]))
