"""The ``sdcguard train`` arguments of a resumed run, derived from the original run's.

A resumed run keeps every original argument except where to resume from and on which nodes,
and never writes over the original run's report and trace: they are the incident's evidence.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

_OUTPUT_OPTIONS = ("--report", "--trace", "--probe")


def resume_args(
    args: Sequence[str],
    checkpoint_uri: str,
    nodes: Sequence[str] | None,
    *,
    output_tag: str | None = None,
) -> list[str]:
    """``args`` without any ``--resume-from``/``--nodes`` (both ``--opt v`` and ``--opt=v``
    forms), plus ``--resume-from <checkpoint_uri>`` and, given ``nodes``, ``--nodes a,b,c``.

    With ``output_tag``, the run's output files (``--report``, ``--trace``, ``--probe``) get the
    tag before their suffix (``report.json`` → ``report.<tag>.json``): a resumed run must never
    overwrite the report and trace of the run it recovers from — they are the incident's
    evidence.
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
        if arg in ("--resume-from", "--nodes"):
            skip_next = True
            continue
        if arg.startswith(("--resume-from=", "--nodes=")):
            continue
        if output_tag and arg in _OUTPUT_OPTIONS:
            retag = True
        elif output_tag and arg.startswith(tuple(f"{o}=" for o in _OUTPUT_OPTIONS)):
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
