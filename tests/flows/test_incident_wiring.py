"""Wiring of the incident flow's backends, and the approval evidence: no Prefect needed."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.incident.approval.form import ApprovalDecision, Evidence, artifact_key, evidence_markdown
from flows.incident.policy import IncidentPolicy, storm_guard
from flows.incident.wiring import Backends, build_backends, current_backends, use_backends
from flows.settings import AwsSettings, BackendMode, RecoverySettings
from recovery.aws.local import LocalAws, create_demo_cluster, start_local_aws
from recovery.checkpoints.uris import UriCheckpointStore
from recovery.diagnosis.plan import NotReplayable, plan_from_harness_args
from recovery.errors import PermanentError, TemporaryError
from recovery.isolation import IsolateRemediation
from recovery.jobs import JobKind
from recovery.kube.client import api_client_for_host
from recovery.kube.nodes import KubeNodeDirectory, KubeNodeOps
from recovery.kube.nvsentinel import NVSentinelRemediation
from recovery.kube.remediation import KubeReplaceRemediation
from recovery.local import LocalJobControl
from recovery.local.catalog import LocalJobCatalog
from recovery.local.cluster import LocalCluster
from recovery.local.nodes import LocalNodeOps
from recovery.nodes import HYPERPOD_NODE_PREFIX
from recovery.remediation import RemediationKind
from tests.recovery.fake_kube import FakeKube


@pytest.fixture(scope="module")
def local_aws() -> Iterator[LocalAws]:
    with start_local_aws() as aws:
        yield aws


def _local_backends(tmp_path: Path, url: str, aws: LocalAws) -> Backends:
    ids = create_demo_cluster(aws, "wiring", 3)
    LocalCluster.create(
        tmp_path / "cluster.json",
        ["node-0", "node-1"],
        ["node-2"],
        dict(zip(["node-0", "node-1", "node-2"], ids, strict=True)),
    )
    return build_backends(
        RecoverySettings(mode=BackendMode.LOCAL, state_dir=tmp_path),
        database_url=url,
        aws=AwsSettings(endpoint_url=aws.endpoint_url, hyperpod_cluster="wiring"),
        aws_session=aws.session(),
    )


def test_local_settings_build_local_backends_that_reach_moto(
    tmp_path: Path, sqlite_database_url: str, local_aws: LocalAws
) -> None:
    backends = _local_backends(tmp_path, sqlite_database_url, local_aws)
    assert isinstance(backends.nodes, LocalNodeOps)
    assert isinstance(backends.jobs, LocalJobControl)
    assert isinstance(backends.checkpoints, UriCheckpointStore)
    assert backends.directory.spares(["node-0"]) == ["node-2"]
    assert len(backends.hyperpod.list_nodes()) == 3
    assert backends.catalog.ref("job-1").kind is JobKind.LOCAL
    assert "AWS mocked" in backends.description
    backends.ledger.close()


def test_local_mode_refuses_to_run_without_the_moto_endpoint(
    tmp_path: Path, sqlite_database_url: str
) -> None:
    with pytest.raises(PermanentError, match="never talks to real AWS"):
        build_backends(
            RecoverySettings(mode=BackendMode.LOCAL, state_dir=tmp_path),
            database_url=sqlite_database_url,
            aws=AwsSettings(endpoint_url=None),
        )


def test_injected_backends_are_seen_by_every_thread_and_released(
    tmp_path: Path, sqlite_database_url: str, local_aws: LocalAws
) -> None:
    backends = _local_backends(tmp_path, sqlite_database_url, local_aws)
    seen: list[Backends] = []
    with use_backends(backends):
        worker = threading.Thread(target=lambda: seen.append(current_backends()))
        worker.start()
        worker.join()
        assert current_backends() is backends
    assert seen == [backends]

    backends.ledger.close()


def test_replay_plan_is_read_from_the_local_job_record(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"step": 0, "losses": [1.0, 1.0], "grad_fingerprints": [], "weight_fingerprint": "a"}\n'
    )
    jobs = LocalJobControl(tmp_path, command=["true"])
    args = [
        "--world-size",
        "2",
        "--seed",
        "9",
        "--threads",
        "2",
        "--audit-mode",
        "gradient",
        "--inject",
        "act-flip@node=node-1:from=3",
        "--inject",
        "grad-nan@0:5",
        "--trace",
        str(trace),
        "--steps",
        "10",
    ]
    jobs.launch("job-1", args, tmp_path / "job.log")
    plan = LocalJobCatalog(tmp_path).rerun_plan("job-1")
    assert plan == plan_from_harness_args(args)
    assert (plan.spec.world_size, plan.spec.seed, plan.spec.threads) == (2, 9, 2)
    assert plan.spec.audit_mode == "gradient"
    assert plan.spec.persistent_faults() == ("act-flip@node=node-1:from=3",)
    assert plan.reference is not None
    assert [r.step for r in plan.reference] == [0]
    with pytest.raises(PermanentError):
        LocalJobCatalog(tmp_path).rerun_plan("never-launched")


def test_local_checkpoints_verify_a_sharded_manifest_and_each_of_its_files(
    tmp_path: Path, sqlite_database_url: str, local_aws: LocalAws
) -> None:
    """A sharded job records its checkpoint as ``ckpt-<step>/manifest.json``: the local store
    checks the manifest against the ledger's sha256 and then every file against the
    manifest, so one flipped byte in a shard fails the checkpoint a resume would use."""
    backends = _local_backends(tmp_path, sqlite_database_url, local_aws)
    directory = tmp_path / "ckpt-000010"
    directory.mkdir()
    shards = {"__0_0.distcp": b"shard zero", ".metadata": b"plan"}
    for name, data in shards.items():
        (directory / name).write_bytes(data)
    files = {name: hashlib.sha256(data).hexdigest() for name, data in shards.items()}
    manifest = json.dumps({"files": files}).encode()
    (directory / "manifest.json").write_bytes(manifest)
    uri, sha = str(directory / "manifest.json"), hashlib.sha256(manifest).hexdigest()
    assert backends.checkpoints.verify(uri, sha) is True
    (directory / "__0_0.distcp").write_bytes(b"shard zerO")
    assert backends.checkpoints.verify(uri, sha) is False
    backends.ledger.close()


def test_a_sharded_job_has_no_replay_plan_and_says_why() -> None:
    """The replay traces a job's steps as a DDP job; a sharded job's guard refuses that, so
    its plan is refused before any rerun is launched, with the reason the verdict records."""
    args = ["--world-size", "4", "--parallel", "hsdp", "--shard-size", "2", "--steps", "10"]
    with pytest.raises(NotReplayable, match="--parallel hsdp: a sharded job is not replayed"):
        plan_from_harness_args(args)
    assert plan_from_harness_args(args[:2] + args[-2:]).spec.world_size == 4


def test_the_approval_form_needs_a_decision_an_approver_and_a_reason() -> None:
    with pytest.raises(ValueError, match="decision"):
        ApprovalDecision.model_validate({"approver": "a", "reason": "r"})
    with pytest.raises(ValueError, match="approver"):
        ApprovalDecision.model_validate({"decision": "approve", "approver": "", "reason": "r"})
    form = ApprovalDecision.model_validate({"decision": "reject", "approver": "a", "reason": "r"})
    assert form.uncordon_on_reject is False


def test_evidence_shows_what_an_approver_needs() -> None:
    from datetime import UTC, datetime

    storm = storm_guard(
        implicated=["node-2"],
        job_nodes=["node-0", "node-1", "node-2", "node-3"],
        recent=[],
        now=datetime.now(UTC),
        policy=IncidentPolicy(),
    )
    text = evidence_markdown(
        Evidence(
            incident_id="0f3e",
            job_id="job-1",
            suspect_nodes=["node-2"],
            suspect_range=(31, 37),
            verdict={
                "verdict": "hardware",
                "node": "node-2",
                "first_step": 33,
                "submodule": "blocks.1.mlp",
                "op_kind": "linear",
                "reason": "the mismatch follows node-2",
                "detail": {"replays": {"node-4": {"steps": 7, "final_weight_fingerprint": "ab"}}},
            },
            telemetry={"node-2": {"health": "healthy", "reasons": []}, "node-3": {"error": "x|y"}},
            storm=storm,
            auto_approval="auto-approval is off in the policy",
            rollback_checkpoint_step=29,
            alarm_count=1,
            nodes_to_fix=["node-2"],
            action="replace",
            remediation="kubernetes",
            remediation_effect="the node is drained and deleted; the autoscaler replaces it",
        )
    )
    for part in (
        "**hardware** on `node-2`",
        "first differing step 33",
        "`blocks.1.mlp` (linear)",
        "| `node-4` | 7 |",
        "**healthy**",
        "not collected: x/y",
        "steps 30..37",
        "**Remediation backend: `kubernetes`.** Replace `node-2`: the node is drained",
        "no storm",
        "auto-approval is off",
    ):
        assert part in text
    assert artifact_key("0F3E:a_b", "evidence") == "incident-0f3e-a-b-evidence"


def test_a_replacements_join_waits_as_long_as_it_is_given_and_no_longer() -> None:
    """``KubeNodeDirectory.joined`` has no limit of its own: the fix stage passes what is left
    of the policy's ``replacement_timeout_s``. A node not Ready in that time is a temporary
    error naming the node and the time; a Ready one is returned at once."""
    with FakeKube() as fake:
        api_client = api_client_for_host(fake.url, token="test-token")
        try:
            directory = KubeNodeDirectory(KubeNodeOps(api_client), [], poll_s=0.05)
            fake.add_node(f"{HYPERPOD_NODE_PREFIX}i-0new", instance_id="i-0new", ready=False)
            started = time.monotonic()
            with pytest.raises(TemporaryError, match=r"hyperpod-i-0new.*not Ready after 0\.5 s"):
                directory.joined("node-2", "i-0new", timeout_s=0.5)
            assert 0.5 <= time.monotonic() - started < 30
            fake.add_node(f"{HYPERPOD_NODE_PREFIX}i-0ready", instance_id="i-0ready")
            # no time left at all still looks once
            assert directory.joined("node-3", "i-0ready", timeout_s=0.0) == "hyperpod-i-0ready"
        finally:
            api_client.close()


_LOCAL_REMEDIATIONS = {
    "hyperpod": "HyperPodRemediation",
    "kubernetes": "LocalReplaceRemediation",
    "nvsentinel": "LocalFaultRemediation",
    "isolate": "IsolateRemediation",
}


@pytest.mark.parametrize("kind", sorted(_LOCAL_REMEDIATIONS))
def test_the_remediation_setting_picks_the_backend_once_in_local_mode(
    tmp_path: Path,
    sqlite_database_url: str,
    local_aws: LocalAws,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    monkeypatch.setenv("SDCGUARD_RECOVERY_REMEDIATION", kind)
    ids = create_demo_cluster(local_aws, f"wiring-{kind}", 1)
    LocalCluster.create(tmp_path / "cluster.json", ["node-0"], [], {"node-0": ids[0]})
    backends = build_backends(
        RecoverySettings(mode=BackendMode.LOCAL, state_dir=tmp_path),
        database_url=sqlite_database_url,
        aws=AwsSettings(endpoint_url=local_aws.endpoint_url, hyperpod_cluster=f"wiring-{kind}"),
        aws_session=local_aws.session(),
    )
    remediation = backends.remediator()
    assert type(remediation).__name__ == _LOCAL_REMEDIATIONS[kind]
    assert remediation.kind.value == kind
    assert f"remediation {kind}" in backends.description
    backends.ledger.close()


def test_the_remediation_setting_defaults_to_hyperpod_and_refuses_unknown_backends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert RecoverySettings().remediation is RemediationKind.HYPERPOD
    monkeypatch.setenv("SDCGUARD_RECOVERY_REMEDIATION", "karpenter")
    with pytest.raises(ValidationError, match="remediation"):
        RecoverySettings()


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("kubernetes", KubeReplaceRemediation),
        ("nvsentinel", NVSentinelRemediation),
        ("isolate", IsolateRemediation),
    ],
)
def test_real_mode_wires_the_kubernetes_remediations(
    tmp_path: Path, sqlite_database_url: str, kind: str, expected: type
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KUBECONFIG", str(kubeconfig))
        env.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        backends = build_backends(
            RecoverySettings(mode=BackendMode.REAL, remediation=RemediationKind(kind)),
            database_url=sqlite_database_url,
            aws=AwsSettings(endpoint_url="http://127.0.0.1:9"),
        )
    assert isinstance(backends.remediator(), expected)
    assert isinstance(backends.nodes, KubeNodeOps)
    backends.ledger.close()
