"""The ranks' fork server starts before the launcher imports torch, and holds what ranks need.

Each case runs in a fresh interpreter: the fork server is one per process, and this test
process may have started one already.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import multiprocessing, os, sys
    from pathlib import Path
    from detection.simulation.forkserver import start_early

    def children():
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                    cmdline = (entry / "cmdline").read_bytes().replace(b"\\0", b" ").decode()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                    found.append(cmdline)
        return found

    def loaded(queue):
        wanted = ("torch", "torch._dynamo", "detection.guard.sdcguard")
        queue.put(sorted(m for m in wanted if m in sys.modules))

    if __name__ == "__main__":
        start_early(sys.argv[1:])
        servers = [c for c in children() if "multiprocessing.forkserver" in c]
        print("servers", len(servers), "torch-here", "torch" in sys.modules)
        if servers:
            ctx = multiprocessing.get_context("forkserver")
            queue = ctx.Queue()
            proc = ctx.Process(target=loaded, args=(queue,))
            proc.start()
            print("rank-sees", queue.get(timeout=60))
            proc.join()
            after = [c for c in children() if "multiprocessing.forkserver" in c]
            print("servers-after", len(after))
    """
)


def _run(tmp_path: Path, *args: str) -> str:
    script = tmp_path / "launcher.py"  # a file: the rank unpickles its target from it
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_fork_server_starts_before_torch_is_imported_and_preloads_the_ranks_modules(
    tmp_path: Path,
) -> None:
    out = _run(tmp_path, "--world-size", "2")
    assert "servers 1 torch-here False" in out
    # the rank forked from that server, with torch, dynamo and the guard already imported
    assert "rank-sees ['detection.guard.sdcguard', 'torch', 'torch._dynamo']" in out
    assert "servers-after 1" in out  # the launcher's rank used it; no second server


def test_asking_for_help_starts_no_fork_server(tmp_path: Path) -> None:
    assert "servers 0 torch-here False" in _run(tmp_path, "--help")
