"""Ring re-execution audit: every audited step, each rank recomputes a partner's micro-batch.

A finite corruption of a local gradient before all-reduce is averaged into every replica, so the
replicas stay equal and no fingerprint sees it; only recomputing the same micro-batch elsewhere
and comparing does. The recomputation is evidence only if it reproduces the original exactly:

* the same micro-batch — the user's pure ``microbatch(step, rank)``, or the batch the partner
  trained on, shipped to its auditor (:mod:`detection.audit.batches`);
* the same dropout mask — each micro-batch's forward is seeded with :func:`step_seed`
  ``(seed, step, rank, micro)`` when it starts; the replay seeds the partner's value and
  restores the caller's RNG state afterwards;
* the same weights — the replay runs right after the step's last backward, before any
  optimizer steps;
* the same context — the autocast state and GradScaler scale the original forward ran under
  (:mod:`detection.audit.recompute`), and the compiled module when the loop runs a compiled one;
* the same buffers and no side effects on them — buffers are snapshot when the original forward
  starts (after DDP's buffer broadcast) and swapped in, by reference, for the replay; the live
  buffers are swapped back afterwards, so BatchNorm running statistics see exactly one update;
* no side effect on ``.grad`` or on hooks — gradient replays use ``torch.autograd.grad``;
* the same kernels — on CPU bitwise equality across processes needs the same intra-op thread
  count (the guard checks it with the rest of
  :func:`detection.audit.calibration.replay_environment`);
  gradient mode also turns on deterministic algorithms;
* the module without DDP — so no extra all-reduce fires and DDP's state is not touched.

Partners form a single ring (one cycle through all ranks) so every rank is audited exactly once
and a rank that is wrong both in its own result and in its recomputation of its partner stands
out; the ring alternates nodes, so a partner is never on the same node while another node can
take that place.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from detection.audit.attribution import attribute_pairs
from detection.audit.recompute import (
    AutocastState,
    BufferSnapshot,
    all_finite,
    local_gradients,
    rng_preserved,
)
from detection.faults.injector import FaultInjector
from detection.weights.fingerprint import fingerprint_on_device

__all__ = [
    "AuditMode",
    "AuditVerdict",
    "BufferSnapshot",
    "PartnerRecompute",
    "attribute_audit",
    "auditors_of",
    "encode_loss",
    "ring_order",
    "ring_partners",
    "seed_rng",
    "step_seed",
]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
MicroBatch = Callable[..., Any]  # (step, rank) — or (step, rank, micro) with accumulation


class AuditMode(StrEnum):
    """``loss``: forward only, compare the loss. ``gradient``: forward and backward, compare a
    fingerprint of the local (pre-all-reduce) gradient as well."""

    LOSS = "loss"
    GRADIENT = "gradient"


# -- partner choice -------------------------------------------------------------------------------
def ring_order(nodes: Sequence[str]) -> list[int]:
    """A cyclic order of all ranks in which neighbours sit on different nodes whenever the
    largest node holds at most half the ranks (otherwise as few same-node neighbours as the
    node sizes allow). Pure and deterministic: every rank computes the same ring.

    Construction: ranks grouped by node, largest node first, laid out on the even positions of
    the cycle and then on the odd ones; a group of at most n/2 ranks then never has two
    members adjacent, the wrap-around included.
    """
    groups: dict[str, list[int]] = defaultdict(list)
    for rank, node in enumerate(nodes):
        groups[node].append(rank)
    ordered = sorted(groups.values(), key=lambda ranks: (-len(ranks), ranks[0]))
    flat = [rank for ranks in ordered for rank in ranks]
    n = len(flat)
    cycle = [0] * n
    positions = list(range(0, n, 2)) + list(range(1, n, 2))
    for position, rank in zip(positions, flat, strict=True):
        cycle[position] = rank
    return cycle


def ring_partners(nodes: Sequence[str]) -> list[int]:
    """``partners[r]``: the rank whose micro-batch rank ``r`` recomputes (its successor on the
    ring). A permutation without fixed points for two or more ranks; ``[0]`` for one rank,
    which cannot be audited."""
    cycle = ring_order(nodes)
    n = len(cycle)
    partners = [0] * n
    for i, rank in enumerate(cycle):
        partners[rank] = cycle[(i + 1) % n]
    return partners


def auditors_of(partners: Sequence[int]) -> list[int]:
    """``auditors[x]``: the rank that recomputes rank ``x``'s micro-batch."""
    auditors = [0] * len(partners)
    for rank, partner in enumerate(partners):
        auditors[partner] = rank
    return auditors


