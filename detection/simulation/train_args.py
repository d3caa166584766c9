"""The arguments of ``sdcguard train``, declared once: the command line, and what the control
plane reads from and rewrites in a recorded job's arguments.

Stdlib only (a checked contract): the launcher parses its command line here before it imports
torch, and the control plane — whose image has no torch — derives a diagnostic run's inputs
(:func:`known_train_args`) and a resumed run's arguments (:func:`resume_args`) from the very
declaration the job was started with, instead of re-declaring the options it needs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from detection.simulation.config import AUDIT_MODES, SECRET_ENV, TrainConfig
from detection.simulation.parallel import PARALLEL_MODES

__all__ = [
    "OUTPUT_OPTIONS",
    "TrainArgsError",
    "known_train_args",
    "parse_config",
    "resume_args",
    "train_parser",
]

#: The options that name a run's output files: a resumed run never writes over them.
OUTPUT_OPTIONS = ("--report", "--trace", "--probe")
_PLACEMENT_OPTIONS = ("--resume-from", "--nodes")


class TrainArgsError(ValueError):
    """Recorded ``sdcguard train`` arguments that do not parse (the option is named)."""


def train_parser(*, exit_on_error: bool = True) -> argparse.ArgumentParser:
    """The ``sdcguard train`` parser; its destinations are :class:`TrainConfig`'s fields."""
    p = argparse.ArgumentParser(
        prog="sdcguard train",
        description="A local DDP (or FSDP2/HSDP: --parallel) job on CPU (gloo) with "
        "sdcguard's detection; prints a one-line summary, writes the report with --report.",
        exit_on_error=exit_on_error,
    )
    d = TrainConfig()
    _job_options(p, d)
    _output_options(p)
    _guard_options(p, d)
    return p


def _job_options(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    p.add_argument("--world-size", type=int, default=d.world_size, help="rank processes")
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=d.ranks_per_node,
        help="ranks per simulated node (node-0, node-1, ...)",
    )
    p.add_argument(
        "--nodes",
        type=lambda s: [n.strip() for n in s.split(",")],
        default=None,
        help="explicit node name per rank, comma-separated (overrides --ranks-per-node)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--steps", type=int, default=d.steps, help="steps 0..N-1")
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SPEC",
        help="KIND@RANK:STEP[:BIT] or KIND@node=NAME[:from=STEP] (repeatable)",
    )
    p.add_argument("--checkpoint-dir", type=Path, default=None)
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        help="checkpoint after steps with step %% C == 0 (0: none)",
    )
    p.add_argument("--resume-from", type=Path, default=None, help="checkpoint file to resume")
    p.add_argument("--webhook", default=None, help=f"alarm webhook URL (secret: ${SECRET_ENV})")
    p.add_argument("--plain", action="store_true", help="plain DDP, no sdcguard (baseline)")
    p.add_argument("--job-id", default=None, help="default local-<seed>")
    p.add_argument("--threads", type=int, default=d.threads, help="intra-op threads per rank")
    p.add_argument(
        "--parallel",
        choices=PARALLEL_MODES,
        default=d.parallel,
        help="ddp: every rank the whole model (the default); fsdp: FSDP2, fully_shard on each "
        "block and the root over a 1-D mesh of all ranks; hsdp: the same on a 2-D "
        "(replicate, shard) mesh. Under fsdp/hsdp the ring audit runs in loss mode only, "
        "and no --abft/--abft-every, --skip-update-on-alarm, "
        "--defer-decision, --trace/--probe (refused); checkpoints are directories ckpt-<step>/ "
        "sealed by manifest.json, --resume-from takes one (or its manifest) under any mesh; "
        "--inject takes grad-flip, grad-nan, act-flip and weight-flip (the rank's own shards)",
    )
    p.add_argument(
        "--shard-size",
        type=int,
        default=None,
        metavar="S",
        help="hsdp: ranks per replica, the mesh is (world/S, S) (default: the ranks of one "
        "node, --ranks-per-node, so a replica's shards stay within a node)",
    )


