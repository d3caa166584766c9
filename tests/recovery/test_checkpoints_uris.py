"""Checkpoints by URI: every scheme detection records is read, and sharded checkpoints are
verified through their manifest — on S3 by the objects' own ChecksumSHA256, without a download."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import boto3
import pytest

from recovery.aws.local import create_demo_bucket
from recovery.checkpoints.s3 import S3CheckpointStore
from recovery.checkpoints.store import FileCheckpointStore
from recovery.checkpoints.uris import UnreadableCheckpoint, UriCheckpointStore
from recovery.errors import NotFoundError
from tests.recovery.aws_fixtures import (  # noqa: F401  (fixtures, registered by name)
    fixture_aws_env,
    fixture_mocked_aws,
    fixture_session,
    fixture_shared_session,
)

BUCKET = "ckpt-uris"


@pytest.fixture(name="s3")
def fixture_s3(session: boto3.session.Session) -> Any:
    create_demo_bucket(session, BUCKET)
    client = session.client("s3")
    client.gets = []  # type: ignore[attr-defined]
    client.meta.events.register(
        "before-call.s3.GetObject", lambda params, **_: client.gets.append(params["url_path"])
    )
    return client


@pytest.fixture(name="store")
def fixture_store(s3: Any, tmp_path: Path) -> UriCheckpointStore:
    return UriCheckpointStore(FileCheckpointStore(tmp_path / "root"), S3CheckpointStore(s3, BUCKET))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sharded(s3: Any, prefix: str, shards: dict[str, bytes], *, checksums: bool = True) -> str:
    for name, data in shards.items():
        extra = {"ChecksumAlgorithm": "SHA256"} if checksums else {}
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=data, **extra)
    manifest = json.dumps({"files": {n: _sha(d) for n, d in shards.items()}}).encode()
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/manifest.json", Body=manifest)
    return _sha(manifest)


def test_each_recorded_scheme_goes_to_its_store(
    store: UriCheckpointStore, s3: Any, tmp_path: Path
) -> None:
    s3.put_object(Bucket=BUCKET, Key="j/ckpt-000004.pt", Body=b"weights-4")
    assert store.verify(f"s3://{BUCKET}/j/ckpt-000004.pt", _sha(b"weights-4"))
    assert not store.verify(f"s3://{BUCKET}/j/ckpt-000004.pt", _sha(b"other"))
    local = tmp_path / "shared" / "ckpt-000002.pt"
    local.parent.mkdir()
    local.write_bytes(b"weights-2")
    assert store.verify(f"file://{local}", _sha(b"weights-2"))
    assert store.verify(str(local), _sha(b"weights-2"))
    with pytest.raises(UnreadableCheckpoint) as caught:
        store.verify("ckpt-000002.pt", _sha(b"weights-2"))  # a relative path: unreadable here
    assert isinstance(caught.value, NotFoundError)  # the resume step marks it and moves on
    with pytest.raises(UnreadableCheckpoint):
        store.verify("gs://elsewhere/ckpt.pt", _sha(b""))


def test_a_sharded_checkpoint_is_verified_by_s3_checksums_without_a_download(
    store: UriCheckpointStore, s3: Any
) -> None:
    shards = {"rank-0.pt": b"a" * 1000, "rank-1.pt": b"b" * 1000}
    manifest_sha = _sharded(s3, "j/step-8", shards)
    s3.gets.clear()
    assert store.verify(f"s3://{BUCKET}/j/step-8/manifest.json", manifest_sha)
    assert s3.gets == ["/j/step-8/manifest.json"]  # the shards were only HEADed


def test_a_corrupt_shard_or_manifest_fails_verification(store: UriCheckpointStore, s3: Any) -> None:
    shards = {"rank-0.pt": b"a" * 100, "rank-1.pt": b"b" * 100}
    manifest_sha = _sharded(s3, "j/step-9", shards)
    uri = f"s3://{BUCKET}/j/step-9/manifest.json"
    s3.put_object(Bucket=BUCKET, Key="j/step-9/rank-1.pt", Body=b"B" * 100,
                  ChecksumAlgorithm="SHA256")  # fmt: skip
    assert not store.verify(uri, manifest_sha)
    assert not store.verify(uri, _sha(b"another manifest"))
    s3.put_object(Bucket=BUCKET, Key="j/step-9/manifest.json", Body=b"{not json")
    with pytest.raises(UnreadableCheckpoint, match="not a manifest"):
        store.verify(uri, _sha(b"{not json"))


def test_shards_without_a_checksum_are_re_read(store: UriCheckpointStore, s3: Any) -> None:
    shards = {"rank-0.pt": b"x" * 100}
    manifest_sha = _sharded(s3, "j/step-3", shards, checksums=False)
    s3.gets.clear()
    assert store.verify(f"s3://{BUCKET}/j/step-3/manifest.json", manifest_sha)
    assert "/j/step-3/rank-0.pt" in s3.gets


def test_a_sharded_checkpoint_on_shared_storage(store: UriCheckpointStore, tmp_path: Path) -> None:
    directory = tmp_path / "fsx" / "step-5"
    directory.mkdir(parents=True)
    (directory / "rank-0.pt").write_bytes(b"zero")
    manifest = json.dumps({"files": {"rank-0.pt": _sha(b"zero")}}).encode()
    (directory / "manifest.json").write_bytes(manifest)
    uri = f"file://{directory}/manifest.json"
    assert store.verify(uri, _sha(manifest))
    (directory / "rank-0.pt").write_bytes(b"zer0")
    assert not store.verify(uri, _sha(manifest))
