"""RankIdentity: where the node and instance come from, and the registration row it makes."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import pytest
import torch

from detection.identity import RankIdentity

INSTANCE = "i-0123456789abcdef0"


@pytest.fixture
def no_dmi(tmp_path: Path) -> Path:
    return tmp_path / "absent_board_asset_tag"


def asset_tag(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "board_asset_tag"
    path.write_text(text)
    return path


def expected_gpu_uuid(local_rank: int) -> str | None:
    if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
        return None
    return f"GPU-{torch.cuda.get_device_properties(local_rank).uuid}"


def test_explicit_node_wins_over_the_environment(no_dmi: Path) -> None:
    ident = RankIdentity.detect(
        1, 1, 4, node="node-1", env={"NODE_NAME": "k8s-node"}, dmi_asset_tag=no_dmi
    )
    assert ident.node == "node-1"


def test_node_comes_from_the_downward_api_then_the_hostname(no_dmi: Path) -> None:
    from_k8s = RankIdentity.detect(0, 0, 2, env={"NODE_NAME": "ip-10-0-0-7"}, dmi_asset_tag=no_dmi)
    assert from_k8s.node == "ip-10-0-0-7"
    for env in ({}, {"NODE_NAME": ""}):
        assert (
            RankIdentity.detect(0, 0, 2, env=env, dmi_asset_tag=no_dmi).node == socket.gethostname()
        )


def test_instance_id_from_the_environment_first(tmp_path: Path) -> None:
    tag = asset_tag(tmp_path, "i-0aaaaaaaaaaaaaaaa\n")
    ident = RankIdentity.detect(0, 0, 1, env={"SDCGUARD_INSTANCE_ID": INSTANCE}, dmi_asset_tag=tag)
    assert ident.instance_id == INSTANCE


def test_instance_id_from_the_nitro_asset_tag(tmp_path: Path) -> None:
    tag = asset_tag(tmp_path, f"{INSTANCE}\n")
    assert RankIdentity.detect(0, 0, 1, env={}, dmi_asset_tag=tag).instance_id == INSTANCE
    empty_env = {"SDCGUARD_INSTANCE_ID": ""}
    assert RankIdentity.detect(0, 0, 1, env=empty_env, dmi_asset_tag=tag).instance_id == INSTANCE


@pytest.mark.parametrize(
    "text", ["Default string\n", "", "i-XYZ\n", "i-123\n", "Chassis Asset Tag"]
)
def test_other_asset_tags_give_no_instance_id(tmp_path: Path, text: str) -> None:
    tag = asset_tag(tmp_path, text)
    assert RankIdentity.detect(0, 0, 1, env={}, dmi_asset_tag=tag).instance_id is None


def test_no_asset_tag_file_gives_no_instance_id(no_dmi: Path) -> None:
    assert RankIdentity.detect(0, 0, 1, env={}, dmi_asset_tag=no_dmi).instance_id is None


def test_gpu_uuid_is_the_local_ranks_device_or_none_without_cuda(no_dmi: Path) -> None:
    ident = RankIdentity.detect(0, 0, 1, env={}, dmi_asset_tag=no_dmi)
    assert ident.gpu_uuid == expected_gpu_uuid(0)


def test_to_dict_is_the_rank_registration_row(tmp_path: Path) -> None:
    tag = asset_tag(tmp_path, INSTANCE)
    ident = RankIdentity.detect(5, 1, 8, node="node-2", env={}, dmi_asset_tag=tag)
    assert ident.to_dict() == {
        "rank": 5,
        "local_rank": 1,
        "node": "node-2",
        "instance_id": INSTANCE,
        "gpu_uuid": expected_gpu_uuid(1),
    }
    assert ident.world_size == 8


def test_identity_is_frozen_and_validated() -> None:
    ident = RankIdentity(0, 0, 2, "node-0", None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ident.rank = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="outside a world"):
        RankIdentity(2, 0, 2, "node-0", None, None)
    with pytest.raises(ValueError, match="local_rank"):
        RankIdentity(0, -1, 2, "node-0", None, None)
    with pytest.raises(ValueError, match="node"):
        RankIdentity(0, 0, 2, "", None, None)
