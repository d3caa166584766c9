"""The benchmarks' rank processes: forked from a fork server with torch preloaded, rendezvous
through a store this process serves, rank 0's result read back from a file.

One launcher for every benchmark that measures ranks side by side, so that each measures the
same way (the same start, the same failure rule: any rank that does not exit 0 fails the run).
"""

from __future__ import annotations

import json
import multiprocessing
import tempfile
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["launch_ranks"]


def launch_ranks(
    target: Callable[..., None],
    bench: Any,
    world_size: int,
    *,
    preload: Sequence[str],
    prefix: str,
) -> dict[str, Any]:
    """Run ``target(rank, bench, store_port, out_path)`` in ``world_size`` processes; return
    the JSON rank 0 wrote to ``out_path``."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=120), wait_for_workers=False
    )
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        out = str(Path(scratch) / "result.json")
        procs = [
            ctx.Process(target=target, args=(r, bench, store.port, out)) for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        result: dict[str, Any] = json.loads(Path(out).read_text())
    return result