# -- RNG ------------------------------------------------------------------------------------------
def step_seed(seed: int, step: int, rank: int, micro: int = 0) -> int:
    """The dropout seed of ``rank``'s micro-batch ``micro`` at ``step``: a hash, so
    neighbouring (step, rank, micro) triples get unrelated streams (micro-batch 0 keeps the
    seed a one-micro-batch loop has always had)."""
    key = f"{seed}:{step}:{rank}" if micro == 0 else f"{seed}:{step}:{rank}:{micro}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seed_rng(value: int, device: torch.device) -> None:
    """Seed the generators a forward pass on ``device`` draws from: the CPU generator and, for
    a CUDA device, that device's generator (only that one, so other devices are untouched)."""
    torch.default_generator.manual_seed(value)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(value)


# -- values and attribution ------------------------------------------------------------------------
def encode_loss(loss: torch.Tensor) -> torch.Tensor:
    """A scalar loss as its exact float64 bit pattern in an int64 (on device, no sync)."""
    return loss.detach().reshape(1).to(torch.float64).view(torch.int64)


@dataclass(frozen=True)
class AuditVerdict:
    """Outcome of one ring audit. ``mismatches``: (auditor, audited) pairs whose recomputation
    disagreed with the original; ``suspects``: the ranks of the smallest node set explaining
    them (see :mod:`detection.audit.attribution`)."""

    mismatches: tuple[tuple[int, int], ...]
    suspects: tuple[int, ...]

    @property
    def passed(self) -> bool:
        return not self.mismatches


def attribute_audit(
    partners: Sequence[int],
    own: Sequence[Sequence[int]],
    recomputed: Sequence[Sequence[int]],
    nodes: Sequence[str] | None = None,
) -> AuditVerdict:
    """``own[x]``: rank x's original value; ``recomputed[r]``: rank r's value for
    ``partners[r]``; ``nodes[r]``: rank r's node (``None``: one rank per node). The suspects are
    the smallest set of nodes, then ranks, that explains every disagreeing pair
    (:func:`detection.audit.attribution.attribute_pairs`): a persistent fault is wrong in both roles
    and named alone; a lone disagreeing pair cannot say which side erred and names both."""
    mismatches = tuple(
        (auditor, partner)
        for auditor, partner in enumerate(partners)
        if auditor != partner and tuple(recomputed[auditor]) != tuple(own[partner])
    )
    return AuditVerdict(mismatches, attribute_pairs(mismatches, nodes).ranks)


# -- the replay ------------------------------------------------------------------------------------
def gradient_fingerprint(
    partition: Sequence[Sequence[int]],
    grads: Sequence[torch.Tensor | None],
    params: Sequence[torch.Tensor],
) -> torch.Tensor:
    """The audit's fingerprint of a local gradient: Σ over DDP buckets of
    ``fingerprint_on_device`` of that bucket's gradients, each at its parameter's global
    offset (wrapping int64 sums). DDP assigns the
    same buckets on every rank, so the rank that replays groups its gradients exactly as the
    original rank's comm hook saw them, with no copy of the gradient."""
    offset = [0] * len(params)
    for i in range(1, len(params)):
        offset[i] = offset[i - 1] + params[i - 1].numel()
    total = torch.zeros(2, dtype=torch.int64, device=params[0].device)
    for bucket in partition:
        tensors = [
            g if g is not None else torch.zeros_like(params[i])
            for i, g in ((i, grads[i]) for i in bucket)
        ]
        total = total + fingerprint_on_device(tensors, offsets=[offset[i] for i in bucket])
    return total


