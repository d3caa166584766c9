"""``sdcguard demo``: the whole incident on one machine, and proof that recovery was exact.

Everything is embedded and local: a SQLite ledger, a simulated cluster of nodes with a spare
pool, AWS (SageMaker HyperPod) mocked by a moto server carrying our batch replace/reboot
extension, the webhook on loopback, the incident flow run by the webhook's local trigger
(Prefect in-process, or the server at ``PREFECT_API_URL``).

1. A fault-free reference run of the built-in model (4 ranks on 4 simulated nodes).
2. The same run, but one node's hardware turns faulty part-way through (a persistent fault of
   that node, from a step after the first verified checkpoints). Detection raises an alarm; the
   webhook opens an incident and starts the flow: stop, cordon, telemetry, replay on the
   suspect and a spare (verdict ``hardware``), approval, HyperPod replace, quarantine, resume
   from the newest verified checkpoint on the replacement node.
3. The resumed run finishes and its final weight fingerprint must equal the reference's, bit
   for bit: the proof that the recovery was exact and no corrupted step survived.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from db import Ledger
from db.migrate import upgrade
from flows.incident import respond
from flows.policy import IncidentPolicy
from flows.recovery_settings import AwsSettings, PolicySettings, RecoverySettings
from flows.serve import run_in_thread
from flows.trigger import LocalTrigger
from flows.webhook import create_app
from flows.wiring import build_backends, use_backends
from recovery.aws_local import LocalAws, create_demo_cluster, start_local_aws
from recovery.cluster import LocalCluster
from recovery.jobs import JobKind, JobRef, JobStatus, LocalJobControl

__all__ = ["DEMO_FAULTS", "DemoConfig", "DemoError", "run_demo"]

log = logging.getLogger(__name__)

DEMO_FAULTS = ("act-flip", "grad-nan", "grad-flip", "reduced-flip", "weight-flip", "optim-flip")
_CLUSTER = "sdcguard-demo"
_JOB = "demo-job"


class DemoError(RuntimeError):
    """The demo could not show what it promises; the message says which step and why."""


@dataclass
class DemoConfig:
    fault: str = "act-flip"
    faulty_node: str = "node-2"
    world_size: int = 4
    spares: int = 2
    seed: int = 7
    steps: int = 30
    fault_step: int = 17
    audit_every: int = 5
    checkpoint_every: int = 5
    audit_mode: str = "loss"
    approve_in_ui: bool = False
    workdir: Path = Path(".sdcguard/demo")
    report: Path | None = None
    plot: Path | None = None
    timeout_s: float = 600.0
    console: Console = field(default_factory=Console)

    def nodes(self) -> list[str]:
        return [f"node-{i}" for i in range(self.world_size)]

    def spare_nodes(self) -> list[str]:
        return [f"node-{self.world_size + i}" for i in range(self.spares)]

    def fault_spec(self) -> str:
        return f"{self.fault}@node={self.faulty_node}:from={self.fault_step}"

    def validate(self) -> None:
        if self.fault not in DEMO_FAULTS:
            raise DemoError(f"--fault must be one of {', '.join(DEMO_FAULTS)}")
        if self.faulty_node not in self.nodes():
            raise DemoError(f"--faulty-node must be one of {', '.join(self.nodes())}")
        if self.world_size < 3:
            raise DemoError("the demo needs 3 or more ranks: a strict majority names a node")
        if not self.checkpoint_every < self.fault_step < self.steps:
            raise DemoError("the fault must start after the first checkpoint and before the end")


def _harness_args(config: DemoConfig, name: str, run_dir: Path, webhook: str | None) -> list[str]:
    args = [
        "--world-size", str(config.world_size),
        "--nodes", ",".join(config.nodes()),
        "--seed", str(config.seed),
        "--steps", str(config.steps),
        "--audit-every", str(config.audit_every),
        "--audit-mode", config.audit_mode,
        "--checkpoint-every", str(config.checkpoint_every),
        "--checkpoint-dir", str(run_dir / f"{name}-checkpoints"),
        "--report", str(run_dir / f"{name}.json"),
        "--trace", str(run_dir / f"{name}.trace.jsonl"),
        "--job-id", name,
    ]  # fmt: skip
    if webhook is not None:
        args += ["--webhook", webhook]
    return args


class _Progress:
    """Prints each incident stage once, as the ledger records it: the flow's own record."""

    def __init__(self, console: Console, ledger: Ledger) -> None:
        self._console = console
        self._ledger = ledger
        self._seen: set[tuple[str, str]] = set()

    def poll(self, incident_id: str) -> str:
        incident = self._ledger.get_incident(incident_id)
        for action in incident.actions:
            if action.kind != "stage":
                continue
            key = (action.target, action.status.value)
            if key in self._seen or action.status.value == "claimed":
                continue
            self._seen.add(key)
            outcome = (action.detail or {}).get("outcome", "")
            colour = "green" if action.status.value == "succeeded" else "red"
            self._console.print(
                f"  [{colour}]✔[/] [bold]{action.target}[/] — {outcome}"
                if colour == "green"
                else f"  [red]✘ {action.target}[/] — {outcome}"
            )
        return incident.state.value


