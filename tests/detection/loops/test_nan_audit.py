"""A NaN-poisoned audit is never recorded as passed (NaN is bit-equal to NaN).

A NaN injected into rank 0's local gradient at step 3 reaches every replica's weights through
the all-reduce; from then on every loss is NaN on every rank, and a replay reproduces that NaN
bit for bit. Those audits are inconclusive: counted as such, posted to the ledger as not
passed, and no checkpoint is verified by them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detection.gate import CheckpointGate
from detection.guard import GuardConfig, SDCGuard
from tests.detection.conftest import run_ranks
from tests.detection.loops._common import SEED, NodeIdentity, features, summary


class _Ledger:
    def __init__(self) -> None:
        self.posts: list[tuple[str, dict[str, Any]]] = []

    def record_checkpoint(self, body: dict[str, Any]) -> None:
        self.posts.append(("checkpoint", body))

    def record_audit(self, body: dict[str, Any]) -> None:
        self.posts.append(("audit", body))


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


def _ranks(rank: int, world: int, directory: str) -> dict[str, Any]:
    torch.manual_seed(SEED)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ledger = _Ledger()
    gate = CheckpointGate(directory, audit_every=1, sink=ledger) if rank == 0 else None
    guard = SDCGuard(
        model,
        optimizer,
        microbatch=features,
        loss_fn=_loss,
        identity=NodeIdentity(rank),
        gate=gate,
        config=GuardConfig(audit_every=1, seed=SEED, inject=("grad-nan@0:3",), halt_on_alarm=False),
    )
    for step in range(8):
        with guard.step(step):
            optimizer.zero_grad(set_to_none=True)
            guard.backward(_loss(model, features(step, rank)))
            optimizer.step()
        if gate is not None and step == 2:
            gate.write(step, lambda path: torch.save(model.state_dict(), path))
    if gate is not None:
        gate.flush()
    guard.close()
    audits = [(b["step"], b["passed"]) for kind, b in ledger.posts if kind == "audit"]
    status = [str(r.status) for r in gate.records] if gate is not None else []
    return {**summary(guard), "audits": audits, "status": status}


def test_a_nan_poisoned_audit_is_not_recorded_as_passed(tmp_path: Path) -> None:
    results = run_ranks(_ranks, 2, str(tmp_path))
    for r in results:
        assert r["alarms"] == [(3, "nonfinite", "pre-allreduce", [0])]  # one event, not six
        counters = r["counters"]
        assert counters["audits"] == 8
        assert counters["audits_passed"] == 3  # steps 0, 1, 2
        assert counters["audits_inconclusive"] == 5  # steps 3..7: NaN everywhere
    ledger = results[0]
    assert ledger["audits"] == [(s, s < 3) for s in range(8)]
    # checkpoint 2 was verified by the audit at step 2, before the NaN
    assert ledger["status"] == ["verified"]