class PartnerRecompute:
    """Recomputes another rank's micro-batch(es) of a step on the module without DDP.

    ``module`` is what the loop's forward ran through minus DDP: the user's module, or its
    compiled form (so the replay runs the same kernels). The replay seeds each micro-batch
    with the value its owner's forward was seeded with — through ``on_seed``, which the guard
    also applies when the forward itself starts — runs it under the autocast state that
    forward saw, with the buffers it saw, and computes gradients with ``autograd.grad``.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        loss_fn: LossFn,
        microbatch: MicroBatch | None,
        mode: AuditMode,
        seed: int,
        partner: int,
        injector: FaultInjector | None,
        micro_batches: int = 1,
        on_seed: Callable[[int | None], None] | None = None,
    ) -> None:
        self.module = module
        self.loss_fn = loss_fn
        self.microbatch = microbatch
        self.mode = mode
        self.seed = seed
        self.partner = partner
        self.injector = injector
        self.micro_batches = micro_batches
        self.on_seed = on_seed
        self.params = list(module.parameters())
        self.device = self.params[0].device
        self.buffers = BufferSnapshot(module)
        self.active = False

    def batch_of(self, step: int, rank: int, micro: int) -> Any:
        if self.microbatch is None:
            raise RuntimeError("no microbatch(step, rank) function and no shipped batch")
        if self.micro_batches > 1:
            return self.microbatch(step, rank, micro)
        return self.microbatch(step, rank)

    def run(
        self,
        step: int,
        partition: Sequence[Sequence[int]],
        *,
        micros: Sequence[int] = (0,),
        loss_micro: int | None = None,
        batches: dict[int, Any] | None = None,
        autocast: dict[int, AutocastState] | None = None,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[loss bits, gradient fingerprint a, b]`` (int64, on device) of the partner's
        micro-batches ``micros`` at ``step`` — the loss of ``loss_micro`` (default the last),
        the fingerprint of their summed local gradient in gradient mode — leaving RNG, buffers
        and ``.grad`` as found."""
        gradients = self.mode is AuditMode.GRADIENT
        loss, grads = self._replay(
            step, self.partner, partition, micros, loss_micro, batches, autocast, scale, gradients
        )
        if not gradients:
            return torch.cat(
                [encode_loss(loss), torch.zeros(2, dtype=torch.int64, device=self.device)]
            )
        if self.injector is not None:
            with self.injector.recomputing():
                self.injector.on_local_gradient(
                    [(i, g) for i, g in enumerate(grads) if g is not None]
                )
        return torch.cat([encode_loss(loss), gradient_fingerprint(partition, grads, self.params)])

    def finite(
        self,
        step: int,
        rank: int,
        partition: Sequence[Sequence[int]],
        *,
        micros: Sequence[int],
        batches: dict[int, Any] | None,
        autocast: dict[int, AutocastState] | None,
        scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """``1`` when ``rank``'s local gradient at ``step``, recomputed here at ``scale``, is
        finite (an overflow that rank saw is then not an overflow here: SDC)."""
        self.buffers.capture()  # the live buffers, so the recomputation leaves them untouched
        _, grads = self._replay(step, rank, partition, micros, None, batches, autocast, scale, True)
        return all_finite(grads, self.device)

    def _replay(
        self,
        step: int,
        rank: int,
        partition: Sequence[Sequence[int]],
        micros: Sequence[int],
        loss_micro: int | None,
        batches: dict[int, Any] | None,
        autocast: dict[int, AutocastState] | None,
        scale: torch.Tensor | None,
        gradients: bool,
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        positions = sorted({i for bucket in partition for i in bucket})
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        reported = micros[-1] if loss_micro is None else loss_micro
        loss_out = torch.zeros((), device=self.device)
        inputs = {
            m: batches[m] if batches is not None and m in batches else self.batch_of(step, rank, m)
            for m in micros
        }
        replay = self.injector.recomputing() if self.injector else contextlib.nullcontext()
        self.active = True
        try:
            with rng_preserved(self.device), self.buffers.swapped_in(), replay:
                for micro in micros:
                    value = step_seed(self.seed, step, rank, micro)
                    seed_rng(value, self.device)
                    if self.on_seed is not None:
                        self.on_seed(value)
                    state = (autocast or {}).get(micro, AutocastState.off())
                    with torch.enable_grad(), state.applied():
                        loss = self.loss_fn(self.module, inputs[micro])
                    if micro == reported:
                        loss_out = loss.detach()
                    if gradients:
                        scaled = loss * scale.to(loss.device) if scale is not None else loss
                        local_gradients(scaled, self.params, positions, grads)
                    del loss
        finally:
            self.active = False
            if self.on_seed is not None:
                self.on_seed(None)
        return loss_out, grads