@contextlib.contextmanager
def _local_aws(config: DemoConfig) -> Iterator[LocalAws]:
    aws = start_local_aws()
    try:
        yield aws
    finally:
        aws.stop()


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Run the demo; return the report (DESIGN's ``sdcguard train`` report plus the incident)."""
    config.validate()
    console = config.console
    started = time.monotonic()
    work = config.workdir.resolve()
    run_dir = work / "run"
    # A second run starts clean: the previous run's state would confuse nothing but the reader.
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    secret = secrets.token_hex(24)
    recovery = RecoverySettings(state_dir=run_dir)
    jobs = LocalJobControl(recovery.jobs_dir(), stop_timeout_s=15.0)
    reference_ref = JobRef("reference", kind=JobKind.LOCAL)
    job_ref = JobRef(_JOB, kind=JobKind.LOCAL)
    database_url = f"sqlite:///{run_dir / 'ledger.db'}"
    upgrade(database_url)

    console.rule("[bold]sdcguard demo")
    console.print(
        f"{config.world_size} ranks on {', '.join(config.nodes())}; spares "
        f"{', '.join(config.spare_nodes())}; fault [bold red]{config.fault_spec()}[/]"
    )
    with contextlib.ExitStack() as stack:
        # Every training process of the demo (the resumed one is started by the flow) signs its
        # alarms with this secret, as a pod would read it from its environment.
        stack.enter_context(_environ(SDCGUARD_WEBHOOK_SECRET=secret))
        stack.callback(_stop_all, jobs, [reference_ref, job_ref])
        aws = stack.enter_context(_local_aws(config))
        all_nodes = config.nodes() + config.spare_nodes()
        ids = create_demo_cluster(aws, _CLUSTER, len(all_nodes))
        LocalCluster.create(
            recovery.cluster_state_path(),
            config.nodes(),
            config.spare_nodes(),
            dict(zip(all_nodes, ids, strict=True)),
        )
        console.print(f"[dim]AWS mocked at {aws.endpoint_url}: HyperPod cluster {_CLUSTER}[/]")
        backends = build_backends(
            recovery,
            database_url=database_url,
            aws=AwsSettings(endpoint_url=aws.endpoint_url, hyperpod_cluster=_CLUSTER),
            aws_session=aws.session(),
        )
        if not config.approve_in_ui:
            # this process is the demo's only worker: its operator (whoever runs the demo)
            # allows the unattended policy below, as SDCGUARD_POLICY_AUTO_APPROVE would
            backends = dataclasses.replace(
                backends, policy_limits=PolicySettings(auto_approve=True)
            )
        stack.enter_context(use_backends(backends))
        ledger = backends.ledger
        # Unattended, the policy approves only on the strongest evidence (a hardware verdict that
        # a direct attribution backs); anything weaker waits for a human, bounded here so the
        # demo ends ("expired") instead of waiting forever.
        policy = IncidentPolicy(
            auto_approve=not config.approve_in_ui,
            approval_timeout_s=1800 if config.approve_in_ui else 120,
        )
        finished = threading.Event()
        summary: dict[str, Any] = {}

        def run_flow(incident_id: str) -> object:
            try:
                summary.update(respond(incident_id, policy))
            finally:
                finished.set()
            return summary

        trigger = LocalTrigger(run_flow, max_workers=1)
        stack.callback(trigger.close)
        app = create_app(ledger, trigger, secret)
        webhook = stack.enter_context(run_in_thread(app))
        console.print(f"[dim]webhook and ledger API at {webhook}[/]")

        console.rule("1. reference run (no fault)")
        jobs.launch(
            "reference",
            _harness_args(config, "reference", run_dir, None),
            run_dir / "reference.log",
        )
        _wait_job(jobs, reference_ref, config.timeout_s, "the reference run")
        reference = _read_json(run_dir / "reference.json")
        console.print(f"  final fingerprint [cyan]{reference['final_fingerprint']}[/]")

        console.rule(
            f"2. the same run; {config.faulty_node} turns faulty at step {config.fault_step}"
        )
        args = [*_harness_args(config, _JOB, run_dir, webhook), "--inject", config.fault_spec()]
        jobs.launch(_JOB, args, run_dir / f"{_JOB}.log")
        incident_id = _await_incident(ledger, jobs, job_ref, config.timeout_s)
        console.print(f"  alarm → incident [bold]{incident_id}[/]; the incident flow runs:")
        if config.approve_in_ui:
            _explain_ui_approval(console, incident_id)
        progress = _Progress(console, ledger)
        deadline = time.monotonic() + config.timeout_s
        while not finished.wait(0.5):
            progress.poll(incident_id)
            if time.monotonic() > deadline:
                raise DemoError(f"the incident flow did not finish within {config.timeout_s} s")
        state = progress.poll(incident_id)
        if state != "resolved":
            raise DemoError(f"the incident ended {state!r}: {summary.get('reason')}")

        console.rule("3. the resumed run finishes")
        _wait_job(jobs, job_ref, config.timeout_s, "the resumed run")
        resumed_step = summary["resumed_from_step"]
        faulty = _read_json(run_dir / f"{_JOB}.json")
        recovered = _read_json(run_dir / f"{_JOB}.resumed-{resumed_step}.json")
        report = _demo_report(config, faulty, reference, recovered, summary, started)
        exact = report["recovered_fingerprint"] == report["reference_fingerprint"]
        _print_summary(console, report, exact)
        report_path = config.report or (work / "demo-report.json")
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report_path.write_text(json.dumps(report, indent=2) + "\n")
        plot_path = config.plot or report_path.with_suffix(".png")
        _plot(
            plot_path,
            run_dir,
            resumed_step=resumed_step,
            fault_step=config.fault_step,
            alarm_step=min(a["step"] for a in faulty["alarms"]),
        )
        console.print(f"report [bold]{report_path}[/], plot [bold]{plot_path}[/]")
        if not exact:
            raise DemoError("the recovered weights differ from the reference: recovery not exact")
    return report


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _stop_all(jobs: LocalJobControl, refs: list[JobRef]) -> None:
    for ref in refs:
        with contextlib.suppress(Exception):  # cleanup of a job that may never have started
            jobs.stop(ref)


def _wait_job(jobs: LocalJobControl, ref: JobRef, timeout_s: float, what: str) -> None:
    status = jobs.wait(ref, timeout_s)
    if status is not JobStatus.SUCCEEDED:
        raise DemoError(f"{what} ended {status.value}; see its log under the demo's run folder")


def _await_incident(ledger: Ledger, jobs: LocalJobControl, ref: JobRef, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        incidents = ledger.list_incidents(job_id=_JOB)
        if incidents:
            return incidents[0].id
        if jobs.status(ref) is not JobStatus.RUNNING and not ledger.list_incidents(job_id=_JOB):
            # The job may end just before its last alarm reaches the ledger: one more look.
            time.sleep(1.0)
            incidents = ledger.list_incidents(job_id=_JOB)
            if incidents:
                return incidents[0].id
            raise DemoError("the faulty run ended and no alarm reached the ledger")
        time.sleep(0.2)
    raise DemoError(f"no incident within {timeout_s} s")


def _explain_ui_approval(console: Console, incident_id: str) -> None:
    api = os.environ.get("PREFECT_API_URL", "")
    ui = api.removesuffix("/api") if api else "the Prefect UI"
    console.print(
        f"  [yellow]waiting for approval in the Prefect UI[/]: open {ui}/runs, find the paused "
        f"run [bold]incident-{incident_id}[/], read the evidence artifact and answer the form."
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError as err:
        raise DemoError(f"{path.name} was not written; see the logs beside it") from err


def _demo_report(
    config: DemoConfig,
    faulty: dict[str, Any],
    reference: dict[str, Any],
    recovered: dict[str, Any],
    summary: dict[str, Any],
    started: float,
) -> dict[str, Any]:
    report = dict(faulty)
    report.update(
        {
            "fault": config.fault_spec(),
            "incident_id": summary["incident_id"],
            "suspect_range": summary["suspect_range"],
            "suspect_nodes": summary["suspect_nodes"],
            "verdict": summary["verdict"],
            "approval": summary["approval"],
            "replaced": summary["replaced"],
            "resumed_from_step": summary["resumed_from_step"],
            "resumed_nodes": summary.get("resumed_nodes"),
            "stages": summary["stages"],
            "reference_fingerprint": reference["final_fingerprint"],
            "recovered_fingerprint": recovered["final_fingerprint"],
            "demo_seconds": round(time.monotonic() - started, 1),
        }
    )
    return report


def _print_summary(console: Console, report: dict[str, Any], exact: bool) -> None:
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
    replaced = ", ".join(f"{r['node']} → {r.get('new_node')}" for r in report["replaced"])
    facts.add_row("replaced", replaced)
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


def _plot(
    path: Path, run_dir: Path, *, resumed_step: int, fault_step: int, alarm_step: int
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {
        "reference": _mean_losses(run_dir / "reference.trace.jsonl"),
        "faulty": _mean_losses(run_dir / f"{_JOB}.trace.jsonl"),
        "recovered": _mean_losses(run_dir / f"{_JOB}.trace.resumed-{resumed_step}.jsonl"),
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
