"""Detection test helpers: real rank processes in a real gloo group on 127.0.0.1.

Ranks are forked from a forkserver with torch preloaded, so a multi-process test pays the
torch import once per test session, not once per rank per test. A rank function must be a
module-level function (it is sent by reference) taking ``(rank, world_size, *args)``; what it
returns comes back pickled, in rank order.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from detection.harness import _PRELOAD, TrainConfig, run


def _rank_main(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, out: str, args: tuple[Any, ...]
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        result: tuple[str, Any] = ("ok", fn(rank, world_size, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    finally:
        dist.destroy_process_group()
    Path(out).write_bytes(pickle.dumps(result))


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return the results."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=60), wait_for_workers=False
    )
    with tempfile.TemporaryDirectory(prefix="sdcguard-test-") as scratch:
        outs = [str(Path(scratch) / f"rank-{r}.pkl") for r in range(world_size)]
        procs = [
            ctx.Process(target=_rank_main, args=(fn, r, world_size, store.port, outs[r], args))
            for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout_s)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        results = []
        failures = []
        for rank, out in enumerate(outs):
            if not Path(out).exists():
                failures.append(f"rank {rank}: no result (exit code {procs[rank].exitcode})")
                continue
            status, value = pickle.loads(Path(out).read_bytes())
            if status != "ok":
                failures.append(f"rank {rank}:\n{value}")
            results.append(value)
    if failures:
        raise AssertionError("\n".join(failures))
    return results


@pytest.fixture(scope="session")
def clean_reference() -> dict[str, Any]:
    """A short clean 4-rank job every fault test compares its final fingerprint against."""
    return run(TrainConfig(world_size=4, steps=10, audit_every=4, seed=3))
