"""Checkpoint storage: atomic publication, and sha256 verification by re-reading what is stored.

- :mod:`~recovery.checkpoints.store` — the :class:`CheckpointStore` interface,
  :class:`FileCheckpointStore`, :func:`load_state`;
- :mod:`~recovery.checkpoints.s3` — :class:`S3CheckpointStore`;
- :mod:`~recovery.checkpoints.uris` — :class:`UriCheckpointStore`: any URI, by its scheme, and
  sharded checkpoints by manifest.
"""

from recovery.checkpoints.s3 import S3CheckpointStore
from recovery.checkpoints.store import (
    CheckpointStore,
    ChecksumMismatch,
    FileCheckpointStore,
    StoredCheckpoint,
    load_state,
)
from recovery.checkpoints.uris import UnreadableCheckpoint, UriCheckpointStore

__all__ = [
    "CheckpointStore",
    "ChecksumMismatch",
    "FileCheckpointStore",
    "S3CheckpointStore",
    "StoredCheckpoint",
    "UnreadableCheckpoint",
    "UriCheckpointStore",
    "load_state",
]
