"""The ``sdcguard`` command line (Typer). Each command is a thin shell over a module that owns the work."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    name="sdcguard",
    help="Catch Silent Data Corruption in distributed PyTorch training and recover from it safely.",
    no_args_is_help=True,
    add_completion=False,
)


@app.command()
def train(
    world_size: Annotated[int, typer.Option(min=1, help="Number of DDP processes.")] = 4,
    ranks_per_node: Annotated[
        int, typer.Option(min=1, help="Ranks per simulated node (node-0, node-1, ...).")
    ] = 1,
    nodes: Annotated[
        str | None, typer.Option(help="Comma-separated node name per rank (overrides --ranks-per-node).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of data, init and dropout.")] = 0,
    steps: Annotated[int, typer.Option(min=1, help="Steps 0..N-1.")] = 100,
    audit_every: Annotated[int, typer.Option(min=0, help="Ring audit every K steps (0: none).")] = 10,
    audit_mode: Annotated[str, typer.Option(help="loss | gradient")] = "loss",
    inject: Annotated[
        list[str] | None, typer.Option(help="Fault spec KIND@RANK:STEP[:BIT] or KIND@node=NAME[:from=STEP].")
    ] = None,
    checkpoint_dir: Annotated[Path | None, typer.Option(help="Where checkpoints are written.")] = None,
    checkpoint_every: Annotated[int, typer.Option(min=0, help="Checkpoint every K steps (0: none).")] = 0,
    resume_from: Annotated[Path | None, typer.Option(help="Checkpoint file to resume from.")] = None,
    webhook: Annotated[str | None, typer.Option(help="Alarm webhook base URL.")] = None,
    report: Annotated[Path | None, typer.Option(help="Write the report JSON here.")] = None,
    plain: Annotated[bool, typer.Option(help="Plain DDP, no sdcguard: the overhead baseline.")] = False,
    job_id: Annotated[str | None, typer.Option(help="Job id used in the ledger.")] = None,
    threads: Annotated[int, typer.Option(min=1, help="Intra-op threads per rank.")] = 1,
    trace: Annotated[Path | None, typer.Option(help="Per-step JSON lines (losses, fingerprints).")] = None,
    probe_step: Annotated[int | None, typer.Option(help="Record per-submodule fingerprints at this step.")] = None,
    probe: Annotated[Path | None, typer.Option(help="Where the per-submodule probe is written.")] = None,
    halt_on_alarm: Annotated[bool, typer.Option(help="Stop the job after the first alarm.")] = False,
) -> None:
    """Run a local DDP job on CPU (gloo) with sdcguard's detection."""
    from detection.harness import TrainConfig, run

    config = TrainConfig(
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        nodes=nodes.split(",") if nodes else None,
        seed=seed,
        steps=steps,
        audit_every=audit_every,
        audit_mode=audit_mode,
        inject=list(inject or []),
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        resume_from=resume_from,
        webhook=webhook,
        report=report,
        plain=plain,
        job_id=job_id,
        threads=threads,
        trace=trace,
        probe_step=probe_step,
        probe=probe,
        halt_on_alarm=halt_on_alarm,
    )
    result = run(config)
    typer.echo(json.dumps({"alarms": len(result["alarms"]), "final_fingerprint": result["final_fingerprint"]}))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
