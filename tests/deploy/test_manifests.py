"""deploy/ is what an operator applies: every manifest, and every kustomization as
``kubectl kustomize`` renders it, validates against the Kubernetes schemas offline
(kubernetes-validate), the work-pool job template renders to a valid Job that keeps flow runs
off GPU and suspect nodes, and the IAM policy names exactly the calls the code makes."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.overlays import DEPLOY, KUSTOMIZATIONS, MANIFESTS, KustomizeError, docs, render

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.30"


def _validate(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_is_valid_kubernetes(path: Path) -> None:
    objects = docs(path)
    assert objects
    for doc in objects:
        _validate(doc)


def _folder_id(folder: Path) -> str:
    return str(folder.relative_to(DEPLOY))


def _key(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=_folder_id)
def test_every_kustomization_renders_to_valid_kubernetes(folder: Path) -> None:
    objects = render(folder)
    assert objects
    for doc in objects:
        _validate(doc)
    assert len({_key(d) for d in objects}) == len(objects), "an object rendered twice"
    namespaced = [d for d in objects if d["kind"] not in {"Namespace", "ClusterRole",
                                                          "ClusterRoleBinding"}]  # fmt: skip
    assert {d["metadata"].get("namespace") for d in namespaced} == {"sdcguard"}


OVERLAYS = [f for f in KUSTOMIZATIONS if "resources" in yaml.safe_load(
    (f / "kustomization.yaml").read_text()) and f.parent.name == "overlays"]  # fmt: skip


def _contains(whole: Any, fragment: Any) -> bool:
    """Whether ``whole`` carries every value of ``fragment``: maps key by key, lists of named
    items (containers, env, volumes, mounts) item by item by ``name``, anything else equal."""
    if isinstance(whole, dict) and isinstance(fragment, dict):
        return all(k in whole and _contains(whole[k], v) for k, v in fragment.items())
    if (
        isinstance(whole, list)
        and isinstance(fragment, list)
        and all(isinstance(i, dict) and "name" in i for i in [*whole, *fragment])
    ):
        named = {item["name"]: item for item in whole}
        return all(i["name"] in named and _contains(named[i["name"]], i) for i in fragment)
    return bool(whole == fragment)


def _at(doc: Any, pointer: str) -> Any:
    for part in pointer.strip("/").split("/"):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


@pytest.mark.parametrize("folder", OVERLAYS, ids=_folder_id)
def test_every_overlay_renders_what_it_patches(folder: Path) -> None:
    """A patch that kustomize applies to nothing (a renamed target, a path that no longer
    matches) is silent: each patch's values must be in the rendered object, each image
    rename in every container that used the image, and each component's objects rendered."""
    body = yaml.safe_load((folder / "kustomization.yaml").read_text())
    overlay = {_key(d): d for d in render(folder)}
    assert body.get("patches") or body.get("images") or body.get("components")
    for component in body.get("components", []):
        spec = yaml.safe_load((folder / component / "kustomization.yaml").read_text())
        for resource in spec.get("resources", []):
            for doc in docs(folder / component / resource):
                assert overlay.get(_key(doc)) == doc, f"{folder.name}: {_key(doc)} not rendered"
    for patch in body.get("patches", []):
        fragment = docs(folder / patch["path"])[0] if "path" in patch else None
        target = (patch["target"]["kind"], patch["target"]["name"]) if "target" in patch \
            else _key(fragment or {})  # fmt: skip
        assert target in overlay, f"{folder.name}: the patch target {target} is not rendered"
        if fragment is not None:
            assert _contains(overlay[target], fragment), f"{folder.name}: {target} unpatched"
        for op in yaml.safe_load(patch.get("patch", "[]")) if fragment is None else []:
            assert op["op"] in {"add", "replace"}, op
            assert _at(overlay[target], op["path"]) == op["value"], (folder.name, op)
    images = {
        re.sub(r"(@sha256)?:[^/]*$", "", container["image"])
        for doc in overlay.values()
        for container in doc.get("spec", {})
        .get("template", {})
        .get("spec", {})
        .get("containers", [])
    }
    for image in body.get("images", []):
        assert image["name"] not in images, (image, images)
        assert image["newName"] in images, (image, images)


def test_a_kustomization_kustomize_refuses_fails_with_its_reason(tmp_path: Path) -> None:
    shutil.copytree(DEPLOY / "k8s" / "base", tmp_path / "base")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources:\n  - ../base\npatches:\n"
        "  - target: {kind: Deployment, name: sdcguard-webhook}\n"
        "    patch: |-\n      - op: replace\n        path: /spec/no/such/field\n        value: 3\n"
    )
    with pytest.raises(KustomizeError, match="no/such"):
        render(tmp_path / "broken")


