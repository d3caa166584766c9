"""After a checkpoint is loaded: every replica holds exactly the weights recorded with it.

A checksum of the checkpoint file proves only that the bytes were stored faithfully; the check
here proves that every replica now holds those weights, parameters and persistent buffers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from detection.row.gather import all_gather_rows
from detection.weights.fingerprint import Fingerprint, fingerprint_on_device, to_fingerprint

__all__ = ["LoadVerificationError", "verify_after_load"]


class LoadVerificationError(RuntimeError):
    """After loading a checkpoint, some replica's weights differ from the recorded fingerprint."""

    def __init__(self, expected: Fingerprint, found: dict[int, Fingerprint]) -> None:
        ranks = sorted(r for r, fp in found.items() if fp != expected)
        super().__init__(
            f"weights after load differ from the recorded fingerprint {expected.hex()} on "
            f"rank(s) {ranks}: " + ", ".join(f"{r}={found[r].hex()}" for r in ranks)
        )
        self.expected = expected
        self.found = found
        self.ranks = ranks


def verify_after_load(
    params: Iterable[torch.Tensor],
    expected: Fingerprint | str,
    group: dist.ProcessGroup | None = None,
) -> Fingerprint:
    """Collective: every replica fingerprints its model state after a checkpoint load — the
    parameters followed by the persistent buffers (:func:`model_state_tensors`), since a
    checkpoint holds both — and all must equal ``expected`` (the fingerprint recorded with
    the checkpoint). A checksum of the file
    only proves the bytes were stored faithfully; this proves every replica now holds exactly
    those weights. Raises :class:`LoadVerificationError` on every rank, naming the ranks."""
    want = Fingerprint.from_hex(expected) if isinstance(expected, str) else expected
    rows = all_gather_rows(fingerprint_on_device(params), group)
    found = {rank: to_fingerprint(a, b) for rank, (a, b) in enumerate(rows)}
    if any(fp != want for fp in found.values()):
        raise LoadVerificationError(want, found)
    return want
