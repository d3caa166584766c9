"""Many tensors' fingerprints, each its own, in a few operations: ``[n, 2]`` rows at once.

The update replay (:mod:`detection.guard.update_payload`) compares each replayed parameter and
each of its state tensors with the owner's *one by one*: it needs one fingerprint per tensor,
every tensor numbered from position 0, not the sum a list's fingerprint is. Taken tensor by
tensor through :func:`~detection.weights.fingerprint.fingerprint_on_device` that is a handful
of operations each (widen, mask, two reductions, a stack): on a GPU a handful of kernel
launches per tensor, the owner's and the buddy's, for every parameter of the step's slice.

:func:`fingerprints_each` computes them together. Per device and element size, the small
tensors' words are concatenated (one ``cat``), widened and masked once, and multiplied by the
concatenation of each tensor's own multipliers ``m_0 … m_(n_k - 1)`` (one ``cat`` of slices of
the cached table); one ``index_add_`` then adds every word's ``(w, m·w)`` into its tensor's row,
the row of each word given by one ``repeat_interleave`` of the tensors' element counts. About
nine operations per batch, whatever the number of tensors in it.

*Same bits.* Row ``k`` is ``(Σ_j w_j, Σ_j m_j·w_j)`` over tensor ``k``'s words ``j`` from 0,
summed mod 2**64 — the definition of :mod:`detection.weights.fingerprint` for that tensor alone
at offset 0, and integer sums in any order are the same (``index_add_`` on int64 wraps as
``sum`` does). The tests hold every row to the single-tensor fingerprint.

*Bounded memory.* A batch holds at most ``BATCH_MAX`` words (int64 temporaries of a few times
``8·BATCH_MAX`` bytes); a tensor of ``BATCH_MAX`` elements or more, a tensor on another device
than the rows', and every tensor when the process asked for the ``fused`` or ``native``
kernel by name, take the single-tensor fingerprint (the same bits: the kernel it asked for).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from detection.weights.fingerprint import fingerprint_on_device
from detection.weights.fingerprint_kernels import (
    MULTIPLIER_TABLE,
    WORD_MASK,
    Kernel,
    flat_words,
    get_kernel,
    prepare,
)

__all__ = ["BATCH_MAX", "fingerprints_each"]

#: Words a batch holds at most (int64 temporaries of 8 bytes a word, a few at a time).
BATCH_MAX = 1 << 18


class _Counts:
    """Each batch's element counts as a device tensor, copied to the device once per layout
    (a host to device copy every step would be one more transfer a step on a GPU). The replay
    rotates through ``update_replay_every`` slices, a layout each: a few dozen entries."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._held: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}

    def get(self, counts: tuple[int, ...], device: torch.device) -> torch.Tensor:
        key = (counts, device)
        with self.lock:
            value = self._held.get(key)
            if value is None:
                if len(self._held) >= 64:
                    self._held.clear()
                value = torch.tensor(counts, dtype=torch.int64, device=device)
                self._held[key] = value
            return value


_COUNTS = _Counts()


def fingerprints_each(
    tensors: Sequence[torch.Tensor], device: torch.device, *, batch_max: int = BATCH_MAX
) -> torch.Tensor:
    """``[len(tensors), 2]`` int64 on ``device``: row ``k`` is ``tensors[k]``'s fingerprint
    numbered from 0 (zeros for an empty tensor), the bits of ``fingerprint_on_device([t])``.
    ``batch_max``: the words a batch holds at most."""
    ts = [t.detach() for t in tensors]
    prepare(ts)  # element sizes checked (a typed FingerprintError), devices per tensor below
    out = torch.zeros(len(ts), 2, dtype=torch.int64, device=device)
    batched = get_kernel() in (Kernel.AUTO, Kernel.EAGER)
    groups: dict[int, list[int]] = {}
    for k, t in enumerate(ts):
        if not t.numel():
            continue
        if batched and t.device == out.device and t.numel() < batch_max:
            groups.setdefault(t.element_size(), []).append(k)
        else:
            out[k] = fingerprint_on_device([t.reshape(-1)], offsets=[0]).to(device)
    for size, members in groups.items():
        for batch in _batches(ts, members, batch_max):
            _add_batch(out, ts, batch, size)
    return out


def _batches(ts: Sequence[torch.Tensor], members: list[int], most: int) -> list[list[int]]:
    """``members`` in order, cut where a batch would pass ``most`` words."""
    out: list[list[int]] = [[]]
    held = 0
    for k in members:
        n = ts[k].numel()
        if out[-1] and held + n > most:
            out.append([])
            held = 0
        out[-1].append(k)
        held += n
    return out


def _add_batch(out: torch.Tensor, ts: Sequence[torch.Tensor], batch: list[int], size: int) -> None:
    """Add the rows of the tensors ``batch`` (one element size, in increasing row order, so
    the rows ``repeat_interleave`` gives follow the concatenated words)."""
    device = out.device
    sizes = [ts[k].numel() for k in batch]
    table = MULTIPLIER_TABLE.get(device, max(sizes))
    words = [flat_words(ts[k]) for k in batch]
    w64 = (words[0] if len(words) == 1 else torch.cat(words)).to(torch.int64, copy=True)
    if size < 8:
        w64.bitwise_and_(WORD_MASK[size])
    mult = table[: sizes[0]] if len(sizes) == 1 else torch.cat([table[:n] for n in sizes])
    counts = [0] * out.shape[0]
    for k, n in zip(batch, sizes, strict=True):
        counts[k] = n
    rows = torch.repeat_interleave(_COUNTS.get(tuple(counts), device), output_size=w64.numel())
    out.index_add_(0, rows, torch.stack([w64, w64 * mult], dim=1))
