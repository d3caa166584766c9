"""Checkpoint gate: a checkpoint is trusted only on evidence gathered after it was taken.

:class:`CheckpointGate` writes each checkpoint and records it with the gate's provenance
(:class:`~detection.gate.provenance.GateProvenance`: ``pending`` until an audit, or without
audits a vote, verifies it; quarantined after an alarm). Writing is kept here, apart from that
state machine, because it is the part that touches disk and, for a sharded model, the process
group: a record must name bytes that are whole and durable before the ledger hears of them.

*A file* (:meth:`CheckpointGate.write`): written by one rank to a temporary file, synced,
hashed and renamed into place, so a reader never sees a partial file.

*A sharded model's checkpoint* (:meth:`CheckpointGate.write_sharded`): written by every rank
through ``torch.distributed.checkpoint`` and sealed by a manifest
(:mod:`detection.weights.sharded_checkpoint`); its record carries the sha256 of the manifest and
the sharding-invariant fingerprint, which any mesh (or DDP) that loads it must show again. Every
rank learns every rank's refusal before any rank writes, so a refused write fails on all ranks
alike and none waits in a collective for another.

Beside either, the guard's learnt state (:mod:`detection.guard.state`) is written atomically,
tied to the checkpoint by the weights' fingerprint.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from detection.gate.provenance import GateProvenance
from detection.gate.records import (
    CheckpointRecord,
    GateError,
    ProvenanceSink,
    StepOutcome,
    checkpoint_path,
    sharded_checkpoint_path,
    state_path,
)

__all__ = ["CheckpointGate"]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class CheckpointGate(GateProvenance):
    """Checkpoint provenance of one job (kept by the rank that writes checkpoints).

    Invariant: a record is ``verified`` only if a passed audit (or, without audits, a passed
    vote) at a step ≥ its own was observed while the gate was open and after the record was
    pending; once closed, no record changes to ``verified`` until :meth:`reopen`.

    ``directory``: where checkpoints are written (a ``Path`` or a ``str``). ``sink``: where
    provenance goes — normally the rank's :class:`~detection.transport.sender.AlarmSender`, which
    posts
    each checkpoint (``POST /v1/jobs/{job}/checkpoints``, with ``status: quarantined`` once the
    gate quarantined it) and each audit (``POST /v1/jobs/{job}/audits``) to the webhook, so the
    ledger draws the same conclusions; ``None`` keeps provenance local to this process.
    ``nodes``: the job's nodes, recorded with each checkpoint.
    """

    def __init__(
        self,
        directory: Path | str | None,
        *,
        audit_every: int,
        nodes: Sequence[str] = (),
        sink: ProvenanceSink | None = None,
        job_id: str = "local",
        uri_prefix: str | None = None,
    ) -> None:
        super().__init__(audit_every=audit_every, nodes=nodes, sink=sink, job_id=job_id)
        self.directory = Path(directory) if directory is not None else None
        # Where the control plane reads the files (s3://… or file://… on shared storage); the
        # recorded uri is <uri_prefix>/<file name>, else the local absolute path.
        self.uri_prefix = uri_prefix
        self._guard_state: Callable[[], dict[str, Any]] | None = None

    def bind_guard_state(self, state: Callable[[], dict[str, Any]]) -> None:
        """Write ``state()`` (the guard's learnt state, :mod:`detection.guard.state`) beside
        every checkpoint: ``ckpt-<step>.sdcguard.pt``, with the step and fingerprint it belongs
        to. The guard binds itself when given the gate."""
        self._guard_state = state

    # -- writing ----------------------------------------------------------------------------------
    def write(
        self, step: int, writer: Callable[[Path], None], *, uri: str | None = None
    ) -> CheckpointRecord:
        """Write the state after ``step`` atomically and record it.

        ``writer(path)`` must write the whole checkpoint to ``path`` (a temporary file in the
        same directory); the gate syncs it, hashes it and renames it into place, so a reader never
        sees a partial file. ``uri``: where the control plane will read the file (the job copies
        it there); default ``<uri_prefix>/<file name>``, or the local path without a prefix.
        Must be called right after the guard decided ``step`` — that is the
        state whose fingerprint the record carries (a guard that defers its decision decides
        it at ``guard.flush()``).
        """
        directory = self._require_directory()
        last = self._require_decided(step)
        # taken once the step is decided (checked above): the state that step left
        guard_state = self._guard_state() if self._guard_state is not None else None
        directory.mkdir(parents=True, exist_ok=True)
        final = checkpoint_path(directory, step)
        temp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        try:
            writer(temp)
            with temp.open("rb+") as fh:
                os.fsync(fh.fileno())
            digest = _sha256(temp)
            os.replace(temp, final)
        finally:
            temp.unlink(missing_ok=True)
        self._beside(final, guard_state, last)
        return self._record(step, uri or self._uri(final), digest, last)

    def write_sharded(
        self, step: int, state: dict[str, Any], *, uri: str | None = None
    ) -> CheckpointRecord:
        """Collective, on every rank (each holds a gate observing the same guard decisions):
        write ``state`` — DTensors and tensors, e.g. ``{"model": …, "optim": …}`` from
        ``torch.distributed.checkpoint.state_dict.get_state_dict`` — through
        ``torch.distributed.checkpoint`` as ``<dir>/ckpt-<step:06d>/``, sealed by its
        ``manifest.json`` (:mod:`detection.weights.sharded_checkpoint`), and record it.

        Every rank returns the same record: ``uri`` the manifest's (default
        ``<uri_prefix>/ckpt-<step>/manifest.json``, or the local path), ``sha256`` the manifest
        bytes', ``fingerprint`` the sharding-invariant fingerprint the guard decided for
        ``step`` (any mesh, or DDP, that loads it must show the same in ``verify_loaded``);
        status and evidence as for :meth:`write`. Only rank 0's gate may hold a sink (one post
        to the ledger a checkpoint); rank 0 writes the guard's state beside the directory
        (``ckpt-<step>.sdcguard.pt``). Must be called right after the guard decided ``step``.
        """
        from detection.weights.sharded_checkpoint import (
            MANIFEST_NAME,
            every_rank,
            save_sharded,
        )

        rank, reasons = every_rank(self._refusal(step))
        refused = [f"rank {r}: {reason}" for r, reason in enumerate(reasons) if reason]
        if refused:  # on every rank alike, before any rank writes: none waits for another
            raise GateError(f"sharded checkpoint of step {step} refused: " + "; ".join(refused))
        directory = self._require_directory()
        last = self._require_decided(step)
        guard_state = self._guard_state() if self._guard_state is not None else None
        final = sharded_checkpoint_path(directory, step)
        digest = save_sharded(final, state)
        if rank == 0:
            self._beside(final, guard_state, last)
        return self._record(step, uri or self._uri(final / MANIFEST_NAME), digest, last)

    def _refusal(self, step: int) -> str | None:
        """Why this rank's gate must not write a sharded checkpoint of ``step`` (``None``: it
        may): no directory, ``step`` not the step just decided, or a sink on a rank but 0."""
        import torch.distributed as dist

        try:
            self._require_directory()
            self._require_decided(step)
        except GateError as err:
            return str(err)
        if self._sink is not None and dist.is_initialized() and dist.get_rank() != 0:
            return (
                "its gate has a provenance sink: a sharded checkpoint is posted by rank 0's "
                "gate alone (give the other ranks' gates sink=None)"
            )
        return None

    def _require_directory(self) -> Path:
        if self.directory is None:
            raise GateError("this gate has no checkpoint directory")
        return self.directory

    def _uri(self, path: Path) -> str:
        """``<uri_prefix>/<path relative to the directory>``, or the local absolute path."""
        assert self.directory is not None
        if self.uri_prefix:
            return f"{self.uri_prefix.rstrip('/')}/{path.relative_to(self.directory).as_posix()}"
        return str(path.resolve())

    def _beside(
        self, checkpoint: Path, guard_state: dict[str, Any] | None, last: StepOutcome
    ) -> None:
        """The guard's state beside ``checkpoint`` — tied to it by the weights' fingerprint
        (read_state's caller checks) — and the directory's entries made durable."""
        if guard_state is not None:
            fingerprint = last.fingerprint.hex()
            self._write_guard_state(checkpoint, {**guard_state, "fingerprint": fingerprint})
        assert self.directory is not None
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    @staticmethod
    def _write_guard_state(checkpoint: Path, state: dict[str, Any]) -> None:
        """``state`` beside ``checkpoint``, atomically (a reader sees all of it or none)."""
        import torch

        final = state_path(checkpoint)
        temp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        try:
            torch.save(state, temp)
            with temp.open("rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(temp, final)
        finally:
            temp.unlink(missing_ok=True)
