"""deploy/ is what an operator applies: every manifest validates against the Kubernetes schemas
offline (kubernetes-validate), the work-pool job template renders to a valid Job that keeps flow
runs off GPU and suspect nodes, and the IAM policy names exactly the calls the code makes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.overlays import DEPLOY, MANIFESTS, PATCHES, docs, patched

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


@pytest.mark.parametrize("path", PATCHES, ids=lambda p: str(p.relative_to(DEPLOY.resolve())))
def test_every_patch_gives_a_valid_object_on_its_target(path: Path) -> None:
    _validate(patched(path))


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
    source = (ROOT / "recovery" / "hyperpod.py").read_text()
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
