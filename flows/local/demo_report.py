"""What ``sdcguard demo`` reports: the report JSON, the tables it prints, the loss plot.

The report is DESIGN's ``sdcguard train`` report of the faulty run plus the incident: what the
flow decided and did (including how the stop stage found the job), and the two fingerprints
whose equality is the demo's proof of exact recovery.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["demo_report", "plot_losses", "print_summary"]


def demo_report(
    fault_spec: str,
    faulty: dict[str, Any],
    reference: dict[str, Any],
    recovered: dict[str, Any],
    summary: dict[str, Any],
    started: float,
) -> dict[str, Any]:
    report = dict(faulty)
    report.update(
        {
            "fault": fault_spec,
            "incident_id": summary["incident_id"],
            "suspect_range": summary["suspect_range"],
            "suspect_nodes": summary["suspect_nodes"],
            "verdict": summary["verdict"],
            "approval": summary["approval"],
            "replaced": summary["replaced"],
            "resumed_from_step": summary["resumed_from_step"],
            "resumed_checkpoint": summary.get("resumed_checkpoint"),
            "resumed_nodes": summary.get("resumed_nodes"),
            "stages": summary["stages"],
            "reference_fingerprint": reference["final_fingerprint"],
            "recovered_fingerprint": recovered["final_fingerprint"],
            "demo_seconds": round(time.monotonic() - started, 1),
        }
    )
    return report


def print_summary(console: Console, report: dict[str, Any], exact: bool) -> None:
    table = Table(title="incident stages", show_lines=False)
    table.add_column("stage")
    table.add_column("status")
    table.add_column("seconds", justify="right")
    for stage in report["stages"]:
        seconds = "—"
        if stage.get("start") and stage.get("end"):
            took = datetime.fromisoformat(stage["end"]) - datetime.fromisoformat(stage["start"])
            seconds = f"{took.total_seconds():.1f}"
        table.add_row(stage["name"], stage["status"], seconds)
    console.print(table)
    start, end = report["suspect_range"]
    facts = Table(show_header=False, title="outcome")
    facts.add_row("verdict", str(report["verdict"]))
    facts.add_row("suspect steps", f"{start}..{end}")
    stop = report.get("stop") or {}
    facts.add_row(
        "stop stage",
        f"{stop.get('result')}: {stop.get('detail')}"
        + ("" if stop.get("running_at_alarm") else " (the job had ended before the alarm)"),
    )
    replaced = ", ".join(f"{r['node']} → {r.get('new_node')}" for r in report["replaced"])
    facts.add_row("replaced", replaced or "none")
    kept = [n for n in report["suspect_nodes"] if n not in {r["node"] for r in report["replaced"]}]
    if kept:
        facts.add_row("suspects not approved", ", ".join(kept) + " (uncordoned, back to work)")
    facts.add_row("checkpoint used", f"step {report['resumed_from_step']}")
    facts.add_row("steps rolled back", str(end - report["resumed_from_step"]))
    facts.add_row("reference fingerprint", report["reference_fingerprint"])
    facts.add_row("recovered fingerprint", report["recovered_fingerprint"])
    facts.add_row("exact recovery", "[green]yes, bit for bit[/]" if exact else "[red]NO[/]")
    console.print(facts)


def _mean_losses(path: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            losses = [float(x) for x in rec["losses"]]
            out[int(rec["step"])] = sum(losses) / len(losses)
    return out


def plot_losses(
    path: Path, run_dir: Path, job: str, *, resumed_step: int, fault_step: int, alarm_step: int
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {
        "reference": _mean_losses(run_dir / "reference.trace.jsonl"),
        "faulty": _mean_losses(run_dir / f"{job}.trace.jsonl"),
        "recovered": _mean_losses(run_dir / f"{job}.trace.resumed-{resumed_step}.jsonl"),
    }
    fig, ax = plt.subplots(figsize=(9, 4.5))
    styles = {"reference": ("black", "-", 3.0), "faulty": ("tab:red", "-", 1.5),
              "recovered": ("tab:green", "--", 1.5)}  # fmt: skip
    # Scale to the healthy curves: corrupted losses can be ~1e35 and would flatten them.
    healthy = [v for name in ("reference", "recovered") for v in curves[name].values()]
    low, high = min(healthy), max(healthy)
    pad = (high - low) * 0.15 or 0.1
    top = high + pad
    for name, points in curves.items():
        if not points:
            continue
        steps = sorted(points)
        colour, style, width = styles[name]
        shown = [min(points[s], top) for s in steps]
        ax.plot(steps, shown, style, color=colour, lw=width, label=name)
        off = [s for s in steps if points[s] > top]
        if off:
            peak = max(points[s] for s in off)
            label = f"{name}: loss off scale (up to {peak:.1e})"
            ax.plot(off, [top] * len(off), "^", color=colour, ms=8, label=label)
    ax.set_ylim(low - pad, top + pad)
    ax.axvline(fault_step, color="tab:red", ls=":", label=f"fault from step {fault_step}")
    ax.axvline(alarm_step, color="tab:orange", ls="-.", label=f"alarm (step {alarm_step})")
    ax.axvline(resumed_step, color="tab:green", ls=":", label=f"resume after step {resumed_step}")
    ax.set_xlabel("step")
    ax.set_ylabel("mean loss across ranks")
    ax.set_title("sdcguard demo: silent data corruption caught, node replaced, exact recovery")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
