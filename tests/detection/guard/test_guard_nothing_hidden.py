"""Nothing hidden: faults right after a skipped NaN step, after a divergence without a majority,
in BatchNorm running statistics, and a whole node's fault — in real rank processes (gloo).

One 4-rank run drives several guarded replicas of one tiny BatchNorm model side by side, each
with its own scenario, plus a clean one that must raise nothing.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detection import native
from detection.faults.injector import flip_bit_
from detection.guard import GuardConfig, GuardHaltedError, SDCGuard
from detection.harness import TrainConfig, run
from detection.row.words import on_host
from tests.detection.conftest import run_ranks

STEPS = 8


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _flip_weight(module: nn.Module, bit: int = 30) -> None:
    with torch.no_grad():
        flip_bit_(next(module.parameters()).view(-1), 3, bit)


def _flip_low_bit(module: nn.Module) -> None:
    """A mantissa bit: the replicas drift apart without ever going non-finite."""
    _flip_weight(module, bit=12)


def _flip_running_mean(module: nn.Module) -> None:
    bn = module[1]
    assert isinstance(bn, nn.BatchNorm1d)
    assert bn.running_mean is not None
    flip_bit_(bn.running_mean, 2, 30)


class _Replica:
    def __init__(self, base: nn.Module, **config: Any) -> None:
        self.module = copy.deepcopy(base)
        self.ddp = DistributedDataParallel(self.module)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.guard = SDCGuard(
            self.ddp, self.opt, microbatch=_batch, loss_fn=_loss, config=GuardConfig(**config)
        )

    def step(self, step: int, rank: int, *, nan_on: int | None = None, after: Any = None) -> None:
        """One step of a user's loop that skips the update when the grad norm is non-finite."""
        if self.guard.halted:
            return
        with self.guard.step(step):
            self.opt.zero_grad(set_to_none=True)
            loss = _loss(self.ddp, _batch(step, rank))
            if nan_on == rank:
                loss = loss * float("nan")
            self.guard.backward(loss)
            norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
            if torch.isfinite(norm):
                self.opt.step()
            if after is not None:
                after(self.module)

    def alarms(self) -> list[tuple[int, str, str, list[int]]]:
        return [
            (a.step, str(a.layer), str(a.phase), list(a.suspect_ranks)) for a in self.guard.alarms
        ]


def _scenarios(rank: int, world: int, row: str = "host") -> dict[str, Any]:
    # "host": the C kernels on, and the step's row read on the host (detection.row.words);
    # "device": the path a GPU runs, every value kept in a tensor. The two must decide alike.
    native.set_enabled(row == "host")
    assert on_host(torch.device("cpu")) == (row == "host")
    torch.manual_seed(0)
    base = _model()
    clean = _Replica(base)
    skipped = _Replica(base, halt_on_alarm=False)
    tie = _Replica(base, halt_on_alarm=False, audit_every=1)
    halting = _Replica(base)  # the default: halt on the first alarm
    bn = _Replica(base, halt_on_alarm=False)
    for step in range(STEPS):
        clean.step(step, rank)
        # NaN gradient on rank 1 at step 2, skipped by the loop; rank 2's weight flips at 3
        skipped.step(
            step,
            rank,
            nan_on=1 if step == 2 else None,
            after=_flip_weight if (step, rank) == (3, 2) else None,
        )
        # step 1: ranks 2 and 3 flip the same bit (a 2-2 tie, no majority); step 4: rank 0 too
        flips = {(1, 2), (1, 3), (4, 0)}
        for replica in (tie, halting):
            replica.step(step, rank, after=_flip_low_bit if (step, rank) in flips else None)
        # a running-mean flip on rank 0 (DDP broadcasts it) at 2, on rank 3 (overwritten) at 4
        bn.step(step, rank, after=_flip_running_mean if (step, rank) in {(2, 0), (4, 3)} else None)
        if (step, rank) == (5, 0):  # and between two steps, where the broadcast would spread it
            _flip_running_mean(bn.module)
    refused = "no error"
    try:
        halting.guard.step(STEPS).__enter__()
    except GuardHaltedError:
        refused = "GuardHaltedError"
    return {
        "clean": clean.alarms(),
        "skipped": skipped.alarms(),
        "tie": tie.alarms(),
        "tie_known": [sorted(c) for c in tie.guard.decision.known.classes],
        "halting": halting.alarms(),
        "halted": halting.guard.halted,
        "refused": refused,
        "bn": bn.alarms(),
        "bn_detail": [dict(a.detail) for a in bn.guard.alarms],
        "bn_vote_passed": bn.guard.last_outcome is not None and bn.guard.last_outcome.vote_passed,
    }


@pytest.mark.parametrize("row", ["host", "device"])
def test_faults_the_guard_used_to_hide_are_caught_and_a_clean_run_raises_nothing(row: str) -> None:
    results = run_ranks(_scenarios, 4, row)
    assert all(r == results[0] for r in results[1:])  # every rank decided the same
    r = results[0]
    assert r["clean"] == []
    # The skipped NaN step is its own alarm and poisons nothing: the flip right after is caught.
    assert r["skipped"] == [
        (2, "nonfinite", "pre-allreduce", [1]),
        (3, "fingerprint", "weights", [2]),
    ]
    # A 2-2 tie names no culprit; the later split inside a class is a new event, not "known".
    assert r["tie"][0] == (1, "fingerprint", "weights", [])
    assert r["tie"][1][:2] == (4, "fingerprint")
    assert len(r["tie"]) == 2
    assert r["tie_known"] == [[0], [1], [2, 3]]
    # halt_on_alarm is on by default: the same job stops after its first alarm.
    assert r["halting"] == [(1, "fingerprint", "weights", [])]
    assert r["halted"]
    assert r["refused"] == "GuardHaltedError"
    # BatchNorm running statistics: after the last forward on the broadcasting rank and on
    # another rank, and between two steps on rank 0.
    assert r["bn"] == [
        (2, "fingerprint", "weights", [0]),
        (4, "fingerprint", "weights", [3]),
        (6, "fingerprint", "weights", [0]),
    ]
    assert r["bn_detail"][0]["buffers_changed_after_forward"] == [0]
    assert r["bn_detail"][2]["buffers_changed_between_steps"] == [0]
    assert r["bn_vote_passed"]  # the last step is clean again


def test_a_node_fault_on_four_nodes_of_two_ranks_names_that_node_alone() -> None:
    report = run(
        TrainConfig(
            world_size=8,
            ranks_per_node=2,
            steps=3,
            audit_every=2,
            seed=3,
            halt_on_alarm=True,
            inject=["act-flip@node=node-1:from=1"],
        )
    )
    # the per-step layer is armed from the first step: the node's two ranks are named on the
    # fault's own step by their checksums, before the audit at step 2 (the halt ends the job)
    assert [
        (a["step"], a["layer"], a["suspect_ranks"], a["suspect_nodes"]) for a in report["alarms"]
    ] == [(1, "abft", [2, 3], ["node-1"])]
