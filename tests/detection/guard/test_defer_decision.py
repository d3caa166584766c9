"""``GuardConfig(defer_decision=True)``: each step decided at the end of the next one.

The step's row rides in the next step's gradient all-reduce and is read when that step ends (or
all-gathered when the loop flushes first), so the guard runs no collective of its own. What must
not change: the alarms — the same events, naming the same steps and ranks as a guard that
decides at once, raised one step later; every step decided by the time the guard is closed; a
checkpoint recorded only with the fingerprint of its own step. Real rank processes in a gloo
group, the built-in model and faults injected where users meet them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from detection.gate import CheckpointGate, CheckpointStatus, GateError
from detection.guard import GuardConfig, SDCGuard
from detection.simulation.model import ModelConfig, TinyTransformer, loss_fn, make_batch
from detection.stepcheck.gradstats import StatsConfig
from tests.detection.conftest import run_ranks

STEPS = 8
CFG = ModelConfig(vocab=64, d_model=32, n_heads=2, n_layers=1, seq_len=16, batch=4)


def _microbatch(step: int, rank: int) -> Any:
    return make_batch(CFG, 0, step, rank)


def _guarded(
    rank: int,
    defer: bool,
    inject: tuple[str, ...],
    gate: CheckpointGate | None = None,
    bucket_cap_mb: float = 25.0,
) -> tuple[SDCGuard, torch.optim.Optimizer, DistributedDataParallel]:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(TinyTransformer(CFG), bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    config = GuardConfig(defer_decision=defer, inject=inject, stats=StatsConfig(warmup=3))
    guard = SDCGuard(ddp, opt, microbatch=_microbatch, loss_fn=loss_fn, config=config, gate=gate)
    return guard, opt, ddp


def _train(
    rank: int, world: int, defer: bool, inject: tuple[str, ...], bucket_cap_mb: float = 25.0
) -> dict[str, Any]:
    """Train until the guard halts; after each step, what the loop can see of the decisions."""
    guard, opt, ddp = _guarded(rank, defer, inject, bucket_cap_mb=bucket_cap_mb)
    seen: list[tuple[int, bool, int | None]] = []  # (alarms so far, halted, last decided step)
    for step in range(STEPS):
        with guard.step(step):
            opt.zero_grad(set_to_none=True)
            guard.backward(loss_fn(ddp, _microbatch(step, rank)))
            opt.step()
        outcome = guard.last_outcome
        seen.append((len(guard.alarms), guard.halted, outcome.step if outcome else None))
        if guard.halted:
            break
    before_close = guard.counters.steps
    guard.close()
    last = guard.last_outcome
    assert last is not None
    return {
        "seen": seen,
        "decided_before_close": before_close,
        "decided": guard.counters.steps,
        "last": (last.step, last.fingerprint.hex()),
        "alarms": [(a.step, str(a.layer), str(a.phase), a.suspect_ranks) for a in guard.alarms],
    }


# 25 MB: one gradient bucket; 0.01 MB: several, laid out anew by DDP after the first step,
# so the step decided late and the step running then have different buckets.
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.01])
def test_a_clean_run_is_decided_a_step_later_and_whole_at_close(bucket_cap_mb: float) -> None:
    at_once, deferred = (run_ranks(_train, 2, defer, (), bucket_cap_mb) for defer in (False, True))
    for now, late in zip(at_once, deferred, strict=True):
        assert now["alarms"] == late["alarms"] == []
        # at once: each step decided at its end; deferred: the one before it
        assert [s[2] for s in now["seen"]] == list(range(STEPS))
        assert [s[2] for s in late["seen"]] == [None, *range(STEPS - 1)]
        # the last step waits for close(), which decides it
        assert (late["decided_before_close"], late["decided"]) == (STEPS - 1, STEPS)
        # deferring moves the decision, not the training: the same weights, step by step
        assert now["last"] == late["last"]


@pytest.mark.parametrize(
    "inject",
    [
        "weight-flip@1:4",  # a replica's weights diverge: the vote names it
        "grad-nan@1:4",  # a NaN gradient on one rank, applied everywhere
        "reduced-flip@2:4",  # the all-reduce result corrupted on one rank
    ],
)
def test_a_fault_raises_the_same_alarm_one_step_later(inject: str) -> None:
    at_once, deferred = (run_ranks(_train, 3, defer, (inject,)) for defer in (False, True))
    for now, late in zip(at_once, deferred, strict=True):
        assert now["alarms"], f"{inject} was not caught"
        assert late["alarms"] == now["alarms"]  # same step, layer, phase and suspects
        step = now["alarms"][0][0]
        assert step == 4
        # at once: raised and halted at the end of the faulty step
        assert now["seen"][step][:2] == (1, True)
        assert len(now["seen"]) == step + 1
        # deferred: nothing yet at the end of the faulty step, raised and halted one later
        assert late["seen"][step][:2] == (0, False)
        assert late["seen"][step + 1][:2] == (1, True)
        assert len(late["seen"]) == step + 2


def _checkpoints(rank: int, world: int, directory: str) -> dict[str, Any]:
    gate = CheckpointGate(Path(directory) / f"rank-{rank}", audit_every=0)
    guard, opt, ddp = _guarded(rank, True, ("weight-flip@1:5",), gate)

    def writer(path: Path) -> None:
        torch.save(ddp.module.state_dict(), path)

    refused = ""
    fingerprints: dict[int, str] = {}
    for step in range(STEPS):
        with guard.step(step):
            opt.zero_grad(set_to_none=True)
            guard.backward(loss_fn(ddp, _microbatch(step, rank)))
            opt.step()
        if step == 1:
            try:
                gate.write(step, writer)  # step 1 is not decided yet
            except GateError as err:
                refused = str(err)
        if step in (2, 5):
            guard.flush()  # decide the step just run, then write it
            assert guard.last_outcome is not None
            fingerprints[step] = guard.last_outcome.fingerprint.hex()
            gate.write(step, writer)
        if guard.halted:
            break
    guard.close()
    return {
        "refused": refused,
        "records": {r.step: (r.status, r.fingerprint) for r in gate.records},
        "fingerprints": fingerprints,
        "alarms": [a.step for a in guard.alarms],
    }


def test_a_checkpoint_records_its_own_step_and_a_fault_quarantines_it(tmp_path: Path) -> None:
    for result in run_ranks(_checkpoints, 3, str(tmp_path)):
        assert "guard.flush()" in result["refused"]
        records, fingerprints = result["records"], result["fingerprints"]
        assert result["alarms"] == [5]
        # step 2: flushed, written with its own fingerprint, verified by step 3's vote
        assert records[2] == (CheckpointStatus.VERIFIED, fingerprints[2])
        # step 5: written after its own decision named the flipped replica: never verified
        assert records[5][0] is CheckpointStatus.QUARANTINED
        assert 1 not in records


def _scaled(rank: int, world: int) -> list[int | None]:
    guard, opt, ddp = _guarded(rank, True, ())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    decided: list[int | None] = []
    for step in range(4):
        with guard.step(step):
            opt.zero_grad(set_to_none=True)
            guard.backward(loss_fn(ddp, _microbatch(step, rank)), scaler=scaler)
            scaler.step(opt)
            scaler.update()
        decided.append(guard.last_outcome.step if guard.last_outcome else None)
    guard.close()
    return decided


def test_a_step_under_a_grad_scaler_is_decided_at_once() -> None:
    """A partial overflow is resolved by recomputing on the step's own weights, which the next
    step changes: such steps do not wait."""
    for decided in run_ranks(_scaled, 2):
        assert decided == [0, 1, 2, 3]


def _audited(rank: int, world: int, defer: bool, mode: str) -> dict[str, Any]:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(TinyTransformer(CFG))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    config = GuardConfig(
        defer_decision=defer, audit_every=2, audit_mode=mode, calibrate=1, halt_on_alarm=False
    )
    guard = SDCGuard(ddp, opt, microbatch=_microbatch, loss_fn=loss_fn, config=config)
    for step in range(6):
        with guard.step(step):
            opt.zero_grad(set_to_none=True)
            guard.backward(loss_fn(ddp, _microbatch(step, rank)))
            opt.step()
    guard.close()
    c = guard.counters
    return {
        "alarms": len(guard.alarms),
        "counts": (c.steps, c.audits, c.audits_passed, c.calibration_audits),
    }


@pytest.mark.parametrize("mode", ["loss", "gradient"])
def test_ring_audits_and_their_calibration_decide_the_same_a_step_later(mode: str) -> None:
    """A calibration audit's check is a collective of its own, taken with the decision: every
    rank takes it at the same point, one step later, and the audits count as at once."""
    at_once, deferred = (run_ranks(_audited, 2, defer, mode) for defer in (False, True))
    for now, late in zip(at_once, deferred, strict=True):
        assert now["alarms"] == late["alarms"] == 0
        assert now["counts"] == late["counts"]
        steps, audits, passed, calibration = now["counts"]
        assert (steps, audits, calibration) == (6, 3, 1)
        assert passed == audits  # a clean run: every audit passed, calibration ones too
