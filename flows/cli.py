"""The ``sdcguard`` command line (Typer). Each command is a thin shell over a module that owns the work."""

from __future__ import annotations

import typer

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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
