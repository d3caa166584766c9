"""Job control for local ``sdcguard train`` runs: one process group per launch.

The job's state is a JSON file per job in a state directory, written atomically and under a
per-job ``flock``, so the flow, the demo and the webhook, each in its own process, control the
same jobs and never launch one twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from recovery.errors import NotFoundError, PermanentError, TemporaryError
from recovery.jobs import (
    JobKind,
    JobRef,
    JobStatus,
    ResumeOutcome,
    ResumeResult,
    StopOutcome,
    StopResult,
)
from recovery.local.process_group import (
    SUPERVISOR,
    group_alive,
    read_returncode,
    reap_children,
    signals_deferred,
    start_ticks,
    track_child,
    tracked_child,
)
from recovery.local.train_args import resume_args

log = logging.getLogger(__name__)

SYSTEM_LOCAL = "local-jobs"
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class LocalJobControl:
    """:class:`JobControl` for local training runs, one process group per launch.

    State lives in ``<state_dir>/<job_id>.json`` (command, original arguments, every launch
    with pid, process group, start time and how it was stopped), so another process holding a
    ``LocalJobControl`` on the same directory controls the same jobs. Launch, stop and resume of
    one job are serialised by a ``flock`` on ``<job_id>.lock``.
    """

    def __init__(
        self,
        state_dir: Path,
        python: str = sys.executable,
        *,
        command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        stop_timeout_s: float = 10.0,
        kill_timeout_s: float = 5.0,
        poll_interval_s: float = 0.02,
    ) -> None:
        self._dir = Path(state_dir)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._python = python
        self._command = (
            list(command) if command is not None else [python, "-m", "detection.harness"]
        )
        self._env = dict(env or {})
        self._stop_timeout_s = stop_timeout_s
        self._kill_timeout_s = kill_timeout_s
        self._poll_s = poll_interval_s

    # -- launching ---------------------------------------------------------------------

    def launch(self, job_id: str, args: list[str], log_path: Path) -> int:
        """Start ``command + args`` in a new session (its own process group); return the pid
        of the group leader. Idempotent: if the job runs with these very arguments already,
        its pid is returned; with other arguments the call is refused."""
        _check_job_id(job_id)
        with self._job_lock(job_id):
            record = self._load(job_id)
            if record is not None and record["launches"]:
                last = record["launches"][-1]
                if self._alive(last):
                    if last["args"] == list(args):
                        return int(last["pid"])
                    raise PermanentError(
                        SYSTEM_LOCAL,
                        "launch",
                        f"job/{job_id}",
                        f"already running as pid {last['pid']} with other arguments",
                    )
            history = record["launches"] if record is not None else []
            record = {
                "job_id": job_id,
                "command": self._command,
                "original_args": list(args),
                "log_path": str(Path(log_path).resolve()),
                "launches": history,
            }
            launch = self._start(record, list(args), resume=None)
        log.info("launched %s as pid %d", job_id, launch["pid"], extra={"job": job_id})
        return int(launch["pid"])

    # -- the protocol ------------------------------------------------------------------

    def status(self, job: JobRef) -> JobStatus:
        job_id = self._job_id(job)
        record = self._require(job_id, "status")
        return self._launch_status(job_id, record["launches"][-1])

    def stop(self, job: JobRef) -> StopResult:
        """SIGTERM the process group, wait (bounded), SIGKILL what is left, record it."""
        job_id = self._job_id(job)
        with self._job_lock(job_id):
            record = self._require(job_id, "stop")
            launch = record["launches"][-1]
            if not self._alive(launch):
                if launch.get("stopped_at"):
                    return StopResult(job, StopOutcome.ALREADY_STOPPED)
                state = self._launch_status(job_id, launch)
                return StopResult(job, StopOutcome.NOT_RUNNING, f"job has {state}")
            pgid = int(launch["pgid"])
            extra = {"job": job_id}
            log.info("stopping %s: SIGTERM to process group %d", job_id, pgid, extra=extra)
            used = "SIGTERM"
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                state = self._launch_status(job_id, launch)
                return StopResult(job, StopOutcome.NOT_RUNNING, f"job has {state}")
            except PermissionError as err:
                raise PermanentError(
                    SYSTEM_LOCAL, "stop", f"job/{job_id}", f"not allowed to signal group {pgid}"
                ) from err
            if not self._wait_gone(launch, self._stop_timeout_s):
                used = "SIGKILL"
                log.warning(
                    "%s still alive %.1fs after SIGTERM: SIGKILL to group %d",
                    job_id,
                    self._stop_timeout_s,
                    pgid,
                    extra=extra,
                )
                with contextlib.suppress(ProcessLookupError):  # it may end in between: fine
                    os.killpg(pgid, signal.SIGKILL)
                if not self._wait_gone(launch, self._kill_timeout_s):
                    raise TemporaryError(
                        SYSTEM_LOCAL,
                        "stop",
                        f"job/{job_id}",
                        f"process group {pgid} still alive after SIGKILL",
                    )
            launch["stopped_at"] = _utcnow()
            launch["stop_signal"] = used
            self._save(job_id, record)
        log.info("stopped %s (%s)", job_id, used, extra=extra)
        return StopResult(job, StopOutcome.STOPPED, f"process group {pgid} ended by {used}")

    def resume(
        self, job: JobRef, checkpoint_uri: str, step: int, nodes: list[str] | None
    ) -> ResumeResult:
        """Launch again with the original arguments, resumed from ``checkpoint_uri`` (and on
        ``nodes``, one name per rank). A second call while — or after — that very run does
        nothing and says so."""
        job_id = self._job_id(job)
        pinned = tuple(nodes) if nodes is not None else None
        with self._job_lock(job_id):
            record = self._require(job_id, "resume")
            wanted = resume_args(
                record["original_args"], checkpoint_uri, nodes, output_tag=f"resumed-{step}"
            )
            last = record["launches"][-1]
            if self._alive(last):
                if last["args"] == wanted:
                    return ResumeResult(
                        job,
                        ResumeOutcome.ALREADY_RESUMED,
                        checkpoint_uri,
                        step,
                        pinned,
                        last["pid"],
                    )
                raise PermanentError(
                    SYSTEM_LOCAL,
                    "resume",
                    f"job/{job_id}",
                    f"job is running as pid {last['pid']} with other arguments: stop it first",
                )
            if last["args"] == wanted and self._launch_status(job_id, last) is JobStatus.SUCCEEDED:
                return ResumeResult(
                    job, ResumeOutcome.ALREADY_RESUMED, checkpoint_uri, step, pinned, last["pid"]
                )
            launch = self._start(
                record, wanted, resume={"checkpoint_uri": checkpoint_uri, "step": step}
            )
        log.info(
            "resumed %s from %s (step %d) as pid %d",
            job_id,
            checkpoint_uri,
            step,
            launch["pid"],
            extra={"job": job_id, "step": step},
        )
        return ResumeResult(
            job, ResumeOutcome.RESUMED, checkpoint_uri, step, pinned, int(launch["pid"])
        )

    def wait(self, job: JobRef, timeout_s: float) -> JobStatus:
        """Wait until the job's current run ends (or ``timeout_s`` passes); return its status."""
        job_id = self._job_id(job)
        record = self._require(job_id, "wait")
        launch = record["launches"][-1]
        self._wait_gone(launch, timeout_s)
        return self._launch_status(job_id, launch)

    def pid(self, job: JobRef) -> int:
        """The process-group leader of the job's current run."""
        job_id = self._job_id(job)
        return int(self._require(job_id, "pid")["launches"][-1]["pid"])

    # -- internals ---------------------------------------------------------------------

    def _start(
        self, record: dict[str, Any], args: list[str], resume: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        """Start one run and save ``record`` with it, as one step: started means recorded, so
        ``stop()`` can always find a run. SIGINT/SIGTERM wait until the record is on disk; a
        record that cannot be written kills the run it would have named, and the error goes on."""
        with signals_deferred():
            launch = self._spawn(record, args, resume)
            try:
                self._save(record["job_id"], record)
            except Exception:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(int(launch["pgid"]), signal.SIGKILL)
                raise
        return launch

    def _spawn(
        self, record: dict[str, Any], args: list[str], resume: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        job_id = record["job_id"]
        number = len(record["launches"]) + 1
        exit_path = self._dir / f"{job_id}.{number}.exit"
        with contextlib.suppress(FileNotFoundError):
            exit_path.unlink()  # a stale file from an earlier state directory would lie
        log_path = Path(record["log_path"])
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self._env}
        argv = [self._python, "-c", SUPERVISOR, str(exit_path), *record["command"], *args]
        with open(log_path, "ab") as log_file:
            try:
                process = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=env,
                )
            except OSError as err:
                raise PermanentError(
                    SYSTEM_LOCAL, "launch", f"job/{job_id}", f"cannot start {argv[0]}: {err}"
                ) from err
        track_child(process)
        launch = {
            "number": number,
            "args": args,
            "pid": process.pid,
            "pgid": process.pid,  # start_new_session: the leader's pid is the group id
            "start_ticks": start_ticks(process.pid),
            "started_at": _utcnow(),
            "exit_path": str(exit_path),
            "resume": dict(resume) if resume is not None else None,
            "stopped_at": None,
            "stop_signal": None,
        }
        record["launches"].append(launch)
        return launch

    def _launch_status(self, job_id: str, launch: Mapping[str, Any]) -> JobStatus:
        if self._alive(launch):
            return JobStatus.RUNNING
        returncode = read_returncode(Path(launch["exit_path"]))
        if returncode == 0:
            return JobStatus.SUCCEEDED
        if launch.get("stopped_at"):
            return JobStatus.SUSPENDED
        if returncode is not None:
            return JobStatus.FAILED
        log.warning(
            "%s: run %s ended without an exit record",
            job_id,
            launch["number"],
            extra={"job": job_id},
        )
        return JobStatus.UNKNOWN

    def _alive(self, launch: Mapping[str, Any]) -> bool:
        reap_children()
        pgid = int(launch["pgid"])
        ticks = start_ticks(pgid)
        if ticks is not None and launch.get("start_ticks") not in (None, ticks):
            # The leader's pid now names another process: our group ended long ago.
            return False
        return group_alive(pgid)

    def _wait_gone(self, launch: Mapping[str, Any], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        child = tracked_child(int(launch["pid"]))
        if child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=max(0.0, timeout_s))
        while self._alive(launch):
            if time.monotonic() >= deadline:
                return False
            time.sleep(self._poll_s)
        return True

    def _job_id(self, job: JobRef) -> str:
        if job.kind is not None and job.kind is not JobKind.LOCAL:
            raise ValueError(f"LocalJobControl controls local jobs, not {job.kind}")
        _check_job_id(job.name)
        return job.name

    def _require(self, job_id: str, verb: str) -> dict[str, Any]:
        record = self._load(job_id)
        if record is None or not record.get("launches"):
            raise NotFoundError(SYSTEM_LOCAL, verb, f"job/{job_id}", "never launched here")
        return record

    def _load(self, job_id: str) -> dict[str, Any] | None:
        path = self._dir / f"{job_id}.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except ValueError as err:
            raise PermanentError(
                SYSTEM_LOCAL, "read", str(path), f"corrupt job record: {err}"
            ) from err
        if not isinstance(raw, dict):
            raise PermanentError(SYSTEM_LOCAL, "read", str(path), "corrupt job record")
        return raw

    def _save(self, job_id: str, record: Mapping[str, Any]) -> None:
        path = self._dir / f"{job_id}.json"
        fd, tmp = tempfile.mkstemp(prefix=f"{job_id}.", suffix=".tmp", dir=self._dir)
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(record, handle, indent=1)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def _job_lock(self, job_id: str) -> Iterator[None]:
        fd = os.open(self._dir / f"{job_id}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def _check_job_id(job_id: str) -> None:
    if not _JOB_ID.match(job_id):
        raise ValueError(f"job id {job_id!r} must match {_JOB_ID.pattern} (it names files)")


def _utcnow() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
