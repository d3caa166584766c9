"""Small builders shared by the ledger tests."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar, cast

import sqlalchemy as sa

from db import AlarmIn, Ledger, RankIn
from db.models import Base

_T = TypeVar("_T")

SHA_A = "a" * 64
SHA_B = "b" * 64
FP = "0123456789abcdef0123456789abcdef"


def make_alarm(
    job_id: str = "job-1",
    step: int = 37,
    *,
    alarm_id: str | None = None,
    rank: int = 0,
    node: str = "node-0",
    suspect_nodes: Sequence[str] = ("node-2",),
    suspect_ranks: Sequence[int] = (2,),
    layer: str = "audit",
    phase: str = "loss",
    detail: dict[str, Any] | None = None,
) -> AlarmIn:
    return AlarmIn(
        alarm_id=alarm_id or str(uuid.uuid4()),
        job_id=job_id,
        step=step,
        rank=rank,
        node=node,
        layer=layer,
        phase=phase,
        suspect_ranks=list(suspect_ranks),
        suspect_nodes=list(suspect_nodes),
        detail=detail if detail is not None else {"delta": 1.5},
        sent_at=datetime(2025, 1, 1, 12, 0, tzinfo=UTC),
    )


def register(ledger: Ledger, job_id: str = "job-1", world_size: int = 4) -> None:
    ledger.register_ranks(
        job_id,
        [
            RankIn(rank=r, local_rank=0, node=f"node-{r}", instance_id=f"i-{r}")
            for r in range(world_size)
        ],
    )


def checkpoint(ledger: Ledger, step: int, job_id: str = "job-1", sha256: str = SHA_A) -> None:
    ledger.record_checkpoint(job_id, step, f"s3://ckpts/ckpt-{step:06d}.pt", sha256, FP, ["node-0"])


def statuses(ledger: Ledger, job_id: str = "job-1") -> dict[int, str]:
    """Step → status of the newest record at that step."""
    return {view.step: view.status.value for view in ledger.list_checkpoints(job_id)}


def row_counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {
            table.name: conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
            for table in Base.metadata.sorted_tables
        }


def run_concurrently(n: int, work: Callable[[int], _T]) -> list[_T]:
    """Run ``work(i)`` on ``n`` threads released together; re-raise the first failure."""
    barrier = threading.Barrier(n)
    results: list[_T | None] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = work(i)
        except BaseException as err:  # collected and re-raised in the main thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if errors:
        raise errors[0]
    assert not any(thread.is_alive() for thread in threads), "a worker thread hung"
    return cast("list[_T]", results)
