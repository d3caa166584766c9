"""The ``sdcguard`` command line (Typer): thin shells over the modules that do the work."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from flows.settings import TriggerMode

app = typer.Typer(
    name="sdcguard",
    help="Catch Silent Data Corruption in distributed PyTorch training and recover from it safely.",
    no_args_is_help=True,
    add_completion=False,
)


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def train(ctx: typer.Context) -> None:
    """Run a local DDP job on CPU (gloo) with sdcguard's detection (`sdcguard train --help`).

    The options are parsed by ``detection.harness`` itself (argparse, stdlib only), so the same
    job runs as ``python -m detection.harness`` in a training image that has no CLI extras.
    """
    from detection.simulation.forkserver import start_early

    start_early(ctx.args)  # the ranks' imports run beside this process's own (torch)
    from detection.harness import main as harness_main

    raise typer.Exit(harness_main(list(ctx.args)))


@app.command()
def serve(
    host: Annotated[
        str | None,
        typer.Option(help="Interface to listen on [default: SDCGUARD_WEBHOOK_HOST or 127.0.0.1]."),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(min=1, max=65535, help="TCP port [default: SDCGUARD_WEBHOOK_PORT or 8787]."),
    ] = None,
    trigger: Annotated[
        TriggerMode | None,
        typer.Option(
            case_sensitive=False,
            help="What an opened incident starts [default: SDCGUARD_WEBHOOK_TRIGGER or prefect].",
        ),
    ] = None,
    database_url: Annotated[
        str | None,
        typer.Option(help="Ledger URL [default: SDCGUARD_DATABASE_URL or SQLite in .sdcguard/]."),
    ] = None,
    tls_cert: Annotated[
        Path | None,
        typer.Option(help="PEM certificate: serve HTTPS [default: SDCGUARD_WEBHOOK_TLS_CERT]."),
    ] = None,
    tls_key: Annotated[
        Path | None,
        typer.Option(help="PEM private key of --tls-cert [default: SDCGUARD_WEBHOOK_TLS_KEY]."),
    ] = None,
) -> None:
    """Run the alarm webhook and ledger API (needs SDCGUARD_WEBHOOK_SECRET or
    SDCGUARD_WEBHOOK_CREDENTIALS_FILE; on PostgreSQL a schema at head: `sdcguard db upgrade`).

    Options left out fall back to the SDCGUARD_WEBHOOK_* settings, so a container can be
    configured through its environment alone.
    """
    from db import SchemaNotReady
    from flows.logs import configure_logging
    from flows.settings import SettingsError, WebhookSettings, load_settings
    from flows.webhook.auth import AuthConfigError
    from flows.webhook.serve import serve as run_webhook

    configure_logging()  # SDCGUARD_LOG_FORMAT=json in the container: JSON lines with context
    try:
        settings = load_settings(WebhookSettings)
        run_webhook(
            host or settings.host,
            port or settings.port,
            trigger or settings.trigger,
            database_url,
            tls_cert=tls_cert,
            tls_key=tls_key,
        )
    except (SettingsError, AuthConfigError, SchemaNotReady, ValueError) as err:
        typer.echo(f"sdcguard serve: {err}", err=True)
        raise typer.Exit(2) from err


db_app = typer.Typer(help="The ledger's database schema.", no_args_is_help=True)
app.add_typer(db_app, name="db")

_DATABASE_URL_HELP = "Ledger URL [default: SDCGUARD_DATABASE_URL or SQLite in .sdcguard/]."


def _database_url(database_url: str | None) -> str:
    from flows.settings import DatabaseSettings

    return database_url or DatabaseSettings().url


@app.command()
def incidents(
    job: Annotated[str | None, typer.Option(help="Only this job's incidents.")] = None,
    state: Annotated[str | None, typer.Option(help="Only incidents in this state.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON, one object.")] = False,
    database_url: Annotated[str | None, typer.Option(help=_DATABASE_URL_HELP)] = None,
) -> None:
    """List incidents from the ledger, newest first."""
    import json

    from rich.console import Console

    from db import IncidentState, Ledger
    from flows.incident.report import incidents_table

    try:
        wanted = IncidentState(state) if state else None
    except ValueError as err:
        choices = ", ".join(s.value for s in IncidentState)
        raise typer.BadParameter(
            f"{state!r} is not one of {choices}", param_hint="--state"
        ) from err
    with Ledger.from_url(_database_url(database_url)) as ledger:
        found = ledger.list_incidents(job, wanted)
    if as_json:
        typer.echo(json.dumps({"incidents": [i.to_dict() for i in found]}, default=str))
        return
    console = Console()
    console.print(incidents_table(found, width=console.width))


@app.command(no_args_is_help=True)
def incident(
    incident_id: Annotated[
        str, typer.Argument(help="The incident's id, or `retry` followed by the id.")
    ],
    retry_id: Annotated[
        str | None, typer.Argument(help="With `retry`: the failed or expired incident.")
    ] = None,
    by: Annotated[
        str | None, typer.Option(help="With retry: who retries [default: $USER].")
    ] = None,
    reason: Annotated[
        str, typer.Option(help="With retry: why (kept in the history).")
    ] = "retried by an operator",
    run: Annotated[
        str,
        typer.Option(
            help=(
                "With retry: `prefect` starts a run of --deployment; `local` runs it here; "
                "`none` only reopens it (start it from the Prefect UI)."
            )
        ),
    ] = "prefect",
    deployment: Annotated[
        str, typer.Option(help="With retry and --run prefect: the deployment.")
    ] = "incident-response/incident",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON, one object.")] = False,
    database_url: Annotated[str | None, typer.Option(help=_DATABASE_URL_HELP)] = None,
) -> None:
    """Show one incident (state, evidence, decision, stages, actions, alarms), or retry one.

    `sdcguard incident retry ID` reopens a failed or expired incident and starts a new flow
    run that continues it from the ledger (docs/runbook.md).
    """
    import json

    from rich.console import Console

    from db import Ledger, LedgerError, UnknownIncident
    from flows.incident.report import incident_renderables

    url = _database_url(database_url)
    if incident_id == "retry":
        if not retry_id:
            raise typer.BadParameter("retry needs the incident's id", param_hint="ID")
        _retry(url, retry_id, by, reason, run, deployment, as_json)
        return
    with Ledger.from_url(url) as ledger:
        try:
            view = ledger.get_incident(incident_id)
        except (UnknownIncident, LedgerError) as err:
            typer.echo(f"sdcguard incident: {err}", err=True)
            raise typer.Exit(1) from err
    if as_json:
        typer.echo(json.dumps(view.to_dict(), default=str))
        return
    console = Console()
    for renderable in incident_renderables(view):
        console.print(renderable)


def _retry(
    url: str,
    incident_id: str,
    by: str | None,
    reason: str,
    run: str,
    deployment: str,
    as_json: bool,
) -> None:
    import getpass
    import json

    from db import Ledger, LedgerError
    from flows.webhook.retry import retry_incident
    from flows.webhook.trigger import IncidentTrigger, NoTrigger, PrefectTrigger, TriggerError

    if run not in ("prefect", "local", "none"):
        raise typer.BadParameter("one of prefect, local, none", param_hint="--run")
    who = by or getpass.getuser()
    # --run local runs the flow below, in this process, once the ledger has reopened it
    trigger: IncidentTrigger = PrefectTrigger(deployment) if run == "prefect" else NoTrigger()
    with Ledger.from_url(url) as ledger:
        try:
            reopened = retry_incident(ledger, trigger, incident_id, by=who, reason=reason)
        except (LedgerError, TriggerError) as err:
            typer.echo(f"sdcguard incident retry: {err}", err=True)
            raise typer.Exit(1) from err
    summary: dict[str, object] = {"incident_id": incident_id, "reopened_as": reopened.state.value}
    if run == "local":
        from flows.incident.flow import respond
        from flows.incident.wiring import build_backends, use_backends

        with use_backends(build_backends(database_url=url)):
            summary["result"] = respond(incident_id)
    if as_json:
        typer.echo(json.dumps(summary, default=str))
    else:
        typer.echo(
            f"incident {incident_id} reopened as {reopened.state.value}"
            + _retry_outcome(run, summary)
        )


def _retry_outcome(run: str, summary: dict[str, object]) -> str:
    result = summary.get("result")
    if isinstance(result, dict):
        return f"; its flow ended {result.get('state')}"
    if run == "prefect":
        return "; a new flow run is started"
    return "; no run started (run the incident deployment in the Prefect UI)"


@contextlib.contextmanager
def _exits_143_on_sigterm() -> Iterator[None]:
    """Turn the unwinding SIGTERM into the shell's 143, once everything inside has stopped."""
    from flows.local.prefect_server import Terminated

    try:
        yield
    except Terminated:
        typer.secho("stopped by SIGTERM", fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(143) from None


@contextlib.contextmanager
def _fails_on(*errors: type[Exception]) -> Iterator[None]:
    """Say what failed in one line and exit 1, instead of a traceback."""
    try:
        yield
    except errors as err:
        typer.secho(f"failed: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from err


@app.command("replay-incident")
def replay_incident(
    incident_id: Annotated[str, typer.Argument(help="The recorded incident's id.")],
    database_url: Annotated[
        str | None,
        typer.Option(help="Ledger holding the incident (only read). " + _DATABASE_URL_HELP),
    ] = None,
    workdir: Annotated[
        Path | None, typer.Option(help="Where the rehearsal keeps its own ledger and cluster.")
    ] = None,
    decision: Annotated[
        str, typer.Option(help="Who answers the approval: approve, reject, expire or ui.")
    ] = "approve",
    report: Annotated[Path | None, typer.Option(help="Write the summary JSON here.")] = None,
) -> None:
    """Rehearse a recorded incident on local backends, AWS mocked: nothing real is touched."""
    import json
    import tempfile

    from rich.console import Console

    from flows.local.prefect_server import PrefectServerError, one_prefect_server, sigterm_raises
    from flows.local.rehearsal import (
        REHEARSAL_NOTICE,
        RehearsalDecision,
        rehearsal_renderables,
        rehearse,
    )

    console = Console()
    console.print(f"[bold yellow]{REHEARSAL_NOTICE}[/]")
    where = workdir or Path(tempfile.mkdtemp(prefix="sdcguard-rehearsal-"))
    # One Prefect API for the flow and its approver: PREFECT_API_URL's, or one started here.
    with (
        sigterm_raises(),
        _exits_143_on_sigterm(),
        _fails_on(PrefectServerError),
        one_prefect_server(where.absolute() / "prefect") as server,
    ):
        console.print(
            f"Prefect {'server started' if server.started_here else 'API'} at "
            f"{server.api_url}, UI at {server.ui_url}",
            soft_wrap=True,
        )
        if decision == RehearsalDecision.UI:
            console.print("approve in the Prefect UI: the paused run is listed under Runs")
        result = rehearse(
            _database_url(database_url), incident_id, where, decision=RehearsalDecision(decision)
        )
    for renderable in rehearsal_renderables(result):
        console.print(renderable)
    if report is not None:
        report.write_text(json.dumps(result.summary, indent=2))


@app.command()
def demo(
    fault: Annotated[
        str, typer.Option(help="Fault kind of the faulty node's hardware.")
    ] = "act-flip",
    faulty_node: Annotated[
        str, typer.Option(help="The node whose hardware turns faulty.")
    ] = "node-2",
    approve_in_ui: Annotated[
        bool,
        typer.Option(help="Wait for a human to approve in the Prefect UI (prints the run's page)."),
    ] = False,
    transient: Annotated[
        bool,
        typer.Option(
            help="A one-off upset of the faulty node's recomputation of its ring partner's "
            "micro-batch at an audited step instead of a persistent fault: training stays "
            "clean, the audit names the pair and the approver picks which to replace (with "
            "--approve-in-ui)."
        ),
    ] = False,
    parallel: Annotated[
        str,
        typer.Option(
            help="ddp, fsdp or hsdp: how every job of the demo is laid out. hsdp runs 2 "
            "replicas x 2 shards and resumes from a checkpoint their weight vote verified; a "
            "sharded job is not replayed diagnostically, so it needs --approve-in-ui (fsdp "
            "verifies no checkpoint yet and is refused)."
        ),
    ] = "ddp",
    report: Annotated[Path | None, typer.Option(help="Write the report JSON here.")] = None,
    workdir: Annotated[Path, typer.Option(help="Where the demo keeps its state.")] = Path(
        ".sdcguard/demo"
    ),
    steps: Annotated[int, typer.Option(min=10, help="Training steps of each run.")] = 30,
    fault_step: Annotated[int, typer.Option(min=1, help="First faulty step.")] = 17,
) -> None:
    """The whole incident end to end on this machine, with proof that recovery was exact.

    The flow runs on the Prefect server at PREFECT_API_URL, or on one started for the demo
    (with its UI) and stopped when it ends, however it ends."""
    from flows.local.demo import DemoConfig, DemoError, run_demo
    from flows.local.prefect_server import PrefectServerError, one_prefect_server, sigterm_raises

    with contextlib.ExitStack() as stack:
        stack.enter_context(sigterm_raises())
        stack.enter_context(_exits_143_on_sigterm())
        try:
            server = stack.enter_context(one_prefect_server(workdir.resolve() / "prefect"))
            typer.echo(
                f"Prefect {'server started' if server.started_here else 'API'} at "
                f"{server.api_url}, UI at {server.ui_url}"
            )
            run_demo(
                DemoConfig(
                    fault=fault,
                    faulty_node=faulty_node,
                    approve_in_ui=approve_in_ui,
                    transient=transient,
                    parallel=parallel,
                    prefect=server,
                    report=report,
                    workdir=workdir,
                    steps=steps,
                    fault_step=fault_step,
                )
            )
        except (DemoError, PrefectServerError) as err:
            typer.secho(f"demo failed: {err}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from err


@db_app.command("upgrade")
def db_upgrade(
    database_url: Annotated[str | None, typer.Option(help=_DATABASE_URL_HELP)] = None,
    runtime_role: Annotated[
        str | None,
        typer.Option(
            help="PostgreSQL role the services connect as: granted INSERT/SELECT on the event "
            "tables and nothing more [default: SDCGUARD_DATABASE_RUNTIME_ROLE]."
        ),
    ] = None,
) -> None:
    """Create or migrate the ledger's tables to the newest schema (a deployment step of its own;
    on PostgreSQL under an advisory lock, so concurrent runs queue)."""
    from db import upgrade

    url = _database_url(database_url)
    upgrade(url, runtime_role=runtime_role)
    typer.echo("ledger schema is up to date")


spool_app = typer.Typer(
    help="Alarm spools a job left on disk: what its ranks could not deliver in time.",
    no_args_is_help=True,
)
app.add_typer(spool_app, name="spool")


@spool_app.command("drain")
def spool_drain(
    directory: Annotated[
        Path, typer.Argument(help="A rank's spool, or a job's spool root (one per rank).")
    ],
    webhook: Annotated[
        str,
        typer.Option(envvar="SDCGUARD_WEBHOOK_URL", help="The webhook's base URL."),
    ],
    timeout: Annotated[float, typer.Option(help="Seconds to wait per spool.")] = 60.0,
) -> None:
    """Send every leftover alarm and ledger record, in order, signed with
    SDCGUARD_WEBHOOK_SECRET. Alarm ids are deterministic per event, so a message the job's
    next start also sends is recorded once. Exits 1 while anything is left undelivered."""
    import os

    from detection.transport.sender import drain_spool, find_spools

    secret = os.environ.get("SDCGUARD_WEBHOOK_SECRET")
    if not secret:
        raise typer.BadParameter("set SDCGUARD_WEBHOOK_SECRET", param_hint="environment")
    left = 0
    for spool in find_spools(directory):
        result = drain_spool(spool, webhook, secret, timeout_s=timeout)
        left += result.left
        typer.echo(
            f"{spool}: {result.found} found, {result.delivered} delivered, "
            f"{result.dead} dead-lettered, {result.left} left"
        )
    if left:
        raise typer.Exit(1)


external_app = typer.Typer(
    help="Alarms from other detectors: hardware health events (Megatron and torchtitan adapters "
    "run in the training job, see docs/runbook.md).",
    no_args_is_help=True,
)
app.add_typer(external_app, name="external")


@external_app.command("health")
def external_health(
    job_id: Annotated[
        str, typer.Option(envvar="SDCGUARD_JOB_ID", help="The job running on this node.")
    ],
    node: Annotated[
        str, typer.Option(envvar="NODE_NAME", help="This node, as the orchestrator names it.")
    ],
    nvidia_smi_xml: Annotated[
        Path | None, typer.Option(help="`nvidia-smi -q -x` output (GPU Recovery Action).")
    ] = None,
    kernel_log: Annotated[
        Path | None, typer.Option(help="The kernel log (`dmesg`, /dev/kmsg): critical Xids.")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each 2xx.")] = 10.0,
) -> None:
    """Report this node's hardware health events for JOB_ID: every critical Xid and every GPU
    whose driver asks for a recovery action becomes one signed external alarm (webhook and key
    from SDCGUARD_WEBHOOK_URL / _SECRET / _KEY_ID). A healthy node sends nothing. Exits 1 while
    an alarm is left spooled (drain it with `sdcguard spool drain`)."""
    from detection.external.delivery import WebhookTarget, deliver_all
    from recovery.telemetry import parse_kernel_log, parse_nvidia_smi_xml
    from recovery.telemetry.health_alarm import health_alarms

    if nvidia_smi_xml is None and kernel_log is None:
        raise typer.BadParameter("give --nvidia-smi-xml, --kernel-log or both")
    alarms = health_alarms(
        job_id=job_id,
        node=node,
        nvidia_smi=(
            parse_nvidia_smi_xml(nvidia_smi_xml.read_text(), source=str(nvidia_smi_xml))
            if nvidia_smi_xml
            else None
        ),
        kernel_log=parse_kernel_log(kernel_log.read_text()) if kernel_log else None,
    )
    if not alarms:
        typer.echo(f"{node}: no health event to report")
        return
    delivered = deliver_all(alarms, WebhookTarget.from_env(), timeout_s=timeout)
    for alarm in alarms:
        typer.echo(f"{node}: {alarm.kind} {'reported' if delivered else 'spooled'}")
    if not delivered:
        raise typer.Exit(1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
