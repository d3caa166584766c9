"""The training-job contract (docs/training-job.md): enforced in a pod, warned about elsewhere,
and the identity a rank registers is the node and GPU it really runs on."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from detection.contract import ContractError, TrainingContract
from detection.identity import IdentityError, RankIdentity, gpu_index, strict_contract

GOOD = {
    "NODE_NAME": "ip-10-0-0-7",
    "SDCGUARD_JOB_ID": "llm-7b",
    "SDCGUARD_WEBHOOK_URL": "http://sdcguard-webhook.sdcguard.svc:8080",
    "SDCGUARD_WEBHOOK_SECRET": "s3cr3t",
    "SDCGUARD_CHECKPOINT_URI_PREFIX": "s3://ckpts/llm-7b",
}
IN_POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}


def test_a_complete_contract_passes_in_a_pod_and_builds_checkpoint_uris() -> None:
    contract = TrainingContract.from_env({**GOOD, **IN_POD})
    assert contract.strict
    assert contract.problems() == []
    assert contract.checkpoint_uri("ckpt-000010.pt") == "s3://ckpts/llm-7b/ckpt-000010.pt"


@pytest.mark.parametrize(
    ("drop", "needle"),
    [
        ("NODE_NAME", "NODE_NAME"),
        ("SDCGUARD_JOB_ID", "sdcguard.io/job-id"),
        ("SDCGUARD_WEBHOOK_URL", "SDCGUARD_WEBHOOK_URL"),
        ("SDCGUARD_WEBHOOK_SECRET", "SDCGUARD_WEBHOOK_SECRET"),
        ("SDCGUARD_CHECKPOINT_URI_PREFIX", "SDCGUARD_CHECKPOINT_URI_PREFIX"),
    ],
)
def test_each_missing_item_refuses_start_in_a_pod(drop: str, needle: str) -> None:
    env = {k: v for k, v in GOOD.items() if k != drop}
    with pytest.raises(ContractError, match=needle) as info:
        TrainingContract.from_env({**env, **IN_POD})
    assert len(info.value.problems) == 1


def test_a_local_path_or_bad_resume_uri_is_not_readable_by_the_control_plane() -> None:
    env = {**GOOD, **IN_POD, "SDCGUARD_CHECKPOINT_URI_PREFIX": "/scratch/ckpts"}
    with pytest.raises(ContractError, match="no s3:// or file://"):
        TrainingContract.from_env(env)
    env = {**GOOD, **IN_POD, "SDCGUARD_RESUME_FROM": "ckpt-000010.pt"}
    with pytest.raises(ContractError, match="SDCGUARD_RESUME_FROM"):
        TrainingContract.from_env(env)
    fine = {**GOOD, **IN_POD, "SDCGUARD_CHECKPOINT_URI_PREFIX": "file:///fsx/ckpts"}
    assert TrainingContract.from_env(fine).problems() == []


def test_outside_a_pod_gaps_are_warnings(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="detection.contract"):
        contract = TrainingContract.from_env({})
    assert not contract.strict
    assert len(caplog.records) == len(contract.problems()) == 5


def test_strictness_switch() -> None:
    assert strict_contract({"SDCGUARD_CONTRACT": "strict"})
    assert not strict_contract({**IN_POD, "SDCGUARD_CONTRACT": "off"})
    assert strict_contract(IN_POD)
    assert not strict_contract({})


def test_identity_refuses_the_pod_host_name_under_the_contract(tmp_path: Path) -> None:
    no_dmi = tmp_path / "none"
    with pytest.raises(IdentityError, match="downward API"):
        RankIdentity.detect(0, 0, 2, env=IN_POD, dmi_asset_tag=no_dmi)
    ident = RankIdentity.detect(0, 0, 2, env={**IN_POD, "NODE_NAME": "n7"}, dmi_asset_tag=no_dmi)
    assert ident.node == "n7"


def test_identity_warns_loudly_when_it_guesses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="detection.identity"):
        ident = RankIdentity.detect(0, 0, 1, env={}, dmi_asset_tag=tmp_path / "none")
    assert ident.node == socket.gethostname()
    assert any("NODE_NAME is not set" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("local_rank", "visible", "current", "expected"),
    [
        (3, 1, 0, 0),  # per-process CUDA_VISIBLE_DEVICES: the only device, whatever local_rank
        (3, 8, 0, 3),  # all visible, set_device never called: local_rank
        (3, 8, 5, 5),  # all visible, the rank selected device 5
        (0, 8, 0, 0),
        (9, 8, 0, None),  # no device of its own
        (0, 0, None, None),
    ],
)
def test_gpu_index(
    local_rank: int, visible: int, current: int | None, expected: int | None
) -> None:
    assert gpu_index(local_rank, visible, current) == expected


def test_the_gate_records_the_uri_the_control_plane_reads(tmp_path: Path) -> None:
    from detection.gate import CheckpointGate, StepOutcome
    from detection.weights.fingerprint import Fingerprint

    gate = CheckpointGate(tmp_path, audit_every=0, uri_prefix="s3://ckpts/llm-7b/")
    gate.observe(StepOutcome(step=1, ranks=(0,), fingerprint=Fingerprint(1, 2), vote_passed=True))
    record = gate.write(1, lambda p: p.write_bytes(b"state"))
    assert record.uri == "s3://ckpts/llm-7b/ckpt-000001.pt"
    gate.observe(StepOutcome(step=2, ranks=(0,), fingerprint=Fingerprint(1, 3), vote_passed=True))
    given = gate.write(2, lambda p: p.write_bytes(b"state"), uri="file:///fsx/c/2.pt")
    assert given.uri == "file:///fsx/c/2.pt"
    plain = CheckpointGate(tmp_path / "p", audit_every=0)
    plain.observe(StepOutcome(step=1, ranks=(0,), fingerprint=Fingerprint(1, 2), vote_passed=True))
    assert plain.write(1, lambda p: p.write_bytes(b"s")).uri == str(
        (tmp_path / "p" / "ckpt-000001.pt").resolve()
    )
