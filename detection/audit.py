"""Ring re-execution audit: every audited step, each rank recomputes a partner's micro-batch.

A finite corruption of a local gradient before all-reduce is averaged into every replica, so the
replicas stay equal and no fingerprint sees it; only recomputing the same micro-batch elsewhere
and comparing does. The recomputation is evidence only if it reproduces the original exactly:

* the same micro-batch — the user's ``microbatch(step, rank)`` is a pure function;
* the same dropout mask — the original forward runs right after :func:`seed_rng` with
  :func:`step_seed` ``(seed, step, rank)``; the replay seeds the partner's value and restores
  the caller's RNG state afterwards;
* the same weights — the replay runs before ``optimizer.step`` (the guard calls it from the
  optimizer's step pre-hook);
* the same buffers and no side effects on them — buffers are snapshot when the original forward
  starts (after DDP's buffer broadcast) and swapped in, by reference, for the replay; the live
  buffers are swapped back afterwards, so BatchNorm running statistics see exactly one update;
* no side effect on ``.grad`` — gradient replays run with the ``.grad`` references moved aside
  and put back, no copy;
* the same kernels — on CPU bitwise equality across processes needs the same intra-op thread
  count (the guard checks it); gradient mode also turns on deterministic algorithms;
* the unwrapped module — so no extra all-reduce fires.

Partners form a single ring (one cycle through all ranks) so every rank is audited exactly once
and a rank that is wrong both in its own result and in its recomputation of its partner stands
out; the ring alternates nodes, so a partner is never on the same node while another node can
take that place.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from detection.attribution import attribute_pairs
from detection.faults import FaultInjector
from detection.fingerprint import fingerprint_on_device

__all__ = [
    "AuditMode",
    "AuditVerdict",
    "BufferSnapshot",
    "PartnerReplay",
    "attribute_audit",
    "auditors_of",
    "encode_loss",
    "ring_order",
    "ring_partners",
    "seed_rng",
    "step_seed",
]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
MicroBatch = Callable[[int, int], Any]


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
def step_seed(seed: int, step: int, rank: int) -> int:
    """The dropout seed of ``rank``'s micro-batch at ``step``: a hash, so neighbouring
    (step, rank) pairs get unrelated streams."""
    digest = hashlib.blake2b(f"{seed}:{step}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seed_rng(value: int, device: torch.device) -> None:
    """Seed the generators a forward pass on ``device`` draws from: the CPU generator and, for
    a CUDA device, that device's generator (only that one, so other devices are untouched)."""
    torch.default_generator.manual_seed(value)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(value)


@contextlib.contextmanager
def _rng_preserved(device: torch.device) -> Iterator[None]:
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)


# -- buffers --------------------------------------------------------------------------------------
class BufferSnapshot:
    """The module's buffers as they were when the original forward started.

    Taking it costs one copy of the buffers (BatchNorm statistics: tiny next to the weights);
    using it costs nothing: the copies are swapped in by reference and the live buffers swapped
    back, so the replay's own running-statistics update lands in the throw-away copy.
    """

    def __init__(self, module: nn.Module) -> None:
        self._slots = [
            (owner, name)
            for owner in module.modules()
            for name, buf in owner._buffers.items()
            if buf is not None
        ]
        self._copies: list[torch.Tensor] | None = None

    @property
    def empty(self) -> bool:
        return not self._slots

    def capture(self) -> None:
        with torch.no_grad():
            self._copies = [owner._buffers[name].clone() for owner, name in self._slots]  # type: ignore[union-attr]

    def clear(self) -> None:
        self._copies = None

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        if not self._slots:
            yield
            return
        if self._copies is None:
            raise RuntimeError("no buffer snapshot was taken for this step")
        live = [owner._buffers[name] for owner, name in self._slots]
        for (owner, name), copy in zip(self._slots, self._copies, strict=True):
            owner._buffers[name] = copy
        try:
            yield
        finally:
            for (owner, name), tensor in zip(self._slots, live, strict=True):
                owner._buffers[name] = tensor
            self._copies = None


# -- values and attribution ------------------------------------------------------------------------
def encode_loss(loss: torch.Tensor) -> torch.Tensor:
    """A scalar loss as its exact float64 bit pattern in an int64 (on device, no sync)."""
    return loss.detach().reshape(()).to(torch.float64).reshape(1).view(torch.int64)


@dataclass(frozen=True)
class AuditVerdict:
    """Outcome of one ring audit. ``mismatches``: (auditor, audited) pairs whose recomputation
    disagreed with the original; ``suspects``: the ranks of the smallest node set explaining
    them (see :mod:`detection.attribution`)."""

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
    (:func:`detection.attribution.attribute_pairs`): a persistent fault is wrong in both roles
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


class PartnerReplay:
    """Recomputes the partner's micro-batch of an audited step on the unwrapped module."""

    def __init__(
        self,
        module: nn.Module,
        *,
        loss_fn: LossFn,
        microbatch: MicroBatch,
        mode: AuditMode,
        seed: int,
        partner: int,
        injector: FaultInjector | None,
    ) -> None:
        self.module = module
        self.loss_fn = loss_fn
        self.microbatch = microbatch
        self.mode = mode
        self.seed = seed
        self.partner = partner
        self.injector = injector
        self.params = list(module.parameters())
        self.device = self.params[0].device
        self.buffers = BufferSnapshot(module)

    def run(self, step: int, partition: Sequence[Sequence[int]]) -> torch.Tensor:
        """Return ``[loss bits, gradient fingerprint a, b]`` (int64, on device) of the
        partner's micro-batch at ``step``, leaving RNG, buffers and ``.grad`` as found."""
        batch = self.microbatch(step, self.partner)
        replay = self.injector.replaying() if self.injector else contextlib.nullcontext()
        with _rng_preserved(self.device), self.buffers.swapped_in(), replay, torch.enable_grad():
            seed_rng(step_seed(self.seed, step, self.partner), self.device)
            if self.mode is AuditMode.LOSS:
                loss = self.loss_fn(self.module, batch)
                grad_fp = torch.zeros(2, dtype=torch.int64, device=self.device)
            else:
                loss, grad_fp = self._forward_backward(batch, partition)
        return torch.cat([encode_loss(loss), grad_fp])

    def _forward_backward(
        self, batch: Any, partition: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        try:
            loss = self.loss_fn(self.module, batch)
            loss.backward()
            grads = [p.grad for p in self.params]
            if self.injector is not None:
                self.injector.on_local_gradient(
                    [(i, g) for i, g in enumerate(grads) if g is not None]
                )
            return loss.detach(), gradient_fingerprint(partition, grads, self.params)
        finally:
            for p, g in zip(self.params, saved, strict=True):
                p.grad = g
