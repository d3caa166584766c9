"""The host-synchronisation budget of a guarded step: one read-back per step, nothing else.

On a GPU the profiler counts the synchronisations (``benchmarks/cuda_syncs.py``); here
:class:`host_reads.HostReads` (``benchmarks/host_reads.py``) counts the calls that cause them,
including those made
inside backward (DDP's comm hook, where the per-step layer and the ABFT checks run). A
synchronisation added there once cost two per bucket on CUDA and no CPU test saw it. The guard
runs its device path here (the C kernels off, as on a GPU): with them a CPU job reads its row's
scalars on the host by design (:mod:`detection.row.words`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.host_reads import HostReads
from detection import native
from detection.audit.ring import seed_rng, step_seed
from detection.guard import GuardConfig, SDCGuard
from detection.simulation.model import ModelConfig, TinyTransformer, loss_fn, make_batch
from tests.detection.conftest import run_ranks

WARMUP = 3
STEPS = 6


# -- the counter itself --------------------------------------------------------------------------
def test_counts_each_kind_once_and_not_work_on_a_host_copy() -> None:
    x = torch.randn(16)
    lengths = torch.tensor([6, 10])
    with HostReads() as reads:
        x.sum().item()
        bool(x.amax() > 0)
        x.tolist()
        copy = x.cpu()
        copy.tolist()  # already on the host: not a second read-back
        copy.sum().item()
        x.nonzero()
        x[x > 0]
        torch.segment_reduce(x, "max", lengths=lengths)
        torch.segment_reduce(x, "max", lengths=lengths, unsafe=True)  # no host check
        torch.tensor([1.0, 2.0], device="cpu")
        x.mul(2).add_(1).sum()  # device work only
    assert reads.counts == {
        "read back (item)": 2,
        "read back (tolist)": 1,
        "read back (cpu)": 1,
        "synchronises inside (nonzero)": 1,
        "synchronises inside (index)": 1,
        "synchronises inside (segment_reduce)": 1,
        "host to device (tensor)": 1,
    }


def test_sees_inside_backward_hooks() -> None:
    w = torch.randn(4, requires_grad=True)
    seen: list[float] = []
    w.register_hook(lambda g: seen.append(g.sum().item()))
    with HostReads() as reads:
        (w * 3).sum().backward()
    assert seen
    assert reads.counts["read back (item)"] == 1


# -- the guard's budget ----------------------------------------------------------------------------
class _PlainParts(nn.Module):
    """A model of plain torch.nn parts, several checked layers in one gradient bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Sequential(
            nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 16)
        )
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 50)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.body(self.embed(tokens)).mean(1)
        return self.head(self.norm(h))


def _plain_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 101 + rank)
    return torch.randint(0, 50, (8, 5), generator=g), torch.randint(0, 50, (8,), generator=g)


def _plain_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, labels = batch
    return F.cross_entropy(model(tokens), labels)


def _budget(rank: int, world: int, model_name: str, config: dict[str, Any]) -> dict[str, Any]:
    # The budget is the device path's, the one a GPU runs. With the C kernels a CPU job builds
    # its row from host numbers instead (detection.row.words), where a read is a memory load.
    native.set_enabled(False)
    if model_name == "builtin":
        cfg = ModelConfig()

        def make() -> nn.Module:
            return TinyTransformer(cfg)

        def microbatch(step: int, r: int) -> Any:
            return make_batch(cfg, 0, step, r)

        loss: Any = loss_fn
    else:
        make, loss = _PlainParts, _plain_loss
        microbatch = _plain_batch  # type: ignore[assignment]
    torch.manual_seed(0)
    plain_ddp = DistributedDataParallel(make())
    plain_opt = torch.optim.AdamW(plain_ddp.parameters(), lr=1e-3)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(make())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    guard = SDCGuard(ddp, opt, microbatch=microbatch, loss_fn=loss, config=GuardConfig(**config))

    def plain(step: int) -> None:
        seed_rng(step_seed(0, step, rank), torch.device("cpu"))
        plain_opt.zero_grad(set_to_none=True)
        loss(plain_ddp, microbatch(step, rank)).backward()
        plain_opt.step()

    def guarded(step: int) -> None:
        with guard.step(step):
            opt.zero_grad(set_to_none=True)
            guard.backward(loss(ddp, microbatch(step, rank)))
            opt.step()

    for step in range(WARMUP):
        plain(step)
        guarded(step)
    guard.flush()  # the warm-up decided whole, so the counted steps are exactly those below
    with HostReads() as base:
        for step in range(WARMUP, WARMUP + STEPS):
            plain(step)
    with HostReads() as reads:
        for step in range(WARMUP, WARMUP + STEPS):
            guarded(step)
        guard.flush()  # a deferred decision reads the last step's gather here
    return {
        "base": dict(base.counts),
        "guarded": dict(reads.counts),
        "alarms": len(guard.alarms),
        "abft": guard.checks.abft is not None,
    }


@pytest.mark.parametrize(
    ("model_name", "config", "per_step"),
    [
        ("builtin", {}, 1),  # the defaults: ABFT checksums and the per-step layer on
        ("plain-parts", {}, 1),
        ("plain-parts", {"audit_every": 2, "audit_mode": "gradient"}, 1),
        ("plain-parts", {"vote_optimizer_state": True}, 1),
        # read one step later, still once a step
        ("plain-parts", {"defer_decision": True}, 1),
        # deciding before the update takes its own all-gather at the end of the last backward
        ("plain-parts", {"skip_update_on_alarm": True}, 2),
    ],
)
def test_a_guarded_step_reads_back_once(
    model_name: str, config: dict[str, Any], per_step: int
) -> None:
    for result in run_ranks(_budget, 2, model_name, config):
        base, guarded = result["base"], result["guarded"]
        added = {k: guarded.get(k, 0) - base.get(k, 0) for k in set(base) | set(guarded)}
        added = {k: v for k, v in added.items() if v}
        assert result["alarms"] == 0
        assert result["abft"]  # on by default for an eager model: its checks run in the hook
        assert not any(k.startswith("synchronises inside") for k in guarded), guarded
        assert added == {"read back (cpu)": per_step * STEPS}  # the gathered rows
