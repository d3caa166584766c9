"""Checkpoints addressed by URI, whatever the scheme, and sharded checkpoints by manifest.

Detection records the URI a checkpoint can be read at (``s3://…``, ``file://…`` on shared
storage, or a local absolute path in a single-machine run); the control plane must read every
one of them. :class:`UriCheckpointStore` dispatches each call by scheme to the S3 or the
filesystem store.

A *sharded* checkpoint (one file per rank or per tensor group) is recorded as the URI of its
manifest, ``…/manifest.json``, and the sha256 of the manifest's bytes:
``{"files": {"<relative name>": "<sha256>", …}}``. Verifying it checks the manifest against the
ledger and then each file against the manifest — on S3 through the object's own
``ChecksumSHA256`` when it has one (a HEAD, no download), else by re-reading the bytes.

Invariants: ``verify`` answers False for bytes that do not match (the caller marks the
checkpoint corrupt and takes the next older one); a URI that no store can read, or a manifest
that is not one, raises :class:`UnreadableCheckpoint` — a :class:`NotFoundError`, so the
resume step marks it and moves on as for a missing object. Permission and transport errors
still propagate: a misconfigured role must not mark every checkpoint corrupt.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from recovery.checkpoints.s3 import S3CheckpointStore
from recovery.checkpoints.store import (
    FileCheckpointStore,
    InvalidCheckpointUri,
    StoredCheckpoint,
    sha256_file,
)
from recovery.errors import NotFoundError

__all__ = ["MANIFEST_NAME", "UnreadableCheckpoint", "UriCheckpointStore", "is_manifest"]

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"


class UnreadableCheckpoint(NotFoundError):
    """No store can read this URI, or its manifest is not a manifest: it cannot be resumed."""


def is_manifest(uri: str) -> bool:
    return uri.rstrip("/").endswith(MANIFEST_NAME)


class UriCheckpointStore:
    """:class:`~recovery.checkpoints.store.CheckpointStore` over every scheme detection records.

    ``put`` and ``list_uris`` go to the default store (where sdcguard itself writes); the
    other calls go to the store of the URI's scheme. ``s3`` is built lazily (it needs AWS
    settings) and only when an ``s3://`` URI is met.
    """

    def __init__(
        self,
        files: FileCheckpointStore,
        s3: S3CheckpointStore | Callable[[], S3CheckpointStore] | None = None,
        *,
        default: str = "file",
    ) -> None:
        self._files = files
        self._s3_source = s3
        self._s3: S3CheckpointStore | None = s3 if isinstance(s3, S3CheckpointStore) else None
        self._default = default

    def _s3_store(self, uri: str) -> S3CheckpointStore:
        if self._s3 is None:
            if self._s3_source is None or isinstance(self._s3_source, S3CheckpointStore):
                raise UnreadableCheckpoint("checkpoints", "address", uri, "no S3 store configured")
            self._s3 = self._s3_source()
        return self._s3

    def _store(self, uri: str) -> FileCheckpointStore | S3CheckpointStore:
        scheme = urlparse(uri).scheme
        if scheme == "s3":
            return self._s3_store(uri)
        if scheme in ("file", "") and (scheme == "file" or uri.startswith("/")):
            return self._files
        raise UnreadableCheckpoint(
            "checkpoints", "address", uri, "not an s3://, file:// or absolute-path URI"
        )

    # -- the protocol ---------------------------------------------------------------------
    def put(self, local_path: Path, key: str) -> StoredCheckpoint:
        if self._default == "s3":
            return self._s3_store(f"s3://default/{key}").put(local_path, key)
        return self._files.put(local_path, key)

    def verify(self, uri: str, sha256: str) -> bool:
        try:
            if is_manifest(uri):
                return self._verify_manifest(uri, sha256)
            return self._store(uri).verify(uri, sha256)
        except InvalidCheckpointUri as err:
            raise UnreadableCheckpoint("checkpoints", "verify", uri, str(err)) from err

    def fetch(self, uri: str, dest: Path) -> Path:
        return self._store(uri).fetch(uri, dest)

    def exists(self, uri: str) -> bool:
        return self._store(uri).exists(uri)

    def delete(self, uri: str) -> None:
        self._store(uri).delete(uri)

    def list_uris(self, prefix: str = "") -> list[str]:
        if self._default == "s3":
            return self._s3_store("s3://default/").list_uris(prefix)
        return self._files.list_uris(prefix)

    # -- sharded checkpoints ----------------------------------------------------------------
    def _verify_manifest(self, uri: str, sha256: str) -> bool:
        data = self._read_manifest(uri)
        import hashlib

        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            log.warning(
                "checkpoint manifest sha256 mismatch",
                extra={"uri": uri, "expected": sha256, "actual": actual},
            )
            return False
        files = _parse_manifest(uri, data)
        base = uri.rstrip("/").rsplit("/", 1)[0]
        for name, expected in sorted(files.items()):
            shard = f"{base}/{name}"
            if not self._verify_shard(shard, expected):
                log.warning(
                    "checkpoint shard does not match its manifest",
                    extra={"uri": shard, "manifest": uri},
                )
                return False
        return True

    def _read_manifest(self, uri: str) -> bytes:
        store = self._store(uri)
        if isinstance(store, S3CheckpointStore):
            return store.read_small(uri)
        path = FileCheckpointStore._path(uri)
        try:
            return path.read_bytes()
        except FileNotFoundError as err:
            raise NotFoundError("checkpoints", "read", uri, "no manifest") from err

    def _verify_shard(self, uri: str, expected: str) -> bool:
        store = self._store(uri)
        if isinstance(store, S3CheckpointStore):
            answered = store.s3_sha256(uri)
            if answered is not None:
                return answered == expected
            return store.verify(uri, expected)
        actual, _ = sha256_file(FileCheckpointStore._path(uri))
        return actual == expected


def _parse_manifest(uri: str, data: bytes) -> dict[str, str]:
    try:
        body: Any = json.loads(data)
        files = body["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("files must be a non-empty object")
        out = {}
        for name, digest in files.items():
            if not isinstance(name, str) or name.startswith("/") or ".." in name.split("/"):
                raise ValueError(f"bad shard name {name!r}")
            if not isinstance(digest, str) or len(digest) != 64:
                raise ValueError(f"bad sha256 for {name!r}")
            out[name] = digest.lower()
    except (ValueError, KeyError, TypeError) as err:
        raise UnreadableCheckpoint("checkpoints", "read", uri, f"not a manifest: {err}") from err
    return out
