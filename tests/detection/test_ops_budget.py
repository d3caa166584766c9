"""The guard's per-step operations on the torch path a GPU takes, held to their budget.

On a GPU the guard's cost is kernel launches (``benchmarks/ops_per_step.py`` counts them, views
and allocations left out, on a CPU with ``SDCGUARD_NATIVE=0``). The budget: from 2 to 32 blocks
of Linear+LayerNorm the default configuration adds at most 4 operations a step per block, and at
32 blocks at most 30 % of a plain step's. The checksums' rotation (``abft_every``) makes steps
differ by phase, so the counts are means over a period, each period repeating the last op for
op. Full coverage (``abft_every=1``) is held to its own count per block, so that a change which
makes every checked layer launch more shows here too.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

import ops_per_step  # noqa: E402


def test_the_default_adds_at_most_four_ops_per_block_and_30_percent_of_a_plain_step() -> None:
    tables = ops_per_step.table([2, 32], ["default", "abft-full"])
    default, full = tables["default"], tables["abft-full"]
    assert default[0]["period"] == 8  # GuardConfig().abft_every: a period of the rotation
    assert ops_per_step.per_block(default) <= 4.0, default
    deep = default[-1]
    assert deep["added"] <= 0.30 * deep["plain"], deep
    # every layer on every step: the checked layers' own ops, 28.4 a block with the derived
    # rounding bounds of the checks armed from step 0 (24.4 without them, 42.3 before)
    assert ops_per_step.per_block(full) <= 29.0, full


def test_the_sharded_guard_s_operations_are_counted_and_held_to_their_count() -> None:
    """The sharded guard (FSDP2, HSDP 2x1), counted as the DDP guard is, against a plain step
    of the same layout. Its non-finite checks of the gradients and the weights are one
    multi-tensor max each, whatever the depth, and each shard's place in the unsharded
    numbering is computed once per layout, so under HSDP 2x1 (whose one-rank shard groups
    reduce-scatter and all-gather nothing, and whose vote needs no update replay) it does not
    grow with depth at all. Under FSDP2 it grows by what each FSDP module's checked
    reduce-scatter and all-gather add (sums, norms, the gathered view, 30 a block), and by the
    buddy's replay of one slice in eight (``update_replay_every``, on by default there: the
    optimizer's own arithmetic, tensor by tensor, 5 a block). Custody's two fingerprint
    passes (after the update, before the next) are one multi-tensor pass each, the first of
    them also the row's fingerprint (no third pass); the slice's snapshot is one multi-tensor
    copy, and what its update wrote is fingerprinted in one multi-tensor pass on each side:
    none of them grows with depth. Held to today's count (35 a block; 59.5 with the row's own
    pass and a fingerprint, a copy and a comparison per replayed tensor; 78 before the fused
    non-finite check, without the replay), so that a change which adds to it shows."""
    tables = ops_per_step.table([2, 8], ["fsdp", "hsdp"])
    fsdp, hsdp = tables["fsdp"], tables["hsdp"]
    assert fsdp[0]["period"] == hsdp[0]["period"] == 1  # no checksum rotation: steps alike
    assert ops_per_step.per_block(fsdp) <= 35.0, fsdp
    assert ops_per_step.per_block(hsdp) <= 0.0, hsdp
    assert 0 < fsdp[0]["added"] <= 1.5 * fsdp[0]["plain"], fsdp
