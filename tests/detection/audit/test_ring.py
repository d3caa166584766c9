"""Ring audit pieces that need no process group: partner choice, attribution, replay hygiene."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from torch import nn

from detection.audit.ring import (
    AuditMode,
    PartnerRecompute,
    attribute_audit,
    auditors_of,
    encode_loss,
    gradient_fingerprint,
    ring_order,
    ring_partners,
    seed_rng,
    step_seed,
)
from detection.simulation.model import ModelConfig, TinyTransformer, loss_fn, make_batch


@pytest.mark.parametrize("n", range(2, 8))
def test_partners_form_one_ring_without_same_node_pairs_when_possible(n: int) -> None:
    for labels in itertools.product(range(3), repeat=n):
        nodes = [f"n{x}" for x in labels]
        partners = ring_partners(nodes)
        # a single cycle through every rank: each rank audited exactly once
        seen, rank = [], 0
        for _ in range(n):
            seen.append(rank)
            rank = partners[rank]
        assert rank == 0, nodes
        assert sorted(seen) == list(range(n)), nodes
        assert sorted(auditors_of(partners)) == list(range(n))
        largest = max(Counter(nodes).values())
        same = sum(nodes[r] == nodes[p] for r, p in enumerate(partners))
        if largest <= n // 2:
            assert same == 0, (nodes, partners)
        elif largest < n:
            # only the surplus of the biggest node can be forced onto itself
            assert same == 2 * largest - n, (nodes, partners)


def test_ring_examples() -> None:
    assert ring_order(["a", "a", "b", "b"]) == [0, 2, 1, 3]
    assert ring_partners(["a", "a", "b", "b"]) == [2, 3, 1, 0]
    assert ring_partners(["a", "b", "c", "d"]) == [2, 3, 1, 0]
    assert ring_partners(["solo"]) == [0]
    assert ring_partners(["a", "b"]) == [1, 0]


def test_attribution_persistent_fault_names_the_rank_in_both_roles() -> None:
    partners = [2, 3, 1, 0]  # ring 0 -> 2 -> 1 -> 3 -> 0
    own = [[10], [11], [99], [13]]  # rank 2's own result is wrong...
    replay = [[12], [13], [77], [10]]  # ...and so is its recomputation of rank 1
    verdict = attribute_audit(partners, own, replay)
    assert verdict.mismatches == ((0, 2), (2, 1))
    assert verdict.suspects == (2,)
    assert not verdict.passed


def test_attribution_single_pair_names_both_sides() -> None:
    partners = [2, 3, 1, 0]
    own = [[10], [11], [99], [13]]
    replay = [[12], [13], [11], [10]]
    verdict = attribute_audit(partners, own, replay)
    assert verdict.mismatches == ((0, 2),)
    assert verdict.suspects == (0, 2)


def test_attribution_clean_passes() -> None:
    own = [[1, 2, 3], [4, 5, 6]]
    assert attribute_audit([1, 0], own, [own[1], own[0]]).passed


def test_step_seeds_are_distinct_and_stable() -> None:
    seeds = {step_seed(0, s, r) for s in range(50) for r in range(8)}
    assert len(seeds) == 400
    assert step_seed(1, 2, 3) == step_seed(1, 2, 3) != step_seed(2, 2, 3)


def _model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(ModelConfig())


@pytest.mark.parametrize("mode", [AuditMode.LOSS, AuditMode.GRADIENT])
def test_replay_reproduces_the_original_and_leaves_no_trace(mode: AuditMode) -> None:
    """The replay (here of rank 1's own micro-batch) returns exactly the original loss and
    gradient fingerprint, and afterwards RNG, BatchNorm statistics and .grad are as found."""
    cfg = ModelConfig()
    model = _model()

    def microbatch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return make_batch(cfg, 0, step, rank)

    replay = PartnerRecompute(
        model, loss_fn=loss_fn, microbatch=microbatch, mode=mode, seed=0, partner=1, injector=None
    )
    params = list(model.parameters())
    partition = [list(range(len(params)))[::-1][:5], list(range(len(params)))[::-1][5:]]
    # the original step of rank 1: seeded, buffers snapshot at the start of its forward
    seed_rng(step_seed(0, 7, 1), torch.device("cpu"))
    replay.buffers.capture()
    loss = loss_fn(model, microbatch(7, 1))
    loss.backward()
    grads = [p.grad for p in params]
    grad_values = [g.clone() for g in grads]  # type: ignore[union-attr]
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()

    value = replay.run(7, partition).tolist()

    assert value[0] == encode_loss(loss).item()
    if mode is AuditMode.GRADIENT:
        assert value[1:] == gradient_fingerprint(partition, grad_values, params).tolist()
        assert value[1:] != [0, 0]
    else:
        assert value[1:] == [0, 0]
    assert torch.equal(torch.get_rng_state(), rng)
    for name, buf in model.named_buffers():
        assert torch.equal(buf, buffers[name]), name
    assert dict(model.named_buffers())["blocks.0.norm2.num_batches_tracked"].item() == 1
    for p, g, v in zip(params, grads, grad_values, strict=True):
        assert p.grad is g
        assert torch.equal(p.grad, v)  # type: ignore[arg-type]


def test_replay_with_another_seed_differs_because_dropout_is_live() -> None:
    cfg = ModelConfig()
    model = _model()
    replay = PartnerRecompute(
        model,
        loss_fn=loss_fn,
        microbatch=lambda s, r: make_batch(cfg, 0, s, r),
        mode=AuditMode.LOSS,
        seed=0,
        partner=1,
        injector=None,
    )
    seed_rng(step_seed(0, 7, 1), torch.device("cpu"))
    replay.buffers.capture()
    loss = loss_fn(model, make_batch(cfg, 0, 7, 1))
    other = PartnerRecompute(
        model,
        loss_fn=loss_fn,
        microbatch=lambda s, r: make_batch(cfg, 0, s, r),
        mode=AuditMode.LOSS,
        seed=1,
        partner=1,
        injector=None,
    )
    other.buffers.capture()
    assert other.run(7, []).tolist()[0] != encode_loss(loss).item()
    assert replay.run(7, []).tolist()[0] == encode_loss(loss).item()


class _Counting(nn.Module):
    calls: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


def test_replay_refuses_to_run_without_a_buffer_snapshot() -> None:
    model = _Counting()
    replay = PartnerRecompute(
        model,
        loss_fn=lambda m, b: m(b).sum(),
        microbatch=lambda s, r: torch.ones(2, 3),
        mode=AuditMode.LOSS,
        seed=0,
        partner=0,
        injector=None,
    )
    with pytest.raises(RuntimeError, match="no buffer snapshot"):
        replay.run(0, [])
    replay.buffers.capture()
    replay.run(0, [])
    assert model.calls.item() == 0  # the replay's own buffer update went to the copy
