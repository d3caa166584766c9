"""The ``sdcguard`` command line (Typer): thin shells over the modules that do the work."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from flows.trigger import TriggerMode

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
) -> None:
    """Run the alarm webhook and ledger API (needs SDCGUARD_WEBHOOK_SECRET).

    Options left out fall back to the SDCGUARD_WEBHOOK_* settings, so a container can be
    configured through its environment alone.
    """
    from flows.serve import serve as run_webhook
    from flows.settings import SettingsError, WebhookSettings, load_settings

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = load_settings(WebhookSettings)
        run_webhook(
            host or settings.host,
            port or settings.port,
            trigger or settings.trigger,
            database_url,
        )
    except SettingsError as err:
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
    database_url: Annotated[str | None, typer.Option(help=_DATABASE_URL_HELP)] = None,
) -> None:
    """List incidents from the ledger, newest first."""
    from rich.console import Console

    from db import IncidentState, Ledger
    from flows.report import incidents_table

    try:
        wanted = IncidentState(state) if state else None
    except ValueError as err:
        choices = ", ".join(s.value for s in IncidentState)
        raise typer.BadParameter(
            f"{state!r} is not one of {choices}", param_hint="--state"
        ) from err
    with Ledger.from_url(_database_url(database_url)) as ledger:
        Console().print(incidents_table(ledger.list_incidents(job, wanted)))


@app.command()
def incident(
    incident_id: Annotated[str, typer.Argument(help="The incident's id.")],
    database_url: Annotated[str | None, typer.Option(help=_DATABASE_URL_HELP)] = None,
) -> None:
    """Show one incident: state, evidence, decision, stages, actions and alarms."""
    from rich.console import Console

    from db import Ledger, UnknownIncident
    from flows.report import incident_renderables

    with Ledger.from_url(_database_url(database_url)) as ledger:
        try:
            view = ledger.get_incident(incident_id)
        except UnknownIncident as err:
            typer.echo(f"sdcguard incident: {err}", err=True)
            raise typer.Exit(1) from err
    console = Console()
    for renderable in incident_renderables(view):
        console.print(renderable)


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

    from flows.replay_incident import (
        REHEARSAL_NOTICE,
        RehearsalDecision,
        rehearsal_renderables,
        rehearse,
    )

    console = Console()
    console.print(f"[bold yellow]{REHEARSAL_NOTICE}[/]")
    where = workdir or Path(tempfile.mkdtemp(prefix="sdcguard-rehearsal-"))
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
        bool, typer.Option(help="Wait for a human to approve in the Prefect UI (prints the link).")
    ] = False,
    report: Annotated[Path | None, typer.Option(help="Write the report JSON here.")] = None,
    workdir: Annotated[Path, typer.Option(help="Where the demo keeps its state.")] = Path(
        ".sdcguard/demo"
    ),
    steps: Annotated[int, typer.Option(min=10, help="Training steps of each run.")] = 30,
    fault_step: Annotated[int, typer.Option(min=1, help="First faulty step.")] = 17,
) -> None:
    """The whole incident end to end on this machine, with proof that recovery was exact."""
    import contextlib
    import os

    from flows.demo import DemoConfig, DemoError, run_demo

    config = DemoConfig(
        fault=fault,
        faulty_node=faulty_node,
        approve_in_ui=approve_in_ui,
        report=report,
        workdir=workdir,
        steps=steps,
        fault_step=fault_step,
    )
    with contextlib.ExitStack() as stack:
        if approve_in_ui and not os.environ.get("PREFECT_API_URL"):
            from flows.prefect_server import local_prefect_server

            typer.echo("starting a local Prefect server with its UI ...")
            api_url = stack.enter_context(local_prefect_server(workdir.resolve() / "prefect"))
            os.environ["PREFECT_API_URL"] = api_url
        try:
            run_demo(config)
        except DemoError as err:
            typer.secho(f"demo failed: {err}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from err


@db_app.command("upgrade")
def db_upgrade(
    database_url: Annotated[str | None, typer.Option(help=_DATABASE_URL_HELP)] = None,
) -> None:
    """Create or migrate the ledger's tables to the newest schema."""
    from db import upgrade

    url = _database_url(database_url)
    upgrade(url)
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

    from detection.sender import drain_spool, find_spools

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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
