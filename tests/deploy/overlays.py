"""The kustomize overlays of ``deploy/k8s``, merged the way ``kubectl apply -k`` merges them.

A strategic-merge patch file is a fragment, not an object: validating or scanning it alone
checks nothing real (a fragment has no security context of its own). So every patch is merged
onto its one target object of the base, and the merged object is what is checked — by
``tests/deploy/test_manifests.py`` (kubernetes-validate) and by ``make scan`` (checkov), which
runs ``python -m tests.deploy.overlays OUT``: it writes each overlay, rendered whole, under
``OUT`` and prints the patch files' paths, which the scan skips in favour of the merged objects.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

__all__ = ["DEPLOY", "MANIFESTS", "PATCHES", "docs", "patched", "strategic_merge"]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUSTOMIZATIONS = sorted((DEPLOY / "k8s").rglob("kustomization.yaml"))
PATCHES = sorted(
    (k.parent / patch["path"]).resolve()
    for k in KUSTOMIZATIONS
    for patch in (yaml.safe_load(k.read_text()) or {}).get("patches", [])
    if "path" in patch
)
"""Patch files named by a kustomization (inline JSON patches are not files)."""
MANIFESTS = sorted(
    p
    for p in (DEPLOY / "k8s").rglob("*.yaml")
    if p.name != "kustomization.yaml" and p.resolve() not in PATCHES
)
"""Every whole object of deploy/k8s: the base's manifests."""


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def strategic_merge(base: Any, patch: Any) -> Any:
    """Kubernetes' strategic merge for what our patches use: maps merge key by key, lists of
    named items (containers, env, volumes, mounts) merge by ``name``, anything else replaces."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = strategic_merge(base[key], value) if key in base else value
        return merged
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(i, dict) and "name" in i for i in [*base, *patch])
    ):
        by_name = {item["name"]: item for item in base}
        for item in patch:
            by_name[item["name"]] = strategic_merge(by_name.get(item["name"], {}), item)
        return list(by_name.values())
    return patch


def patched(path: Path) -> dict[str, Any]:
    """The patch file ``path`` merged onto its target; ValueError unless exactly one matches."""
    (patch,) = docs(path)
    targets = [
        doc
        for manifest in MANIFESTS
        for doc in docs(manifest)
        if (doc["kind"], doc["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"])
    ]
    if len(targets) != 1:
        raise ValueError(f"{path.name} must patch exactly one base object, not {len(targets)}")
    merged = strategic_merge(targets[0], patch)
    assert isinstance(merged, dict)
    return merged


def main(out: Path) -> None:
    """Write each overlay with patch files, rendered whole (base objects, patched ones merged),
    to ``out/<overlay>/``, so graph checks (a Deployment's NetworkPolicy) see every object."""
    by_overlay: dict[Path, list[Path]] = {}
    for path in PATCHES:
        by_overlay.setdefault(path.parent, []).append(path)
    for overlay, patches in by_overlay.items():
        merged = {(m["kind"], m["metadata"]["name"]): m for m in map(patched, patches)}
        target = out / overlay.name
        target.mkdir(parents=True, exist_ok=True)
        for manifest in MANIFESTS:
            objects = [merged.get((d["kind"], d["metadata"]["name"]), d) for d in docs(manifest)]
            (target / manifest.name).write_text(yaml.safe_dump_all(objects, sort_keys=False))
        for path in patches:
            print(path.relative_to(ROOT))


if __name__ == "__main__":  # pragma: no cover
    main(Path(sys.argv[1]))
