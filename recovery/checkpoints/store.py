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

from recovery.errors import (
    ForbiddenError,
    NotFoundError,
    PermanentError,
    RecoveryError,
    TemporaryError,
)

__all__ = [
    "PARTIAL_SUFFIX",
    "CheckpointStore",
    "ChecksumMismatch",
    "FileCheckpointStore",
    "InvalidCheckpointUri",
    "StoredCheckpoint",
    "load_state",
    "sha256_file",
]

_LOG = logging.getLogger(__name__)
CHUNK: Final = 1024 * 1024
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
        while chunk := handle.read(CHUNK):
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
def atomic_target(dest: Path) -> Iterator[Path]:
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
    with atomic_target(dest) as temp, source.open("rb") as src, temp.open("xb") as out:
        while chunk := src.read(CHUNK):
            digest.update(chunk)
            out.write(chunk)
            size += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    return digest.hexdigest(), size


def os_error(err: OSError, verb: str, target: str) -> RecoveryError:
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
            raise os_error(err, "put", str(dest)) from err
        _LOG.info("checkpoint stored", extra={"uri": str(dest), "sha256": sha, "size": size})
        return StoredCheckpoint(uri=str(dest), sha256=sha, size=size)

    def verify(self, uri: str, sha256: str) -> bool:
        path = self._path(uri)
        try:
            actual, _ = sha256_file(path)
        except OSError as err:
            raise os_error(err, "verify", uri) from err
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
            raise os_error(err, "fetch", uri) from err
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
            raise os_error(err, "delete", uri) from err

    def list_uris(self, prefix: str = "") -> list[str]:
        uris = []
        for path in self._root.rglob("*"):
            key = path.relative_to(self._root).as_posix()
            if key.startswith(prefix) and path.is_file() and not _is_partial(path):
                uris.append(str(path))
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
