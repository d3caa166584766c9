"""The command line of ``sdcguard train`` (``python -m detection.harness`` in a training image).

Returns 0 when the job ran (alarms are results, not errors), 2 for bad options, 1 when the job
failed, 143 when stopped by SIGTERM; prints a one-line summary of the report.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Any

from detection.simulation.config import HarnessConfigError, HarnessError, TrainConfig
from detection.simulation.launch import run
from detection.simulation.parallel import audit_every_of, mesh_shape
from detection.simulation.termination import TERMINATED, Terminated, unwind_on_sigterm
from detection.simulation.train_args import parse_config

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``sdcguard train``. Returns 0 when the job ran (alarms are results, not errors), 2 for
    bad options, 1 when the job failed, 143 when stopped by SIGTERM."""
    try:
        config = parse_config(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0) if not isinstance(exit_.code, str) else 2
    try:
        with _sigterm_unwinds():
            report = run(config)
    except HarnessConfigError as err:
        print(f"sdcguard train: {err}", file=sys.stderr)
        return 2
    except HarnessError as err:
        print(f"sdcguard train: failed: {err}", file=sys.stderr)
        return 1
    except Terminated:
        print("sdcguard train: stopped by SIGTERM", file=sys.stderr)
        return TERMINATED
    print(summary(config, report))
    return 0


def summary(config: TrainConfig, report: dict[str, Any]) -> str:
    """The one line ``sdcguard train`` prints about its report."""
    alarms = report["alarms"]
    first = ""
    if alarms:
        a = alarms[0]
        first = (
            f" (first: {a['layer']}/{a['phase']} at step {a['step']}, suspects "
            f"{a['suspect_ranks'] or 'unknown'})"
        )
    ckpts = report["checkpoints"]
    verified = sum(1 for c in ckpts if c["status"] == "verified")
    mode = _mode(config)
    return (
        f"sdcguard train {config.job}: {report['world_size']} ranks on "
        f"{len(set(report['nodes'].values()))} node(s), {report['steps']} steps, {mode}: "
        f"{len(alarms)} alarm(s){first}, {len(ckpts)} checkpoint(s) ({verified} verified), "
        f"final fingerprint {report['final_fingerprint']}, step "
        f"{report['step_ms']['median']:.1f} ms median"
    )


def _mode(config: TrainConfig) -> str:
    """How the job ran: plain or guarded, its layout, its ring audit."""
    layout = {"ddp": "DDP", "fsdp": "FSDP2", "hsdp": "HSDP"}.get(config.parallel, config.parallel)
    if config.plain:
        return f"plain {layout}"
    if config.parallel == "ddp":
        return f"audit every {config.audit_every} ({config.audit_mode})"
    every = audit_every_of(config)
    audit = f"audit every {every} ({config.audit_mode})" if every else "no ring audit"
    return f"{layout} mesh {mesh_shape(config)}, {audit}"


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    try:
        previous = signal.signal(signal.SIGTERM, unwind_on_sigterm)
    except ValueError:  # not the main thread: leave signal handling to the caller
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
