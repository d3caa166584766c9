"""A sharded checkpoint on disk: ``torch.distributed.checkpoint`` files sealed by a manifest.

A ``torch.distributed.checkpoint`` (DCP) checkpoint is a directory — one ``.distcp`` file per
rank and a ``.metadata`` file — that any mesh can load (DCP reshards on load). Its bytes are
certified the way the control plane verifies a sharded checkpoint
(``recovery.checkpoints.uris``): a ``manifest.json`` in the directory, ``{"files":
{"<relative name>": "<sha256>", …}}`` over every other file, and the ledger records the
manifest's URI and the sha256 of its bytes.

Invariants:

* **Sealed or absent.** :func:`save_sharded` has every rank write into a temporary directory
  beside the final one; rank 0 hashes every file, writes the manifest, fsyncs, and renames the
  directory into place. A reader never sees a directory without its manifest, nor a manifest
  that does not cover every file.
* **Checked before read.** :func:`load_sharded` and :func:`load_unsharded` compare every file
  with the manifest — and the manifest with the ledger's sha256 when given — before DCP reads a
  byte; a mismatch, a missing or an unlisted file raises :class:`CheckpointIntegrityError`
  naming the file, on every rank.

The manifest proves only that the bytes are the ones written. That they are the *right*
weights is the fingerprint's to show after loading (the guard's ``verify_loaded``, with the
fingerprint the ledger recorded): a manifest rewritten to match altered files passes here and
fails there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

__all__ = [
    "MANIFEST_NAME",
    "CheckpointIntegrityError",
    "check_manifest",
    "every_rank",
    "load_sharded",
    "load_unsharded",
    "save_sharded",
    "sharded_directory",
]

_log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
_CHUNK = 1 << 20


class CheckpointIntegrityError(RuntimeError):
    """A sharded checkpoint's files are not those its manifest (or the ledger) recorded.

    ``path``: the file that does not match (a shard, ``.metadata`` or the manifest itself);
    ``reason``: how.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"sharded checkpoint file {path}: {reason}; nothing was loaded")
        self.path = path
        self.reason = reason


