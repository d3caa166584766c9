"""What every end-to-end demo test checks: the report's shape, the stages, the exact recovery,
the stop of the faulty job, and that no process of the run is left.

A shorter run than ``make demo`` (fewer steps), with the fault still starting after the first
verified checkpoints, so every stage has real work to do.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from rich.console import Console

from flows.local.demo import DemoConfig

REPORT_KEYS = {
    "world_size",
    "steps",
    "nodes",
    "alarms",
    "checkpoints",
    "final_fingerprint",
    "step_ms",
}
INCIDENT_KEYS = {
    "suspect_range",
    "suspect_nodes",
    "verdict",
    "approval",
    "replaced",
    "resumed_from_step",
    "stages",
    "reference_fingerprint",
    "recovered_fingerprint",
}
STAGES = [
    "triage",
    "stop",
    "cordon",
    "telemetry",
    "replay",
    "approval",
    "replace",
    "quarantine",
    "resume",
]


def demo_config(tmp_path: Path, fault: str) -> DemoConfig:
    return DemoConfig(
        fault=fault,
        faulty_node="node-2",
        steps=24,
        fault_step=12,
        workdir=tmp_path / "demo",
        report=tmp_path / "report.json",
        console=Console(file=io.StringIO(), width=120),
    )


def processes_under(path: Path) -> list[int]:
    """Pids of live processes whose command line names ``path`` (the demo's run folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(path) in cmdline:
            found.append(int(entry.name))
    return found


def check_report(report: dict, config: DemoConfig, *, verdict: str = "hardware") -> None:
    """``verdict``: the replay's; a sharded job, which is not replayed, ends ``inconclusive``."""
    assert set(report) >= REPORT_KEYS | INCIDENT_KEYS
    assert [s["name"] for s in report["stages"]] == STAGES
    assert all(s["status"] == "completed" for s in report["stages"]), report["stages"]
    assert report["verdict"] == verdict
    assert [r["node"] for r in report["replaced"]] == [config.faulty_node]
    assert report["suspect_nodes"] == [config.faulty_node]
    # the resume checkpoint predates the fault, and the recovery is exact, bit for bit
    assert report["resumed_from_step"] < config.fault_step
    assert report["recovered_fingerprint"] == report["reference_fingerprint"]
    # the faulty run itself ended elsewhere: the fault really changed the weights
    assert report["final_fingerprint"] != report["reference_fingerprint"]
    first = min(a["step"] for a in report["alarms"])
    assert config.fault_step <= first
    # as in production, the faulty job still ran when its alarm came (halted by its guard,
    # waiting): the stop stage stopped it, its process group is gone, and its report ends at
    # the alarm's step
    assert report["stop"]["running_at_alarm"] is True
    assert report["stop"]["result"] == "stopped", report["stop"]
    assert report["stop"]["pid_alive"] is False
    assert report["stopped_after_step"] == first
    assert all(a["suspect_nodes"] == [config.faulty_node] for a in report["alarms"])
    resumed_nodes = report["resumed_nodes"]
    assert config.faulty_node not in resumed_nodes
    assert len(resumed_nodes) == config.world_size
