"""The newcomer's commands as subprocesses, from an environment with no Prefect setting, and
the processes they leave (or must not leave) behind, seen through psutil."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import psutil

REPO = Path(__file__).resolve().parents[2]


def newcomer_env(home: Path) -> dict[str, str]:
    """This environment without a single Prefect setting, and a home with no Prefect profile."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    home.mkdir(parents=True, exist_ok=True)
    env.update(
        HOME=str(home),
        PYTHONPATH=str(REPO),
        DO_NOT_TRACK="1",
        # the paused run looks for the form's answer every second, so the test waits less
        SDCGUARD_FLOW_APPROVAL_POLL_S="1",
    )
    return env


class CliProcess:
    """An ``sdcguard`` command as a subprocess: its output collected line by line, its
    processes (a Prefect server included, whatever its session) noted while it runs."""

    def __init__(self, args: list[str], workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", *args, "--workdir", str(workdir)],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.seen: dict[int, psutil.Process] = {}
        assert self.proc.stdout is not None
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def note_processes(self) -> list[psutil.Process]:
        """Every live descendant of the command, remembered for :meth:`left_behind`."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for child in children:
            self.seen.setdefault(child.pid, child)
        return children

    def wait_for_line(self, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        checked = 0
        with self._changed:
            while True:
                for line in self.lines[checked:]:
                    found = pattern.search(line)
                    if found:
                        return found
                checked = len(self.lines)
                if self.proc.poll() is not None:
                    raise AssertionError(
                        f"the command ended ({self.proc.returncode}):\n{self.output}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no line {pattern.pattern!r} in:\n{self.output}")
                self._changed.wait(min(left, 2.0))
                self.note_processes()

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the command still runs after {timeout_s:g} s:\n{self.output}"
            ) from None

    def left_behind(self) -> list[str]:
        """Processes seen under the command that still live (zombies count as gone), each as
        pid, process group and command line, so a failure says what was left."""
        alive = []
        for process in self.seen.values():
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    cmdline = " ".join(process.cmdline())[:300]
                    alive.append(f"pid {process.pid} pgid {os.getpgid(process.pid)}: {cmdline}")
            except (psutil.NoSuchProcess, ProcessLookupError):
                continue
        return alive

    def kill_all(self) -> None:
        """Teardown of a failed test: the command and everything it started, by pid."""
        self.note_processes()
        with contextlib.suppress(psutil.NoSuchProcess):  # the command may have ended already
            psutil.Process(self.proc.pid).kill()
        for process in self.seen.values():
            try:
                process.kill()
            except psutil.NoSuchProcess:
                continue
        self.proc.wait()


def prefect_processes(processes: list[psutil.Process]) -> list[psutil.Process]:
    found = []
    for process in processes:
        try:
            if "prefect" in " ".join(process.cmdline()):
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found


@contextlib.contextmanager
def cli_process(args: list[str], workdir: Path, home: Path) -> Iterator[CliProcess]:
    """The command running; killed with all it started if the test left it running."""
    process = CliProcess(args, workdir, newcomer_env(home))
    try:
        yield process
    finally:
        if process.proc.poll() is None or process.left_behind():
            process.kill_all()