def test_an_invalid_manifest_is_refused() -> None:
    bad = docs(DEPLOY / "k8s" / "base" / "webhook.yaml")[0]
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(bad)


def test_kustomizations_name_only_files_that_exist() -> None:
    for kustomization in (DEPLOY / "k8s").rglob("kustomization.yaml"):
        body = yaml.safe_load(kustomization.read_text())
        for resource in body.get("resources", []):
            assert (kustomization.parent / resource).exists(), (kustomization, resource)


def test_the_names_other_components_rely_on() -> None:
    objects = {(d["kind"], d["metadata"]["name"]) for p in MANIFESTS for d in docs(p)}
    for expected in [
        ("Namespace", "sdcguard"),
        ("Deployment", "sdcguard-webhook"),
        ("Service", "sdcguard-webhook"),
        ("NetworkPolicy", "sdcguard-webhook"),
        ("PodDisruptionBudget", "sdcguard-webhook"),
        ("Deployment", "sdcguard-worker"),
        *(
            ("ServiceAccount", f"sdcguard-{n}")
            for n in ("webhook", "worker", "recovery", "telemetry")
        ),
    ]:
        assert expected in objects
    webhook = next(d for d in docs(DEPLOY / "k8s" / "base" / "webhook.yaml")
                   if d["kind"] == "Deployment")  # fmt: skip
    (container,) = webhook["spec"]["template"]["spec"]["containers"]
    assert container["name"] == "webhook"
    assert container["ports"][0]["containerPort"] == 8080


def test_the_example_job_meets_the_training_job_contract() -> None:
    (job,) = docs(DEPLOY / "examples" / "pytorchjob.yaml")
    assert job["metadata"]["labels"]["sdcguard.io/job-id"]
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
               "spec": replica["template"]["spec"]}  # fmt: skip
        _validate(pod)  # the CRD embeds a core PodTemplateSpec
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        assert env["SDCGUARD_JOB_ID"]["value"] == job["metadata"]["labels"]["sdcguard.io/job-id"]
        assert env["SDCGUARD_CHECKPOINT_URI_PREFIX"]["value"].startswith("s3://")
        assert {"SDCGUARD_WEBHOOK_URL", "SDCGUARD_WEBHOOK_SECRET"} <= set(env)


def _render(template: Any, variables: dict[str, Any]) -> Any:
    if isinstance(template, dict):
        return {k: _render(v, variables) for k, v in template.items()}
    if isinstance(template, list):
        return [_render(v, variables) for v in template]
    if isinstance(template, str):
        whole = re.fullmatch(r"\{\{ (\w+) \}\}", template)
        if whole:
            return variables[whole[1]]
    return template


def test_the_work_pool_job_template_renders_to_a_job_off_gpu_and_suspect_nodes() -> None:
    template = json.loads((DEPLOY / "prefect" / "base-job-template.json").read_text())
    defaults = {k: v.get("default") for k, v in template["variables"]["properties"].items()}
    variables = {**defaults, "command": ["prefect", "flow-run", "execute"], "env": [],
                 "labels": {}}  # fmt: skip
    job = _render(template["job_configuration"]["job_manifest"], variables)
    job["metadata"]["name"] = "sdcguard-incident-abcde"
    _validate(job)
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "sdcguard-recovery"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = {e["key"]: e["operator"] for t in terms["nodeSelectorTerms"]
            for e in t["matchExpressions"]}  # fmt: skip
    assert keys == {"nvidia.com/gpu.present": "DoesNotExist", "sdcguard.io/suspect": "DoesNotExist"}


def _camel(snake: str) -> str:
    return "".join(part.capitalize() for part in snake.split("_"))


def test_the_iam_policy_names_exactly_the_sagemaker_calls_of_the_code() -> None:
    policy = json.loads((DEPLOY / "iam" / "sdcguard-recovery-policy.json").read_text())
    actions = {a for s in policy["Statement"] for a in s["Action"]}
    source = (ROOT / "recovery" / "aws" / "hyperpod.py").read_text()
    called = set(re.findall(r"self\._client\.([a-z_]+)", source))
    assert {a for a in actions if a.startswith("sagemaker:")} == {
        f"sagemaker:{_camel(c)}" for c in called
    }
    # The flow only reads checkpoints (GET; HEAD for ChecksumSHA256 is s3:GetObject too);
    # ListBucket lets a missing object answer 404 instead of 403.
    assert {a for a in actions if a.startswith("s3:")} == {"s3:GetObject", "s3:ListBucket"}
    assert not any("*" in a for a in actions)


def test_the_production_deployment_runs_the_control_plane_image() -> None:
    text = (ROOT / "prefect.yaml").read_text()
    assert "image: registry.example/sdcguard-control-plane:" in text
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "'.[control-plane]'" in dockerfile
    assert "USER 10001" in dockerfile
