"""Shipping micro-batches to their auditors: nested structures arrive bitwise, around a ring."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from detection.audit.batches import exchange_batches
from tests.detection.conftest import run_ranks


class _Pair(NamedTuple):
    tokens: torch.Tensor
    mask: torch.Tensor


def _batch(rank: int, micro: int) -> Any:
    g = torch.Generator().manual_seed(10 * rank + micro)
    return {
        "pair": _Pair(
            torch.randint(0, 100, (2, 3 + rank), generator=g), torch.rand(2, generator=g) > 0.5
        ),
        "scores": [torch.randn(rank + 1, generator=g, dtype=torch.float64)],
        "name": f"rank-{rank}",
    }


def _ring(rank: int, world: int) -> dict[str, Any]:
    auditor = (rank - 1) % world  # rank r is audited by r-1: r-1 receives from r
    received = exchange_batches(
        {auditor: [_batch(rank, 0), _batch(rank, 1)]}, device=torch.device("cpu")
    )
    # a round where only rank 0 sends (an overflow to resolve on rank 0 alone)
    lone = exchange_batches(
        {auditor: [_batch(rank, 2)]} if rank == 0 else {}, device=torch.device("cpu")
    )
    return {"received": received, "lone": lone}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def test_batches_reach_their_auditors_bitwise() -> None:
    results = run_ranks(_ring, 3)
    for rank, r in enumerate(results):
        source = (rank + 1) % 3
        assert list(r["received"]) == [source]
        got = r["received"][source]
        assert _same(got, [_batch(source, 0), _batch(source, 1)])
        assert isinstance(got[0]["pair"], _Pair)
        assert r["lone"] == ({} if rank != 2 else r["lone"])
    lone = results[2]["lone"]  # rank 2 audits rank 0
    assert list(lone) == [0]
    assert _same(lone[0], [_batch(0, 2)])