def sharded_directory(where: Path | str) -> Path:
    """The checkpoint directory of ``where``: the directory itself or its ``manifest.json``
    (the URI the ledger records), a ``file://`` URI of either accepted."""
    text = str(where)
    if text.startswith("file://"):
        text = text.removeprefix("file://")
    path = Path(text)
    return path.parent if path.name == MANIFEST_NAME else path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path) -> list[str]:
    """Every file under ``directory`` but the manifest, as sorted relative POSIX names."""
    return sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and p.relative_to(directory).as_posix() != MANIFEST_NAME
    )


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _seal(temp: Path, final: Path) -> str:
    """Hash every file of ``temp``, write its manifest, make it durable, rename it to
    ``final``; returns the sha256 of the manifest's bytes (rank 0 only)."""
    files: dict[str, str] = {}
    for name in _files(temp):
        _fsync(temp / name)
        files[name] = _sha256(temp / name)
    data = json.dumps({"files": files}, indent=1, sort_keys=True).encode()
    manifest = temp / MANIFEST_NAME
    with manifest.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync(temp)
    if final.exists():
        # a directory cannot be renamed over a non-empty one: set the old one aside first
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(temp, final)
        shutil.rmtree(old)
    else:
        os.replace(temp, final)
    _fsync(final.parent)
    return hashlib.sha256(data).hexdigest()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (itself without a process group)."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def every_rank(value: Any) -> tuple[int, list[Any]]:
    """This rank and every rank's ``value`` (collective; ``(0, [value])`` without a process
    group): what lets all ranks refuse alike before a collective write, none left waiting."""
    if not _distributed():
        return 0, [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return dist.get_rank(), values


def save_sharded(final: Path, state: dict[str, Any]) -> str:
    """Collective: write ``state`` (DTensors, tensors and plain values, e.g. ``{"model": …,
    "optim": …}`` from ``torch.distributed.checkpoint.state_dict.get_state_dict``) as the
    sealed directory ``final``; returns the sha256 of its manifest on every rank.

    A leftover temporary directory of a crashed save is removed first; on failure nothing is
    left at ``final`` (an older checkpoint there stays) and every rank raises.
    """
    rank = _rank()
    temp = final.with_name(f".{final.name}.tmp")
    if rank == 0:
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir(parents=True)
    _from_rank0(None)  # the directory exists before any rank writes into it
    try:
        dcp.save(state, checkpoint_id=temp, no_dist=not _distributed())
    except BaseException:  # DCP's CheckpointException is a BaseException: clean up, re-raise
        if rank == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise
    sealed: tuple[str, str] = ("", "")
    if rank == 0:
        try:
            sealed = (_seal(temp, final), "")
        except OSError as err:
            shutil.rmtree(temp, ignore_errors=True)
            sealed = ("", f"{type(err).__name__}: {err}")
    digest, failure = _from_rank0(sealed)
    if failure:
        raise OSError(f"sealing the sharded checkpoint {final} failed on rank 0: {failure}")
    _log.info("sharded checkpoint sealed", extra={"path": str(final), "manifest": digest})
    return str(digest)


def check_manifest(where: Path | str, sha256: str | None = None) -> dict[str, str]:
    """Every file of the checkpoint against its manifest, and the manifest against ``sha256``
    (the ledger's) when given; returns the manifest's files. Raises
    :class:`CheckpointIntegrityError` naming the first file that does not match. Local: reads
    every byte once."""
    try:
        return _check(sharded_directory(where), sha256)
    except CheckpointIntegrityError as err:
        _log.warning("sharded checkpoint refused", extra={"path": err.path, "reason": err.reason})
        raise


def _check(directory: Path, sha256: str | None) -> dict[str, str]:
    manifest = directory / MANIFEST_NAME
    try:
        data = manifest.read_bytes()
    except OSError as err:
        raise CheckpointIntegrityError(str(manifest), f"unreadable ({err})") from err
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256.lower():
        raise CheckpointIntegrityError(
            str(manifest), f"sha256 {hashlib.sha256(data).hexdigest()}, the ledger's {sha256}"
        )
    try:
        files = json.loads(data)["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("'files' must be a non-empty object")
        for name in files:
            if not isinstance(name, str) or name.startswith("/") or ".." in name.split("/"):
                raise ValueError(f"{name!r} is not a name inside the checkpoint")
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointIntegrityError(str(manifest), f"not a manifest ({err})") from err
    present = _files(directory)
    for name in present:
        if name not in files:
            raise CheckpointIntegrityError(str(directory / name), "not in the manifest")
    for name, expected in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            raise CheckpointIntegrityError(str(path), "listed in the manifest, missing")
        try:
            actual = _sha256(path)
        except OSError as err:
            raise CheckpointIntegrityError(str(path), f"unreadable ({err})") from err
        if actual != str(expected).lower():
            raise CheckpointIntegrityError(str(path), f"sha256 {actual}, the manifest's {expected}")
    return {str(k): str(v) for k, v in files.items()}


def _checked_everywhere(where: Path | str, sha256: str | None) -> Path:
    """Rank 0 checks the manifest; every rank raises its verdict (the same error)."""
    refused: tuple[str, str] | None = None
    if _rank() == 0:
        try:
            check_manifest(where, sha256)
        except CheckpointIntegrityError as err:
            refused = (err.path, err.reason)
    refused = _from_rank0(refused)
    if refused is not None:
        raise CheckpointIntegrityError(*refused)
    return sharded_directory(where)


def load_sharded(where: Path | str, state: dict[str, Any], *, sha256: str | None = None) -> None:
    """Collective: check the checkpoint at ``where`` (its directory or manifest) against its
    manifest — and the manifest against ``sha256`` when given — then load it into ``state`` in
    place under any mesh (DCP reshards): DTensors of a sharded model, or the plain tensors of
    a DDP / unsharded one (each rank reads the whole tensors). Take the result over with
    ``set_state_dict`` (or the module's ``load_state_dict``), then call the guard's
    ``verify_loaded`` with the recorded fingerprint. Raises :class:`CheckpointIntegrityError`
    on every rank before anything is read when a file does not match."""
    directory = _checked_everywhere(where, sha256)
    dcp.load(state, checkpoint_id=directory, no_dist=not _distributed())


def load_unsharded(where: Path | str, *, sha256: str | None = None) -> dict[str, Any]:
    """The whole checkpoint as one plain state dict (full tensors on the CPU), checked as by
    :func:`load_sharded`; in one process, without a process group (DCP's
    ``dcp_to_torch_save``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    check_manifest(where, sha256)
    with tempfile.TemporaryDirectory(prefix="sdcguard-unsharded-") as scratch:
        out = Path(scratch) / "state.pt"
        dcp_to_torch_save(sharded_directory(where), out)
        state: dict[str, Any] = torch.load(out, map_location="cpu", weights_only=True)
    return state
