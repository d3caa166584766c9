"""Megatron-Core's rerun state machine, as an alarm: a wrapper around each rank's process.

Megatron ends a job whose result validation tripped with exit code 16
(``EXIT_CODE_RESUME_TO_DISAMBIGUATE``: restart on other hardware to tell a transient fault from
a persistent one) or 17 (``EXIT_CODE_FAILED_ON_RESULT_VALIDATION``). A scheduler that restarts on
any non-zero code reads neither, and the job loops on the bad GPU (Megatron-LM issue #3884).

``python -m detection.external.megatron [options] -- <rank command>`` runs the rank's command as
its child, copies its output through line by line, and when it exits 16 or 17 posts a signed
external alarm naming this rank's node (``NODE_NAME``, else the host name) and rank (``RANK``),
then exits with the child's code — the scheduler sees exactly what it would have seen.

Every rank exits 16/17 together (the state machine decides collectively), but only the rank
that saw the unexpected result logs ``Unexpected result … on rank R at iteration #N``. So, by
default, a wrapper reports only when its own child's output named its own rank (the step is
that iteration): one alarm, on the one node that computed the wrong number. With
``--report-all`` every rank reports its node — for a Megatron whose log says nothing; the storm
guard then hands the incident to a human, as it should when nobody is named.

Any other exit code, and a clean exit, posts nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Final

from detection.external.alarm import ExternalAlarm, Source
from detection.external.delivery import (
    WebhookTarget,
    deliver,
    job_from_env,
    node_from_env,
    rank_from_env,
)

__all__ = ["EXIT_CODES", "MegatronWatch", "main", "megatron_alarm"]

_log = logging.getLogger(__name__)

EXIT_CODES: Final = {
    16: "resume-to-disambiguate",
    17: "failed-on-result-validation",
}
"""Megatron-Core's ``rerun_state_machine`` exit codes, by the name the alarm's kind carries."""

# megatron/core/rerun_state_machine.py, validate_result: the rank that saw it logs this.
_UNEXPECTED: Final = re.compile(
    rb"Unexpected result (?P<result>.*?) on rank (?P<rank>\d+) at iteration #(?P<step>\d+)"
)
_TRACKER: Final = "latest_checkpointed_iteration.txt"


class MegatronWatch:
    """What one rank's output said about unexpected results (fed line by line, any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rank: int | None = None
        self.step: int | None = None
        self.line: str | None = None

    def feed(self, line: bytes) -> None:
        match = _UNEXPECTED.search(line)
        if match is None:
            return
        with self._lock:
            self.rank = int(match["rank"])
            self.step = int(match["step"])
            self.line = line.decode("utf-8", "replace").strip()[:1000]


def _checkpointed_step(checkpoint_dir: Path | None) -> int | None:
    """The iteration Megatron last saved (it saves before exit 16), from its tracker file."""
    if checkpoint_dir is None:
        return None
    try:
        text = (checkpoint_dir / _TRACKER).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def megatron_alarm(
    code: int,
    watch: MegatronWatch,
    *,
    job_id: str,
    node: str,
    rank: int | None,
    step: int | None = None,
    checkpoint_dir: Path | None = None,
    report_all: bool = False,
) -> ExternalAlarm | None:
    """The alarm a rank whose process exited ``code`` reports, or ``None`` (see the module)."""
    if code not in EXIT_CODES:
        return None
    named_here = watch.rank is not None and (rank is None or watch.rank == rank)
    if not named_here and not report_all:
        return None
    evidence: dict[str, object] = {
        "exit_code": code,
        "meaning": EXIT_CODES[code],
        "named_by_megatron": named_here,
    }
    if watch.line is not None:
        evidence["log_line"] = watch.line
    found_step = step
    if found_step is None and named_here:
        found_step = watch.step
    if found_step is None:
        found_step = _checkpointed_step(checkpoint_dir)
    return ExternalAlarm(
        job_id=job_id,
        source=Source.MEGATRON.value,
        kind=f"exit-{code}",
        node=node,
        rank=rank,
        step=found_step,
        evidence=evidence,
    )


def _pump(stream: IO[bytes], out: IO[bytes], watch: MegatronWatch) -> None:
    for line in iter(stream.readline, b""):
        out.write(line)
        out.flush()
        watch.feed(line)


def run_wrapped(command: Sequence[str], watch: MegatronWatch) -> int:
    """Run ``command``, its stdout and stderr copied to ours and read by ``watch``; SIGTERM and
    SIGINT are passed on to it. Returns its exit code (128 + signal for a signal death)."""
    child = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    assert child.stdout is not None
    assert child.stderr is not None
    pumps = [
        threading.Thread(target=_pump, args=(child.stdout, sys.stdout.buffer, watch), daemon=True),
        threading.Thread(target=_pump, args=(child.stderr, sys.stderr.buffer, watch), daemon=True),
    ]
    for pump in pumps:
        pump.start()
    try:
        code = child.wait()
        for pump in pumps:
            pump.join()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return code if code >= 0 else 128 - code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m detection.external.megatron",
        description="Run one Megatron rank; report exit 16/17 to sdcguard; exit with its code.",
    )
    parser.add_argument("--job-id", help="the job's id (default: SDCGUARD_JOB_ID)")
    parser.add_argument("--node", help="this rank's node (default: NODE_NAME, else host name)")
    parser.add_argument("--rank", type=int, help="this rank (default: RANK / SLURM_PROCID)")
    parser.add_argument("--step", type=int, help="the iteration, if known outside the log")
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="Megatron's --save directory: the step from latest_checkpointed_iteration.txt",
    )
    parser.add_argument(
        "--report-all",
        action="store_true",
        help="report this rank's node on 16/17 even if its log did not name this rank",
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the 2xx")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the rank's command")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        _parser().error("give the rank's command after --")
    watch = MegatronWatch()
    code = run_wrapped(command, watch)
    if code in EXIT_CODES:
        try:
            alarm = megatron_alarm(
                code,
                watch,
                job_id=args.job_id or job_from_env(),
                node=args.node or node_from_env(),
                rank=args.rank if args.rank is not None else rank_from_env(),
                step=args.step,
                checkpoint_dir=args.checkpoint_dir,
                report_all=args.report_all,
            )
            if alarm is not None:
                deliver(alarm, WebhookTarget.from_env(), timeout_s=args.timeout)
        except Exception:  # the job's exit code is what the scheduler must see, whatever we hit
            _log.exception("could not report Megatron's exit %d to sdcguard", code)
    return code


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("SDCGUARD_LOG_LEVEL", "INFO"))
    sys.exit(main())
