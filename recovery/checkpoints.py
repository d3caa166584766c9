"""Checkpoint storage with atomic publication and sha256 verification from storage.

Resume trusts a checkpoint only after re-reading it from where it is stored: a sha256 taken at
write time proves nothing about the bytes that are there now (bit rot, a partial copy, an
overwrite). Two invariants hold for every backend:

* **atomic publish** — a checkpoint is visible under its uri only once complete. The filesystem
  store writes a hidden temp file, fsyncs it, renames it into place and fsyncs the directory;
  S3 makes a single PUT atomic and keeps a multipart upload invisible until
  ``CompleteMultipartUpload``. A writer killed half-way leaves nothing under the final name.
* **verify re-reads** — :meth:`CheckpointStore.verify` streams the stored bytes and recomputes
  the sha256; it never trusts stored metadata.

URIs: the filesystem store names a checkpoint by its **absolute path** (what the training
harness records for its ``ckpt-<step:06d>.pt`` files); it also reads ``file://`` URIs. The S3
store uses ``s3://bucket/key``. Both accept any uri of their scheme, not only ones under their
own root or prefix, so checkpoints written by the harness are verified where they lie.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import pickle
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol, runtime_checkable
from urllib.parse import unquote, urlparse

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from recovery.aws_errors import ServiceCodes, from_botocore
from recovery.errors import (
    ConflictError,
    ForbiddenError,
    NotFoundError,
    PermanentError,
    RecoveryError,
    TemporaryError,
)

__all__ = [
    "PARTIAL_SUFFIX",
    "SHA256_METADATA_KEY",
    "CheckpointStore",
    "ChecksumMismatch",
    "FileCheckpointStore",
    "InvalidCheckpointUri",
    "S3CheckpointStore",
    "StoredCheckpoint",
    "load_state",
    "sha256_file",
]

_LOG = logging.getLogger(__name__)
_CHUNK: Final = 1024 * 1024
_MIB: Final = 1024 * 1024

PARTIAL_SUFFIX: Final = ".partial"
"""Suffix of the hidden temp files a filesystem write goes through; never a published uri."""

SHA256_METADATA_KEY: Final = "sha256"
"""S3 user metadata key (``x-amz-meta-sha256``) holding the sha256 computed before upload."""


@dataclass(frozen=True)
class StoredCheckpoint:
    """A published checkpoint: where it is, and the sha256 and size of what was written."""

    uri: str
    sha256: str
    size: int


class ChecksumMismatch(PermanentError):
    """The stored bytes do not hash to the sha256 the ledger recorded."""


class InvalidCheckpointUri(PermanentError):
    """A uri or key this store cannot address."""


@runtime_checkable
class CheckpointStore(Protocol):
    """Where checkpoints live. Every method names its target by uri (except ``put``'s key)."""

    def put(self, local_path: Path, key: str) -> StoredCheckpoint:
        """Publish ``local_path`` under ``key``, atomically; return its uri and sha256."""
        ...

    def verify(self, uri: str, sha256: str) -> bool:
        """Whether the stored bytes hash to ``sha256`` now; :class:`NotFoundError` if absent."""
        ...

    def fetch(self, uri: str, dest: Path) -> Path:
        """Copy the checkpoint to the file ``dest`` (atomically) and return ``dest``."""
        ...

    def exists(self, uri: str) -> bool:
        """Whether a complete checkpoint is published under ``uri``."""
        ...

    def delete(self, uri: str) -> None:
        """Remove the checkpoint; deleting an absent one is not an error."""
        ...

    def list_uris(self, prefix: str = "") -> list[str]:
        """Published checkpoints whose key starts with ``prefix``, sorted; no partial writes."""
        ...


def sha256_file(path: Path) -> tuple[str, int]:
    """Hex sha256 and size of a file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable (POSIX needs the directory fsynced)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _partial_path(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.{uuid.uuid4().hex}{PARTIAL_SUFFIX}")


def _is_partial(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(PARTIAL_SUFFIX)


@contextmanager
def _atomic_target(dest: Path) -> Iterator[Path]:
    """Yield a temp path next to ``dest``; rename it onto ``dest`` only if the body succeeds.

    On failure the temp file is removed and the error propagates; a killed process leaves the
    hidden temp file, which no reader treats as a checkpoint.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    temp = _partial_path(dest)
    try:
        yield temp
        os.replace(temp, dest)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_dir(dest.parent)


def _copy_atomically(source: Path, dest: Path) -> tuple[str, int]:
    """Copy ``source`` to ``dest`` through a temp file, hashing in the same single pass."""
    digest = hashlib.sha256()
    size = 0
    with _atomic_target(dest) as temp, source.open("rb") as src, temp.open("xb") as out:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            out.write(chunk)
            size += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    return digest.hexdigest(), size


def _os_error(err: OSError, verb: str, target: str) -> RecoveryError:
    if isinstance(err, FileNotFoundError):
        return NotFoundError("checkpoint store", verb, target, str(err))
    if isinstance(err, PermissionError):
        return ForbiddenError("checkpoint store", verb, target, str(err))
    return TemporaryError("checkpoint store", verb, target, str(err))


class FileCheckpointStore:
    """Checkpoints as files under ``root`` (a local disk or a shared filesystem)."""

    def __init__(self, root: Path) -> None:
        self._root = Path(root).absolute()
        self._root.mkdir(parents=True, exist_ok=True)

    @property
    def root(self) -> Path:
        return self._root

    def _dest(self, key: str) -> Path:
        relative = Path(key)
        if not key or relative.is_absolute() or ".." in relative.parts or _is_partial(relative):
            raise InvalidCheckpointUri(
                "checkpoint store", "address", key, f"not a relative key under {self._root}"
            )
        return self._root / relative

    @staticmethod
    def _path(uri: str) -> Path:
        if uri.startswith("file://"):
            parsed = urlparse(uri)
            if parsed.netloc not in ("", "localhost"):
                raise InvalidCheckpointUri(
                    "checkpoint store", "address", uri, "file uri of another host"
                )
            path = Path(unquote(parsed.path))
        else:
            path = Path(uri)
        if not path.is_absolute():
            raise InvalidCheckpointUri(
                "checkpoint store", "address", uri, "expected an absolute path or file:// uri"
            )
        return path

    def put(self, local_path: Path, key: str) -> StoredCheckpoint:
        """Copy and hash in one pass (the source may be a pipe), then rename into place.

        A file already at its destination (the harness writes straight into the root) is
        hashed, not copied.
        """
        dest = self._dest(key)
        source = Path(local_path)
        try:
            if source.absolute() == dest or (dest.exists() and source.samefile(dest)):
                sha, size = sha256_file(dest)
            else:
                sha, size = _copy_atomically(source, dest)
        except OSError as err:
            raise _os_error(err, "put", str(dest)) from err
        _LOG.info("checkpoint stored", extra={"uri": str(dest), "sha256": sha, "size": size})
        return StoredCheckpoint(uri=str(dest), sha256=sha, size=size)

    def verify(self, uri: str, sha256: str) -> bool:
        path = self._path(uri)
        try:
            actual, _ = sha256_file(path)
        except OSError as err:
            raise _os_error(err, "verify", uri) from err
        if actual != sha256:
            _LOG.warning(
                "checkpoint sha256 mismatch",
                extra={"uri": uri, "expected": sha256, "actual": actual},
            )
        return actual == sha256

    def fetch(self, uri: str, dest: Path) -> Path:
        path = self._path(uri)
        dest = Path(dest).absolute()
        if dest == path:
            return dest
        try:
            _copy_atomically(path, dest)
        except OSError as err:
            raise _os_error(err, "fetch", uri) from err
        return dest

    def exists(self, uri: str) -> bool:
        path = self._path(uri)
        return not _is_partial(path) and path.is_file()

    def delete(self, uri: str) -> None:
        path = self._path(uri)
        try:
            path.unlink(missing_ok=True)
            _fsync_dir(path.parent)
        except FileNotFoundError:
            # The directory itself is gone: nothing is published there.
            return
        except OSError as err:
            raise _os_error(err, "delete", uri) from err

    def list_uris(self, prefix: str = "") -> list[str]:
        uris = []
        for path in self._root.rglob("*"):
            key = path.relative_to(self._root).as_posix()
            if key.startswith(prefix) and path.is_file() and not _is_partial(path):
                uris.append(str(path))
        return sorted(uris)


_S3_THROTTLING: Final = frozenset({"SlowDown", "Throttling", "ThrottlingException", "503"})
_S3_NOT_FOUND: Final = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404"})
_S3_FORBIDDEN: Final = frozenset({"AccessDenied", "403", "InvalidAccessKeyId"})


_S3_CODES: Final = ServiceCodes(
    throttling=_S3_THROTTLING,
    not_found=_S3_NOT_FOUND,
    forbidden=_S3_FORBIDDEN,
    temporary=("RequestTimeout", "InternalError"),
    conflict_statuses=(409, 412),
)


def _s3_error(err: Exception, verb: str, target: str) -> RecoveryError:
    if isinstance(err, S3UploadFailedError):
        # boto3 raises it inside ``except ClientError`` without ``from``: the context holds
        # the S3 error code that decides retry or not.
        inner = err.__cause__ or err.__context__
        if isinstance(inner, ClientError | BotoCoreError):
            err = inner
        else:
            return TemporaryError("s3", verb, target, str(err))
    return from_botocore(err, system="s3", verb=verb, target=target, codes=_S3_CODES)


def _s3_client(
    region: str,
    endpoint_url: str | None,
    max_attempts: int,
    retry_mode: str,
    session: boto3.session.Session | None,
) -> Any:
    if retry_mode not in ("standard", "adaptive"):
        raise ValueError(f"retry_mode must be 'standard' or 'adaptive', got {retry_mode!r}")
    config = Config(
        region_name=region, retries={"mode": retry_mode, "total_max_attempts": max_attempts}
    )
    source = session if session is not None else boto3.session.Session()
    return source.client("s3", endpoint_url=endpoint_url, config=config)


class S3CheckpointStore:
    """Checkpoints as S3 objects under ``s3://bucket/prefix``.

    Files above ``multipart_threshold`` go up in parts (boto3's managed transfer, classic
    client, so S3's multipart semantics apply: nothing is visible before completion and a
    failed transfer aborts its upload). The sha256 is computed locally before upload and kept
    as user metadata for people and tools; verification still re-reads the object.
    """

    def __init__(
        self,
        s3_client: Any,
        bucket: str,
        prefix: str = "",
        *,
        multipart_threshold: int = 64 * _MIB,
        multipart_chunksize: int = 16 * _MIB,
        max_concurrency: int = 4,
    ) -> None:
        self._s3 = s3_client
        self._bucket = bucket
        self._prefix = prefix.strip("/")
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
            use_threads=max_concurrency > 1,
            preferred_transfer_client="classic",
        )

    @classmethod
    def from_settings(
        cls,
        bucket: str,
        prefix: str = "",
        *,
        region: str,
        endpoint_url: str | None = None,
        max_attempts: int = 8,
        retry_mode: str = "standard",
        session: boto3.session.Session | None = None,
        multipart_threshold: int = 64 * _MIB,
        multipart_chunksize: int = 16 * _MIB,
    ) -> S3CheckpointStore:
        """Build the client (botocore retries for throttling/5xx) and the store."""
        client = _s3_client(region, endpoint_url, max_attempts, retry_mode, session)
        return cls(
            client,
            bucket,
            prefix,
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
        )

    @property
    def bucket(self) -> str:
        return self._bucket

    def _key(self, key: str) -> str:
        if not key or key.startswith("/"):
            raise InvalidCheckpointUri("s3", "address", key, "expected a non-empty relative key")
        return f"{self._prefix}/{key}" if self._prefix else key

    @staticmethod
    def _split(uri: str) -> tuple[str, str]:
        parsed = urlparse(uri)
        key = parsed.path.lstrip("/")
        if parsed.scheme != "s3" or not parsed.netloc or not key:
            raise InvalidCheckpointUri("s3", "address", uri, "expected s3://bucket/key")
        return parsed.netloc, key

    def put(self, local_path: Path, key: str) -> StoredCheckpoint:
        full_key = self._key(key)
        uri = f"s3://{self._bucket}/{full_key}"
        try:
            sha, size = sha256_file(Path(local_path))
        except OSError as err:
            raise _os_error(err, "put", str(local_path)) from err
        try:
            self._s3.upload_file(
                str(local_path),
                self._bucket,
                full_key,
                ExtraArgs={"Metadata": {SHA256_METADATA_KEY: sha}},
                Config=self._transfer,
            )
            head = self._s3.head_object(Bucket=self._bucket, Key=full_key)
        except (ClientError, BotoCoreError, S3UploadFailedError) as err:
            raise _s3_error(err, "put", uri) from err
        stored_sha = head.get("Metadata", {}).get(SHA256_METADATA_KEY)
        if head.get("ContentLength") != size or stored_sha != sha:
            # Another writer replaced the object between our upload and our read-back.
            raise ConflictError(
                "s3",
                "put",
                uri,
                f"read back size {head.get('ContentLength')} sha256 {stored_sha}, "
                f"wrote {size} {sha}",
            )
        _LOG.info("checkpoint stored", extra={"uri": uri, "sha256": sha, "size": size})
        return StoredCheckpoint(uri=uri, sha256=sha, size=size)

    def verify(self, uri: str, sha256: str) -> bool:
        bucket, key = self._split(uri)
        digest = hashlib.sha256()
        try:
            body = self._s3.get_object(Bucket=bucket, Key=key)["Body"]
            try:
                for chunk in body.iter_chunks(_CHUNK):
                    digest.update(chunk)
            finally:
                body.close()
        except (ClientError, BotoCoreError) as err:
            raise _s3_error(err, "verify", uri) from err
        actual = digest.hexdigest()
        if actual != sha256:
            _LOG.warning(
                "checkpoint sha256 mismatch",
                extra={"uri": uri, "expected": sha256, "actual": actual},
            )
        return actual == sha256

    def s3_sha256(self, uri: str) -> str | None:
        """The object's sha256 from S3's own checksum (``ChecksumSHA256``, which S3 computed and
        validated on upload), hex; None when the object has none or only a multipart composite
        (``…-N``), so the caller must re-read the bytes. No object data is transferred."""
        bucket, key = self._split(uri)
        try:
            head = self._s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        except (ClientError, BotoCoreError) as err:
            raise _s3_error(err, "head", uri) from err
        checksum = head.get("ChecksumSHA256")
        if not checksum or "-" in str(checksum) or head.get("ChecksumType") == "COMPOSITE":
            return None
        try:
            return base64.b64decode(str(checksum), validate=True).hex()
        except (binascii.Error, ValueError):
            return None

    def read_small(self, uri: str, limit: int = 4 * _MIB) -> bytes:
        """The whole object (a manifest), refused above ``limit`` bytes."""
        bucket, key = self._split(uri)
        try:
            obj = self._s3.get_object(Bucket=bucket, Key=key)
            if int(obj.get("ContentLength") or 0) > limit:
                raise PermanentError("s3", "read", uri, f"larger than {limit} bytes")
            data: bytes = obj["Body"].read()
        except (ClientError, BotoCoreError) as err:
            raise _s3_error(err, "read", uri) from err
        return data

    def fetch(self, uri: str, dest: Path) -> Path:
        bucket, key = self._split(uri)
        dest = Path(dest).absolute()
        try:
            with _atomic_target(dest) as temp:
                self._s3.download_file(bucket, key, str(temp), Config=self._transfer)
        except (ClientError, BotoCoreError) as err:
            raise _s3_error(err, "fetch", uri) from err
        except OSError as err:
            raise _os_error(err, "fetch", str(dest)) from err
        return dest

    def exists(self, uri: str) -> bool:
        bucket, key = self._split(uri)
        try:
            self._s3.head_object(Bucket=bucket, Key=key)
        except ClientError as err:
            error = _s3_error(err, "head", uri)
            if isinstance(error, NotFoundError):
                return False
            raise error from err
        except BotoCoreError as err:
            raise _s3_error(err, "head", uri) from err
        return True

    def delete(self, uri: str) -> None:
        bucket, key = self._split(uri)
        try:
            self._s3.delete_object(Bucket=bucket, Key=key)
        except (ClientError, BotoCoreError) as err:
            raise _s3_error(err, "delete", uri) from err

    def list_uris(self, prefix: str = "") -> list[str]:
        full_prefix = f"{self._prefix}/{prefix}" if self._prefix else prefix
        uris: list[str] = []
        try:
            paginator = self._s3.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self._bucket, Prefix=full_prefix):
                uris.extend(
                    f"s3://{self._bucket}/{item['Key']}" for item in page.get("Contents", ())
                )
        except (ClientError, BotoCoreError) as err:
            raise _s3_error(err, "list", f"s3://{self._bucket}/{full_prefix}") from err
        return sorted(uris)


def load_state(
    store: CheckpointStore,
    uri: str,
    *,
    sha256: str | None = None,
    weights_only: bool = True,
) -> Any:
    """``torch.load`` a stored checkpoint onto the CPU, checking ``sha256`` of what was fetched.

    The check runs on the fetched copy, the exact bytes that get loaded. ``weights_only``
    stays on unless the checkpoint holds objects beyond tensors and plain containers:
    unpickling arbitrary objects from storage executes code.
    """
    import torch  # heavy; only loading needs it

    with tempfile.TemporaryDirectory(prefix="sdcguard-ckpt-") as scratch:
        path = store.fetch(uri, Path(scratch) / "checkpoint.pt")
        if sha256 is not None:
            actual, _ = sha256_file(path)
            if actual != sha256:
                raise ChecksumMismatch(
                    "checkpoint store", "load", uri, f"sha256 {actual}, expected {sha256}"
                )
        try:
            return torch.load(path, map_location="cpu", weights_only=weights_only)
        except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as err:
            raise PermanentError("checkpoint store", "load", uri, str(err)) from err
