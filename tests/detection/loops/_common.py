"""Shared pieces of the loop-pattern tests: a node per rank, pure data, and the run protocol.

Every pattern test runs, in one process group: a clean run of ``CLEAN_STEPS`` steps with an
audit on every step in loss mode and again in gradient mode (no alarm allowed), then a short
run with one injected fault that must be caught naming the faulty rank. With three ranks on
three nodes a persistent fault of one node is wrong both in its own result and in its replay
of its partner, so the ring audit names that rank alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from detection.guard import SDCGuard

CLEAN_STEPS = 200
FAULT_STEPS = 8
SEED = 11
FAULTY_RANK = 1


@dataclass(frozen=True)
class NodeIdentity:
    """One node per rank, so a node fault is one rank's fault."""

    rank: int

    @property
    def node(self) -> str:
        return f"node-{self.rank}"

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "local_rank": 0, "node": self.node}


def node_fault(kind: str, start: int = 3) -> tuple[str, ...]:
    """A persistent fault of the faulty rank's node from ``start`` on (replays included)."""
    return (f"{kind}@node=node-{FAULTY_RANK}:from={start}",)


def features(step: int, rank: int, micro: int = 0, *, n: int = 8, width: int = 12) -> Any:
    """A pure micro-batch of ``(inputs, class labels)``: a function of its arguments only."""
    g = torch.Generator().manual_seed(100_003 * step + 101 * rank + micro)
    return torch.randn(n, width, generator=g), torch.randint(0, 4, (n,), generator=g)


def summary(guard: SDCGuard) -> dict[str, Any]:
    """What a rank reports back: its alarms and its counters."""
    return {
        "alarms": [
            (a.step, str(a.layer), str(a.phase), list(a.suspect_ranks)) for a in guard.alarms
        ],
        "counters": guard.counters.to_dict(),
        "details": [dict(a.detail) for a in guard.alarms],
    }


def assert_clean(results: list[dict[str, Any]], key: str, steps: int = CLEAN_STEPS) -> None:
    """No alarm, and an audit on every step that passed on every rank."""
    for r in results:
        run = r[key]
        assert run["alarms"] == [], (key, run["alarms"], run["details"])
        assert run["counters"]["steps"] == steps, (key, run["counters"])
        assert run["counters"]["audits"] == steps, (key, run["counters"])


def assert_caught(
    results: list[dict[str, Any]], key: str, layer: str, phase: str, rank: int = FAULTY_RANK
) -> int:
    """The fault run raised alarms, the first naming ``rank`` alone with a finding of the
    given layer and phase naming it too — that alarm's lead, or one that rides along in its
    ``detail.also`` (the per-step layer, armed from the first step, leads an audit that found
    the same step) — the same on every rank. Returns the step of that alarm."""
    alarms = results[0][key]["alarms"]
    assert alarms, f"{key}: the injected fault was not caught"
    step, got_layer, got_phase, suspects = alarms[0]
    assert suspects == [rank], (alarms, results[0][key])
    found = [(got_layer, got_phase, suspects)] + [
        (a["layer"], a["phase"], a["suspect_ranks"])
        for a in results[0][key]["details"][0].get("also", [])
    ]
    assert (layer, phase, [rank]) in found, (alarms, results[0][key])
    assert all(r[key]["alarms"] == alarms for r in results)
    return int(step)