def _output_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", type=Path, default=None, help="write the report JSON here")
    p.add_argument("--trace", type=Path, default=None, help="JSON lines, one per step")
    p.add_argument("--probe-step", type=int, default=None)
    p.add_argument("--probe", type=Path, default=None, help="per-submodule fingerprints")


def _guard_options(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    p.add_argument(
        "--audit-every",
        type=int,
        default=d.audit_every,
        help="ring audit on steps with step %% K == 0 (0: no audit)",
    )
    p.add_argument("--audit-mode", choices=AUDIT_MODES, default=d.audit_mode)
    p.add_argument("--halt-on-alarm", action="store_true", help="stop after the first alarm")
    abft = p.add_mutually_exclusive_group()
    abft.add_argument(
        "--abft",
        dest="abft",
        action="store_const",
        const=True,
        default=None,
        help="layer checksums on every step (the default)",
    )
    abft.add_argument(
        "--no-abft",
        dest="abft",
        action="store_const",
        const=False,
        help="no layer checksums: the per-step statistics alone",
    )
    p.add_argument(
        "--abft-every",
        type=int,
        default=None,
        metavar="K",
        help="check each layer's checksums once every K steps, in rotation (default: the "
        "guard's, 8); 1: every layer on every step",
    )
    p.add_argument(
        "--skip-update-on-alarm",
        action="store_true",
        help="a step the per-step layer finds corrupted updates no weight, on every rank",
    )
    p.add_argument(
        "--defer-decision",
        action="store_true",
        help="decide each step at the end of the next: its all-gather overlaps that step "
        "(alarms name their step, one step later)",
    )
    p.add_argument(
        "--hold-after-halt",
        dest="hold_after_halt_s",
        type=float,
        default=d.hold_after_halt_s,
        metavar="SECONDS",
        help="with --halt-on-alarm: stay alive, training no further, up to SECONDS for a stop",
    )


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """The :class:`TrainConfig` of a ``sdcguard train`` command line (``SystemExit`` on bad
    options, as argparse does)."""
    return TrainConfig(**vars(train_parser().parse_args(argv)))


def known_train_args(args: Sequence[str]) -> TrainConfig:
    """The :class:`TrainConfig` of recorded job arguments, ignoring options it does not know
    (a user's job may add its own). Raises :class:`TrainArgsError` on a malformed option."""
    parser = train_parser(exit_on_error=False)
    try:
        known, _ = parser.parse_known_args(list(args))
    except argparse.ArgumentError as err:
        raise TrainArgsError(str(err)) from err
    return TrainConfig(**vars(known))


def resume_args(
    args: Sequence[str],
    checkpoint_uri: str,
    nodes: Sequence[str] | None,
    *,
    output_tag: str | None = None,
) -> list[str]:
    """``args`` without any ``--resume-from``/``--nodes`` (both ``--opt v`` and ``--opt=v``
    forms), plus ``--resume-from <checkpoint_uri>`` and, given ``nodes``, ``--nodes a,b,c``.

    With ``output_tag``, the run's output files (:data:`OUTPUT_OPTIONS`) get the tag before
    their suffix (``report.json`` → ``report.<tag>.json``): a resumed run must never overwrite
    the report and trace of the run it recovers from — they are the incident's evidence.
    """
    stripped: list[str] = []
    skip_next = False
    retag = False
    for arg in args:
        if skip_next:
            skip_next = False
            continue
        if retag:
            retag = False
            stripped.append(_tagged(arg, output_tag))
            continue
        if arg in _PLACEMENT_OPTIONS:
            skip_next = True
            continue
        if arg.startswith(tuple(f"{o}=" for o in _PLACEMENT_OPTIONS)):
            continue
        if output_tag and arg in OUTPUT_OPTIONS:
            retag = True
        elif output_tag and arg.startswith(tuple(f"{o}=" for o in OUTPUT_OPTIONS)):
            option, _, value = arg.partition("=")
            arg = f"{option}={_tagged(value, output_tag)}"
        stripped.append(arg)
    stripped += ["--resume-from", checkpoint_uri]
    if nodes is not None:
        stripped += ["--nodes", ",".join(nodes)]
    return stripped


def _tagged(path: str, tag: str | None) -> str:
    if not tag:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{tag}{p.suffix}"))
