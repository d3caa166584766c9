"""Diagnostic reruns on the simulated cluster: ``sdcguard train`` processes on this host."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from recovery.diagnosis.rerun import RerunRequest, RerunResult, harness_args, load_trace
from recovery.errors import PermanentError, TemporaryError

__all__ = ["LocalRerunner"]

log = logging.getLogger(__name__)


class LocalRerunner:
    """Reruns as ``sdcguard train --resume-from …`` processes with every rank on one simulated
    node, so a persistent ``KIND@node=NAME`` fault of that node's hardware applies to the rerun
    exactly as it did to training.

    Its simulated nodes share this host's cores, and a rerun's ranks step in lockstep: run side
    by side, several reruns would only slow each other down, so they run one after the other
    (no ``parallel``)."""

    def __init__(
        self,
        workdir: Path,
        *,
        command: Sequence[str] | None = None,
        timeout_s: float = 600.0,
        env: dict[str, str] | None = None,
        on_launch: Callable[[list[str]], None] | None = None,
    ) -> None:
        self._workdir = workdir
        self._command = list(command or [sys.executable, "-m", "detection.harness"])
        self._timeout_s = timeout_s
        self._env = env
        self._on_launch = on_launch

    def rerun(self, request: RerunRequest) -> RerunResult:
        self._workdir.mkdir(parents=True, exist_ok=True)
        out = Path(tempfile.mkdtemp(prefix=f"replay-{request.node}-", dir=self._workdir))
        trace = out / "trace.jsonl"
        probe = out / "probe.json"
        args = harness_args(request, trace=trace, probe=probe)
        argv = [*self._command, *args]
        if self._on_launch is not None:
            self._on_launch(argv)
        log_path = out / "replay.log"
        extra = {"job": request.job_id, "node": request.node}
        log.info("replaying steps %d..%d", request.start, request.end, extra=extra)
        env = {**os.environ, **(self._env or {})}
        try:
            with log_path.open("wb") as fh:
                proc = subprocess.run(
                    argv, stdout=fh, stderr=subprocess.STDOUT, timeout=self._timeout_s, env=env
                )
        except subprocess.TimeoutExpired as err:
            raise TemporaryError(
                "replay", "run", request.node, f"timed out after {self._timeout_s} s"
            ) from err
        if proc.returncode != 0:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise PermanentError(
                "replay", "run", request.node, f"exit code {proc.returncode}: {tail}"
            )
        steps = tuple(r for r in load_trace(trace) if r.step >= request.start)
        probe_data = json.loads(probe.read_text()) if probe.exists() else None
        return RerunResult(request.node, steps, probe_data, str(log_path))
