"""Checkpoint stores: round trips, corruption found by sha256, no partial write ever visible."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from botocore.config import Config
from botocore.exceptions import ConnectionClosedError

from recovery.aws.local import LocalAws, create_demo_bucket
from recovery.checkpoints.s3 import SHA256_METADATA_KEY, S3CheckpointStore
from recovery.checkpoints.store import (
    PARTIAL_SUFFIX,
    CheckpointStore,
    ChecksumMismatch,
    FileCheckpointStore,
    InvalidCheckpointUri,
    load_state,
)
from recovery.errors import NotFoundError, TemporaryError
from tests.recovery.aws_fixtures import (  # noqa: F401  (fixtures, registered by name)
    REGION,
    fixture_aws_env,
    fixture_local_aws,
    fixture_mocked_aws,
    fixture_session,
    fixture_shared_session,
)

MIB = 1024 * 1024
BUCKET = "sdcguard-checkpoints"
REPO_ROOT = Path(__file__).resolve().parents[2]


def _write(path: Path, size: int, seed: int = 0) -> bytes:
    data = random.Random(seed).randbytes(size)
    path.write_bytes(data)
    return data


@pytest.fixture(name="s3")
def fixture_s3(session: boto3.session.Session) -> Any:
    assert create_demo_bucket(session, BUCKET) == BUCKET
    assert create_demo_bucket(session, BUCKET) == BUCKET  # idempotent
    return session.client(
        "s3", config=Config(retries={"mode": "standard", "total_max_attempts": 2})
    )


@pytest.fixture(name="s3_store")
def fixture_s3_store(s3: Any) -> S3CheckpointStore:
    return S3CheckpointStore(
        s3,
        BUCKET,
        "jobs/job-1",
        multipart_threshold=5 * MIB,
        multipart_chunksize=5 * MIB,
        max_concurrency=1,
    )


def test_stores_satisfy_the_protocol(tmp_path: Path, s3_store: S3CheckpointStore) -> None:
    assert isinstance(FileCheckpointStore(tmp_path), CheckpointStore)
    assert isinstance(s3_store, CheckpointStore)


# --- filesystem ------------------------------------------------------------------------------


def test_file_round_trip(tmp_path: Path) -> None:
    store = FileCheckpointStore(tmp_path / "store")
    source = tmp_path / "state.pt"
    data = _write(source, 300_000)

    stored = store.put(source, "job-1/ckpt-000030.pt")
    assert stored.uri == str(tmp_path / "store" / "job-1" / "ckpt-000030.pt")
    assert stored.sha256 == hashlib.sha256(data).hexdigest()
    assert stored.size == len(data)
    assert store.exists(stored.uri)
    assert store.verify(stored.uri, stored.sha256)
    assert store.list_uris() == [stored.uri]
    assert store.list_uris("job-2/") == []

    fetched = store.fetch(stored.uri, tmp_path / "out" / "copy.pt")
    assert fetched.read_bytes() == data

    store.delete(stored.uri)
    assert not store.exists(stored.uri)
    store.delete(stored.uri)
    with pytest.raises(NotFoundError):
        store.verify(stored.uri, stored.sha256)


def test_file_store_reads_harness_paths_and_file_uris(tmp_path: Path) -> None:
    harness_dir = tmp_path / "run" / "checkpoints"
    harness_dir.mkdir(parents=True)
    checkpoint = harness_dir / "ckpt-000010.pt"
    data = _write(checkpoint, 10_000)
    sha = hashlib.sha256(data).hexdigest()
    store = FileCheckpointStore(tmp_path / "elsewhere")

    assert store.exists(str(checkpoint))
    assert store.verify(str(checkpoint), sha)
    assert store.verify(checkpoint.as_uri(), sha)
    assert store.fetch(checkpoint.as_uri(), tmp_path / "copy.pt").read_bytes() == data

    # A file already in place (the harness wrote into the store's root) is hashed, not copied.
    in_place = FileCheckpointStore(harness_dir).put(checkpoint, "ckpt-000010.pt")
    assert (in_place.uri, in_place.sha256, in_place.size) == (str(checkpoint), sha, len(data))


def test_file_corruption_is_caught(tmp_path: Path) -> None:
    store = FileCheckpointStore(tmp_path)
    source = tmp_path / "src.pt"
    torch.save({"step": 7, "weights": torch.arange(1000, dtype=torch.float32)}, source)
    stored = store.put(source, "ckpt-000007.pt")
    assert load_state(store, stored.uri, sha256=stored.sha256)["step"] == 7

    path = Path(stored.uri)
    corrupted = bytearray(path.read_bytes())
    corrupted[len(corrupted) // 2] ^= 0x40  # one flipped bit, same size
    path.write_bytes(bytes(corrupted))

    assert not store.verify(stored.uri, stored.sha256)
    with pytest.raises(ChecksumMismatch):
        load_state(store, stored.uri, sha256=stored.sha256)


def test_file_keys_and_uris_are_checked(tmp_path: Path) -> None:
    store = FileCheckpointStore(tmp_path / "store")
    source = tmp_path / "src.pt"
    _write(source, 10)
    for key in ("", "../outside.pt", "/abs.pt", f".x{PARTIAL_SUFFIX}"):
        with pytest.raises(InvalidCheckpointUri):
            store.put(source, key)
    for uri in ("relative/ckpt.pt", "file://otherhost/ckpt.pt"):
        with pytest.raises(InvalidCheckpointUri):
            store.exists(uri)
    with pytest.raises(NotFoundError):
        store.put(tmp_path / "missing.pt", "ckpt.pt")


def _wait_for(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def test_file_writer_killed_mid_write_publishes_nothing(tmp_path: Path) -> None:
    """A real SIGKILL while the store copies from a pipe leaves only a hidden temp file."""
    root = tmp_path / "store"
    fifo = tmp_path / "source.fifo"
    os.mkfifo(fifo)
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path;"
            "from recovery.checkpoints.store import FileCheckpointStore;"
            "FileCheckpointStore(Path(sys.argv[1])).put(Path(sys.argv[2]), 'ckpt-000040.pt')",
            str(root),
            str(fifo),
        ],
        cwd=REPO_ROOT,
    )
    try:
        feeder_done = threading.Event()

        def feed() -> None:
            # Half a checkpoint, then the pipe stays open: the writer blocks mid-copy.
            with fifo.open("wb") as pipe:
                pipe.write(b"\x01" * 2 * MIB)
                pipe.flush()
                feeder_done.wait(timeout=60)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()

        def partial_written() -> bool:
            found = list(root.glob(f".*{PARTIAL_SUFFIX}")) if root.exists() else []
            return bool(found) and found[0].stat().st_size >= MIB

        _wait_for(partial_written)
        writer.send_signal(signal.SIGKILL)
        assert writer.wait(timeout=30) == -signal.SIGKILL
    finally:
        feeder_done.set()
        if writer.poll() is None:
            writer.kill()
            writer.wait(timeout=30)
    feeder.join(timeout=30)

    final = root / "ckpt-000040.pt"
    assert not final.exists()
    assert len(list(root.glob(f".*{PARTIAL_SUFFIX}"))) == 1
    store = FileCheckpointStore(root)
    assert not store.exists(str(final))
    assert store.list_uris() == []


# --- S3 --------------------------------------------------------------------------------------


def test_s3_round_trip_single_put(tmp_path: Path, s3: Any, s3_store: S3CheckpointStore) -> None:
    source = tmp_path / "small.pt"
    data = _write(source, 100_000)
    stored = s3_store.put(source, "ckpt-000030.pt")

    assert stored.uri == f"s3://{BUCKET}/jobs/job-1/ckpt-000030.pt"
    assert stored.sha256 == hashlib.sha256(data).hexdigest()
    head = s3.head_object(Bucket=BUCKET, Key="jobs/job-1/ckpt-000030.pt")
    assert head["Metadata"] == {SHA256_METADATA_KEY: stored.sha256}
    assert "-" not in head["ETag"]  # a plain PUT
    assert s3_store.exists(stored.uri)
    assert s3_store.verify(stored.uri, stored.sha256)
    assert s3_store.list_uris() == [stored.uri]
    assert s3_store.fetch(stored.uri, tmp_path / "copy.pt").read_bytes() == data

    s3_store.delete(stored.uri)
    assert not s3_store.exists(stored.uri)
    with pytest.raises(NotFoundError):
        s3_store.verify(stored.uri, stored.sha256)
    with pytest.raises(NotFoundError):
        s3_store.fetch(stored.uri, tmp_path / "gone.pt")
    assert not (tmp_path / "gone.pt").exists()


def test_s3_multipart_upload(tmp_path: Path, s3: Any, s3_store: S3CheckpointStore) -> None:
    source = tmp_path / "big.pt"
    data = _write(source, 11 * MIB)
    stored = s3_store.put(source, "ckpt-000060.pt")

    head = s3.head_object(Bucket=BUCKET, Key="jobs/job-1/ckpt-000060.pt")
    assert head["ETag"].strip('"').endswith("-3")  # three parts: 5 + 5 + 1 MiB
    assert head["Metadata"][SHA256_METADATA_KEY] == hashlib.sha256(data).hexdigest()
    assert s3_store.verify(stored.uri, stored.sha256)
    assert s3_store.fetch(stored.uri, tmp_path / "copy.pt").read_bytes() == data


def test_s3_corruption_is_caught(tmp_path: Path, s3: Any, s3_store: S3CheckpointStore) -> None:
    source = tmp_path / "state.pt"
    torch.save({"step": 3, "weights": torch.ones(64)}, source)
    stored = s3_store.put(source, "ckpt-000003.pt")
    state = load_state(s3_store, stored.uri, sha256=stored.sha256)
    assert state["step"] == 3
    assert torch.equal(state["weights"], torch.ones(64))

    corrupted = bytearray(source.read_bytes())
    corrupted[-10] ^= 0x01
    # Same key, same (now false) metadata: only re-reading the bytes can tell.
    s3.put_object(
        Bucket=BUCKET,
        Key="jobs/job-1/ckpt-000003.pt",
        Body=bytes(corrupted),
        Metadata={SHA256_METADATA_KEY: stored.sha256},
    )
    assert not s3_store.verify(stored.uri, stored.sha256)
    with pytest.raises(ChecksumMismatch):
        load_state(s3_store, stored.uri, sha256=stored.sha256)


def test_s3_upload_failing_mid_way_is_never_visible(
    tmp_path: Path, s3: Any, s3_store: S3CheckpointStore
) -> None:
    source = tmp_path / "big.pt"
    _write(source, 11 * MIB)
    parts = 0

    def drop_connection(request: Any, **_: Any) -> None:
        nonlocal parts
        parts += 1
        if parts >= 2:
            raise ConnectionClosedError(endpoint_url=request.url)

    s3.meta.events.register("before-send.s3.UploadPart", drop_connection)
    with pytest.raises(TemporaryError, match="connection"):
        s3_store.put(source, "ckpt-000090.pt")

    uri = f"s3://{BUCKET}/jobs/job-1/ckpt-000090.pt"
    assert parts >= 2
    assert not s3_store.exists(uri)
    assert s3_store.list_uris() == []
    assert s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []  # aborted


def test_s3_abandoned_multipart_upload_is_invisible(s3: Any, s3_store: S3CheckpointStore) -> None:
    """A writer killed between parts: the upload exists, the object does not."""
    key = "jobs/job-1/ckpt-000120.pt"
    upload = s3.create_multipart_upload(
        Bucket=BUCKET, Key=key, Metadata={SHA256_METADATA_KEY: "0" * 64}
    )
    s3.upload_part(
        Bucket=BUCKET, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 5 * MIB
    )

    assert [u["Key"] for u in s3.list_multipart_uploads(Bucket=BUCKET)["Uploads"]] == [key]
    assert not s3_store.exists(f"s3://{BUCKET}/{key}")
    assert s3_store.list_uris() == []
    with pytest.raises(NotFoundError):
        s3_store.verify(f"s3://{BUCKET}/{key}", "0" * 64)


def test_s3_errors_are_typed(tmp_path: Path, s3: Any) -> None:
    source = tmp_path / "x.pt"
    _write(source, 10)
    with pytest.raises(NotFoundError) as missing_bucket:
        S3CheckpointStore(s3, "no-such-bucket").put(source, "x.pt")
    assert missing_bucket.value.system == "s3"
    assert missing_bucket.value.verb == "put"
    store = S3CheckpointStore(s3, BUCKET)
    for uri in ("gs://bucket/key", f"s3://{BUCKET}/", "/abs/path"):
        with pytest.raises(InvalidCheckpointUri):
            store.exists(uri)


def test_s3_from_settings_configures_retries() -> None:
    store = S3CheckpointStore.from_settings(
        BUCKET,
        "p",
        region=REGION,
        endpoint_url="http://127.0.0.1:1",
        max_attempts=4,
        retry_mode="adaptive",
        session=boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing"),
    )
    assert store._s3.meta.config.retries == {"mode": "adaptive", "total_max_attempts": 4}
    assert store.bucket == BUCKET


def test_s3_store_against_a_moto_server(tmp_path: Path, local_aws: LocalAws) -> None:
    bucket = create_demo_bucket(local_aws, "sdcguard-demo-checkpoints")
    store = S3CheckpointStore.from_settings(
        bucket,
        "demo",
        region=local_aws.region,
        endpoint_url=local_aws.endpoint_url,
        session=local_aws.session(),
    )
    source = tmp_path / "state.pt"
    torch.save({"step": 12, "weights": torch.full((8,), 0.5)}, source)
    stored = store.put(source, "ckpt-000012.pt")
    assert stored.uri == f"s3://{bucket}/demo/ckpt-000012.pt"
    assert store.verify(stored.uri, stored.sha256)
    assert load_state(store, stored.uri, sha256=stored.sha256)["step"] == 12
    store.delete(stored.uri)
    assert not store.exists(stored.uri)
