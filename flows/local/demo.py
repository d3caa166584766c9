"""``sdcguard demo``: the whole incident on one machine, and proof that recovery was exact.

Everything is embedded and local: a SQLite ledger, a simulated cluster of nodes with a spare
pool, AWS (SageMaker HyperPod) mocked by a moto server carrying our batch replace/reboot
extension, the webhook on loopback, the incident flow started by the webhook in a thread of
this process, on the one Prefect server the caller points this process at
(:func:`flows.local.prefect_server.one_prefect_server`).

1. A fault-free reference run of the built-in model (4 ranks on 4 simulated nodes).
2. The same run, but one node's hardware turns faulty part-way through (a persistent fault of
   that node, from a step after the first verified checkpoints). Detection raises an alarm; the
   webhook opens an incident and starts the flow: stop, cordon, telemetry, rerun on the
   suspect and a spare (verdict ``hardware``), approval, HyperPod replace, quarantine, resume
   from the newest verified checkpoint on the replacement node.
3. The resumed run finishes and its final weight fingerprint must equal the reference's, bit
   for bit: the proof that the recovery was exact and no corrupted step survived.

As in production, the faulty job is still running when its alarm arrives: its guard halts it
after the alarm's step (``--halt-on-alarm``) and it stays alive, training no further, until the
flow's stop stage stops its process group.

``transient`` swaps the persistent fault for a one-off upset at an audited step, in the faulty
node's *recomputation* of its ring partner's micro-batch (``act-flip@RANK:STEP:in=recompute``):
training itself stays clean, so the per-step layer — which names a node whose own training step
is upset, on its own — rightly sees nothing, while the ring audit finds one disagreeing pair
(auditor and audited) and can only name both. The diagnostic run finds no mismatch on any node
(every node reproduces the training record), and the approver chooses in the form which of the
two to replace (the other goes back to work): the training record checks out, so the value
that was wrong is the auditor's recomputation.

``parallel`` runs every job of the demo sharded (``hsdp``: 2 replicas x 2 shards): the same
incident, resumed from the newest checkpoint the replicas' weight vote verified, a sealed
directory addressed by its manifest. A sharded job is not replayed diagnostically, so a person
approves; what a sharded demo needs, and refuses, is :mod:`flows.local.demo_parallel`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from db import Ledger
from db.migrate import upgrade
from flows.incident.policy import IncidentPolicy
from flows.incident.wiring import build_backends, use_backends
from flows.local.demo_flow import DemoError, FlowThread, follow_flow, stop_record
from flows.local.demo_parallel import layout_args, layout_words, parallel_problems, writes_trace
from flows.local.demo_report import demo_report, plot_losses, print_summary
from flows.local.prefect_server import PrefectServer, environ
from flows.settings import AwsSettings, PolicySettings, RecoverySettings
from flows.webhook import create_app
from flows.webhook.serve import run_in_thread
from recovery.aws.local import LocalAws, create_demo_cluster, start_local_aws
from recovery.errors import NotFoundError
from recovery.jobs import JobKind, JobRef, JobStatus
from recovery.local import LocalJobControl
from recovery.local.cluster import LocalCluster

__all__ = ["DEMO_FAULTS", "DemoConfig", "DemoError", "run_demo"]

log = logging.getLogger(__name__)

DEMO_FAULTS = ("act-flip", "grad-nan", "grad-flip", "reduced-flip", "weight-flip", "optim-flip")
_CLUSTER = "sdcguard-demo"
_JOB = "demo-job"
_TWO_SUSPECTS_SHARE = 0.5


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
    transient: bool = False
    """A one-off upset of the faulty node's recomputation of its ring partner's micro-batch at
    an audited step, instead of a persistent fault: two suspect nodes, the auditor and the
    audited."""
    parallel: str = "ddp"
    """How every job of the demo is laid out: ``ddp``, ``fsdp`` or ``hsdp``
    (:mod:`flows.local.demo_parallel`)."""
    prefect: PrefectServer | None = None
    """The Prefect server the flow runs on; with ``approve_in_ui``, where its run is shown."""
    workdir: Path = Path(".sdcguard/demo")
    report: Path | None = None
    plot: Path | None = None
    timeout_s: float = 600.0
    console: Console = field(default_factory=Console)
    reference: Path | None = None
    """The folder of an earlier demo's run of this same configuration, whose reference run
    (``reference.json``, ``reference.trace.jsonl``) is reused instead of run again: the
    reference has no fault, so it is the same for every fault kind (tests share one)."""

    def nodes(self) -> list[str]:
        return [f"node-{i}" for i in range(self.world_size)]

    def spare_nodes(self) -> list[str]:
        return [f"node-{self.world_size + i}" for i in range(self.spares)]

    def upset_step(self) -> int:
        """The first audited step from ``fault_step`` on: where a transient upset is seen."""
        every = self.audit_every
        return -(-self.fault_step // every) * every

    def fault_spec(self) -> str:
        if self.transient:
            rank = self.nodes().index(self.faulty_node)
            return f"{self.fault}@{rank}:{self.upset_step()}:in=recompute"
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
        if self.approve_in_ui and self.prefect is None:
            raise DemoError("--approve-in-ui needs the Prefect server whose UI shows the run")
        if self.transient:
            if self.fault != "act-flip" or self.audit_mode != "loss":
                # the loss audit sees a one-off act-flip in exactly one pair of ranks
                raise DemoError("--transient needs --fault act-flip (seen by the loss audit)")
            if not self.approve_in_ui:
                raise DemoError("--transient needs --approve-in-ui: a person picks the node")
            if not self.upset_step() < self.steps:
                raise DemoError("--transient: no audited step between the fault and the end")
        problems = parallel_problems(
            self.parallel,
            fault=self.fault,
            world_size=self.world_size,
            transient=self.transient,
            approve_in_ui=self.approve_in_ui,
        )
        if problems:
            raise DemoError("; ".join(problems))


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
        # a sharded job writes no trace (the sharded harness refuses --trace)
        *(["--trace", str(run_dir / f"{name}.trace.jsonl")] if writes_trace(config.parallel)
          else []),
        "--job-id", name,
        *layout_args(config.parallel),
    ]  # fmt: skip
    if webhook is not None:
        args += ["--webhook", webhook]
    return args


@contextlib.contextmanager
def _local_aws(config: DemoConfig) -> Iterator[LocalAws]:
    aws = start_local_aws()
    try:
        yield aws
    finally:
        aws.stop()


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Run the demo; return the report (DESIGN's ``sdcguard train`` report plus the incident).

    The flow runs on the Prefect API this process is configured with (``config.prefect`` when
    the caller started one): the demo never starts a server of its own.
    """
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
        f"{config.world_size} ranks ({layout_words(config.parallel, config.world_size)}) on "
        f"{', '.join(config.nodes())}; spares "
        f"{', '.join(config.spare_nodes())}; fault [bold red]{config.fault_spec()}[/]"
    )
    with contextlib.ExitStack() as stack:
        # Every training process of the demo (the resumed one is started by the flow) signs its
        # alarms with this secret, as a pod would read it from its environment.
        stack.enter_context(environ(SDCGUARD_WEBHOOK_SECRET=secret))
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
        # This process is the demo's only worker: its operator (whoever runs the demo) sets the
        # server-side limits, as SDCGUARD_POLICY_* would: unattended, auto-approval is allowed;
        # with two suspects, half of the four nodes implicated is not yet a storm.
        share = _TWO_SUSPECTS_SHARE if config.transient else PolicySettings().storm_node_share
        limits = PolicySettings(auto_approve=not config.approve_in_ui, storm_node_share=share)
        backends = dataclasses.replace(backends, policy_limits=limits)
        stack.enter_context(use_backends(backends))
        ledger = backends.ledger
        # Unattended, the policy approves only on the strongest evidence (a hardware verdict that
        # a direct attribution backs); anything weaker waits for a human, bounded here so the
        # demo ends ("expired") instead of waiting forever.
        policy = IncidentPolicy(
            auto_approve=not config.approve_in_ui,
            approval_timeout_s=1800 if config.approve_in_ui else 120,
            storm_node_share=share,
        )
        flow = FlowThread(policy)
        app = create_app(ledger, flow, secret)
        webhook = stack.enter_context(run_in_thread(app))
        console.print(f"[dim]webhook and ledger API at {webhook}[/]")
        if config.prefect is not None:
            console.print(f"[dim]Prefect UI at {config.prefect.ui_url}[/]", soft_wrap=True)

        console.rule("1. reference run (no fault)")
        if config.reference is not None:
            for name in _reference_files(config):
                shutil.copyfile(config.reference / name, run_dir / name)
            console.print(f"  reused from {config.reference}")
        else:
            jobs.launch(
                "reference",
                _harness_args(config, "reference", run_dir, None),
                run_dir / "reference.log",
            )
            _wait_job(jobs, reference_ref, config.timeout_s, "the reference run")
        reference = _read_json(run_dir / "reference.json")
        console.print(
            f"  final fingerprint [cyan]{reference['final_fingerprint']}[/], "
            f"{len(reference['alarms'])} alarm(s)"
        )

        what = (
            f"a one-off upset of {config.faulty_node}'s recomputation of its ring partner's "
            f"micro-batch at step {config.upset_step()}"
            if config.transient
            else f"{config.faulty_node} turns faulty at step {config.fault_step}"
        )
        console.rule(f"2. the same run; {what}")
        args = [
            *_harness_args(config, _JOB, run_dir, webhook),
            "--inject", config.fault_spec(),
            # halted by its guard after the alarm, the job waits for the flow to stop it
            "--halt-on-alarm", "--hold-after-halt", str(config.timeout_s),
        ]  # fmt: skip
        faulty_pid = jobs.launch(_JOB, args, run_dir / f"{_JOB}.log")
        incident_id = _await_incident(ledger, jobs, job_ref, config.timeout_s)
        running = jobs.status(job_ref) is JobStatus.RUNNING
        console.print(
            f"  alarm → incident [bold]{incident_id}[/] while the job "
            + ("still runs" if running else "has already ended")
            + "; the incident flow runs:"
        )
        summary = follow_flow(
            console,
            ledger,
            flow,
            incident_id,
            # a person may take the whole approval timeout to answer
            timeout_s=config.timeout_s + (policy.approval_timeout_s if config.approve_in_ui else 0),
            approve_at=config.prefect if config.approve_in_ui else None,
        )

        console.rule("3. the resumed run finishes")
        _wait_job(jobs, job_ref, config.timeout_s, "the resumed run")
        resumed_step = summary["resumed_from_step"]
        faulty = _read_json(run_dir / f"{_JOB}.json")
        recovered = _read_json(run_dir / f"{_JOB}.resumed-{resumed_step}.json")
        report = demo_report(config.fault_spec(), faulty, reference, recovered, summary, started)
        report["stop"] = stop_record(ledger, incident_id, faulty_pid, running)
        report["parallel"] = config.parallel
        report["reference_alarms"] = reference["alarms"]
        exact = report["recovered_fingerprint"] == report["reference_fingerprint"]
        print_summary(console, report, exact)
        report_path = config.report or (work / "demo-report.json")
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report_path.write_text(json.dumps(report, indent=2) + "\n")
        if writes_trace(config.parallel):
            plot_path = config.plot or report_path.with_suffix(".png")
            plot_losses(
                plot_path,
                run_dir,
                _JOB,
                resumed_step=resumed_step,
                fault_step=config.upset_step() if config.transient else config.fault_step,
                alarm_step=min(a["step"] for a in faulty["alarms"]),
            )
            console.print(f"report [bold]{report_path}[/], plot [bold]{plot_path}[/]")
        else:
            console.print(
                f"report [bold]{report_path}[/] (no loss plot: a sharded job writes no trace)"
            )
        if not exact:
            raise DemoError("the recovered weights differ from the reference: recovery not exact")
    return report


def _reference_files(config: DemoConfig) -> list[str]:
    """What a reused reference run consists of: its report, and its trace where it wrote one."""
    return ["reference.json"] + (["reference.trace.jsonl"] if writes_trace(config.parallel) else [])


def _stop_all(jobs: LocalJobControl, refs: list[JobRef]) -> None:
    """The demo's last cleanup: stop every job it may have started. A job never launched is
    no error here; any other failure is logged and the next job is still stopped."""
    for ref in refs:
        try:
            jobs.stop(ref)
        except NotFoundError:
            continue
        except Exception:
            log.exception("the demo could not stop its job %s", ref.name, extra={"job": ref.name})


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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError as err:
        raise DemoError(f"{path.name} was not written; see the logs beside it") from err
