"""SDCGuard on a model of the user's own, in real rank processes (4 ranks, gloo).

One run checks several things at once, to keep process start-ups down: a guarded model with
gradient audits on every step trains bitwise like its unguarded twin (no side effect on weights,
BatchNorm statistics, buffers or RNG), composes with the user's own comm hook, and on 2 nodes
picks partners on the other node; a third twin with an injected fault raises the alarm.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from detection.audit.ring import seed_rng, step_seed
from detection.guard import (
    GuardConfig,
    GuardConfigError,
    GuardHaltedError,
    GuardUsageError,
    SDCGuard,
)
from detection.weights.fingerprint import weight_fingerprint
from detection.weights.load_check import LoadVerificationError, verify_after_load
from tests.detection.conftest import run_ranks

STEPS = 12
SEED = 5


class _MultiOutput(nn.Module):
    """Dropout, BatchNorm, a buffer of its own that every forward updates, and two outputs."""

    rows_seen: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 16)
        )
        self.head = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 1)
        self.register_buffer("rows_seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.rows_seen += x.shape[0]
        h = self.body(x)
        return self.head(h), self.aux(h).mean()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    logits, aux = model(batch[0])
    return F.cross_entropy(logits, batch[1]) + 0.1 * aux**2


class _CountingHook:
    def __init__(self) -> None:
        self.calls = 0

    def hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        self.calls += 1
        return allreduce_hook(state, bucket)


@dataclass(frozen=True)
class _Identity:
    rank: int
    node: str

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "local_rank": self.rank % 2, "node": self.node}


def _guarded_step(
    guard: SDCGuard, ddp: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int
) -> None:
    with guard.step(step):
        opt.zero_grad(set_to_none=True)
        guard.backward(_loss(ddp, _batch(step, rank)))
        opt.step()


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as err:
        return type(err).__name__
    return "no error"


def _twins(rank: int, world: int) -> dict[str, Any]:
    identity = _Identity(rank, f"node-{rank // 2}")
    torch.manual_seed(0)
    base = _MultiOutput()
    models = [copy.deepcopy(base) for _ in range(4)]
    ddps = [DistributedDataParallel(m) for m in models]
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    user = _CountingHook()
    guarded = SDCGuard(
        ddps[0],
        opts[0],
        microbatch=_batch,
        loss_fn=_loss,
        identity=identity,
        config=GuardConfig(audit_every=1, audit_mode="gradient", seed=SEED),
        comm_hook=user.hook,
    )
    faulty = SDCGuard(
        ddps[2],
        opts[2],
        microbatch=_batch,
        loss_fn=_loss,
        identity=identity,
        config=GuardConfig(
            audit_every=2,
            audit_mode="loss",
            seed=SEED,
            inject=("act-flip@1:4:22/body.4",),
            halt_on_alarm=True,
        ),
    )
    # the fourth replica votes on its optimizer state too: a state fault is named at its step
    stateful = SDCGuard(
        ddps[3],
        opts[3],
        microbatch=_batch,
        loss_fn=_loss,
        identity=identity,
        config=GuardConfig(
            seed=SEED,
            vote_optimizer_state=True,
            inject=("optim-flip@3:2",),
            halt_on_alarm=False,
        ),
    )
    halted_at = None
    for step in range(STEPS):
        _guarded_step(stateful, ddps[3], opts[3], step, rank)
        _guarded_step(guarded, ddps[0], opts[0], step, rank)
        seed_rng(step_seed(SEED, step, rank), torch.device("cpu"))  # the unguarded twin
        opts[1].zero_grad(set_to_none=True)
        _loss(ddps[1], _batch(step, rank)).backward()
        opts[1].step()
        if not faulty.halted:
            _guarded_step(faulty, ddps[2], opts[2], step, rank)
            halted_at = step if faulty.halted else None
    same_params = all(
        torch.equal(a, b)
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True)
    )
    same_buffers = all(
        torch.equal(a, b) for a, b in zip(models[0].buffers(), models[1].buffers(), strict=True)
    )
    errors = {
        "step_outside": _error(lambda: opts[0].step()),
        "after_halt": _error(lambda: faulty.step(STEPS).__enter__()),
    }
    taken = DistributedDataParallel(copy.deepcopy(base))
    taken.register_comm_hook(None, allreduce_hook)
    errors["hook_taken"] = _error(
        lambda: SDCGuard(taken, opts[1], microbatch=_batch, loss_fn=_loss)
    )
    torch.set_num_threads(2 if rank == 1 else 1)
    other = DistributedDataParallel(copy.deepcopy(base))
    errors["threads_differ"] = _error(
        lambda: SDCGuard(
            other, torch.optim.SGD(other.parameters(), lr=0.1), microbatch=_batch, loss_fn=_loss
        )
    )
    torch.set_num_threads(1)
    # verify-after-load: every replica must hold exactly the recorded weights
    loaded = copy.deepcopy(base)
    if rank == 2:
        with torch.no_grad():
            next(loaded.parameters()).view(-1)[0] += 1.0
    recorded = weight_fingerprint(list(base.parameters()))
    try:
        verify_after_load(list(loaded.parameters()), recorded)
        named: list[int] = []
    except LoadVerificationError as err:
        named = err.ranks
    verified = verify_after_load(list(base.parameters()), recorded.hex())
    return {
        "load_mismatch_ranks": named,
        "load_ok": verified == recorded,
        "same_params": same_params,
        "same_buffers": same_buffers,
        "rows_seen": float(models[0].rows_seen),
        "guarded_alarms": [a.to_report() for a in guarded.alarms],
        "faulty_alarms": [a.to_report() for a in faulty.alarms],
        "stateful_alarms": [a.to_report() for a in stateful.alarms],
        "halted_at": halted_at,
        "partners": guarded.partners,
        "nodes": list(guarded.nodes),
        "user_hook_calls": user.calls,
        "hook_calls": guarded.hook.calls,
        "errors": errors,
    }


def test_guard_on_a_custom_model_in_four_ranks_on_two_nodes() -> None:
    results = run_ranks(_twins, 4)
    for r in results:
        # gradient audits on every step left weights and every buffer exactly as plain DDP had
        assert r["same_params"]
        assert r["same_buffers"]
        assert r["rows_seen"] == 6 * STEPS  # the replays' own forward passes left no count
        assert r["guarded_alarms"] == []  # 48 gradient audits of a clean run: no alarm
        # the user's hook ran under the guard's, once per bucket per step
        assert r["user_hook_calls"] == r["hook_calls"] >= STEPS
    nodes, partners = results[0]["nodes"], results[0]["partners"]
    assert nodes == ["node-0", "node-0", "node-1", "node-1"]
    assert all(nodes[p] != nodes[r] for r, p in enumerate(partners))
    assert sorted(partners) == [0, 1, 2, 3]
    # the fault: one mantissa bit of rank 1's activation at audited step 4 (a finite change);
    # its auditor sits on the other node
    alarm = results[0]["faulty_alarms"]
    auditor = partners.index(1)
    assert nodes[auditor] != nodes[1]
    assert alarm == [
        {
            "step": 4,
            "layer": "audit",
            "phase": "loss",
            "suspect_ranks": sorted([1, auditor]),
            "suspect_nodes": ["node-0", "node-1"],
            "detail": alarm[0]["detail"],
        }
    ]
    assert alarm[0]["detail"]["mismatched_pairs"] == [{"auditor": auditor, "audited": 1}]
    assert all(r["faulty_alarms"] == alarm for r in results)  # every rank decided the same
    assert all(r["halted_at"] == 4 for r in results)
    assert results[0]["errors"] == {
        "step_outside": GuardUsageError.__name__,
        "after_halt": GuardHaltedError.__name__,
        "hook_taken": GuardConfigError.__name__,
        "threads_differ": GuardConfigError.__name__,
    }
    # optimizer state flipped after step 2 on rank 3: named at step 2; the weights that diverge
    # from step 3 on are the same event, not a new alarm
    state_alarms = results[0]["stateful_alarms"]
    assert [(a["step"], a["layer"], a["phase"], a["suspect_ranks"]) for a in state_alarms] == [
        (2, "fingerprint", "weights", [3])
    ]
    assert state_alarms[0]["detail"]["diverged"] == "optimizer_state"
    for r in results:  # a replica that loaded other weights is named on every rank
        assert r["load_mismatch_ranks"] == [2]
        assert r["load_ok"]
