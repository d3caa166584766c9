"""Under a GradScaler the per-step statistics are those of the *unscaled* gradient.

The comm hook sees scaled buckets; the per-step layer divides their statistics by the scale the
step's backward used. Two runs of the same job, one at a fixed scale and one whose scale jumps
by up to 2^16 between steps, compute the same unscaled gradients (a power-of-two scale is
exact), so with the division they learn exactly the same history for every rank and statistic
and raise nothing. Without it the histories would differ by the log of the scale — a jump every
rank sees at once, which the all-ranks rule of the temporal test forgives, so only the learnt
history can show it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detection.guard import GuardConfig, SDCGuard
from detection.weights.fingerprint import weight_fingerprint
from tests.detection.conftest import run_ranks
from tests.detection.loops._common import features

STEPS = 28  # past the 25-step warm-up: the temporal test speaks on the last steps


def _run(rank: int, jumping: bool) -> dict[str, Any]:
    torch.manual_seed(5)
    module = nn.Sequential(nn.Linear(12, 48), nn.GELU(), nn.Linear(48, 4))
    model = DistributedDataParallel(module)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=10**6)
    guard = SDCGuard(
        model,
        optimizer,
        microbatch=features,
        loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
        config=GuardConfig(seed=5, halt_on_alarm=False),
    )
    scales = []
    for step in range(STEPS):
        with guard.step(step):
            optimizer.zero_grad(set_to_none=True)
            inputs, labels = features(step, rank)
            guard.backward(F.cross_entropy(model(inputs), labels), scaler=scaler)
            scales.append(scaler.get_scale())
            scaler.step(optimizer)
            scaler.update(2.0 ** (4 + (7 * step) % 17) if jumping else None)
    guard.close()
    return {
        "alarms": [(a.step, str(a.layer), list(a.suspect_ranks)) for a in guard.alarms],
        "history": guard.checks.detector.history(),
        "tested": guard.checks.tested_steps,
        "scales": scales,
        "weights": weight_fingerprint(list(module.parameters())).hex(),
    }


def _both(rank: int, _world: int) -> dict[str, dict[str, Any]]:
    return {"fixed": _run(rank, jumping=False), "jumping": _run(rank, jumping=True)}


def test_a_jumping_scale_leaves_the_statistics_and_their_history_unchanged() -> None:
    results = run_ranks(_both, 2, timeout_s=300)
    for per in results:
        fixed, jumping = per["fixed"], per["jumping"]
        assert len(set(jumping["scales"])) > 10
        assert set(fixed["scales"]) == {16.0}
        assert fixed["alarms"] == jumping["alarms"] == []
        assert fixed["tested"] == jumping["tested"] == STEPS
        assert fixed["weights"] == jumping["weights"]  # the same unscaled gradients
        history = fixed["history"]
        assert {name for _, name in history} >= {"loss", "l2[0]", "amax[0]"}
        assert history.keys() == jumping["history"].keys()
        for key, (mean, dev, n) in history.items():
            assert n == STEPS
            assert jumping["history"][key] == pytest.approx((mean, dev, n), rel=1e-9, abs=1e-12)
