"""Repeated exits of a torchrun-style script right after the guard's last collective.

A backend thread that drops a finished collective last must take the GIL to free its tensors;
while the interpreter finalizes, that aborts the process ("terminate called ..."). The guard
holds its last works (``detection/row/held_works.py``) so this cannot happen. The race is
probabilistic: before the fix about one exit in two aborted after an alarm and one in three on
a clean run. ``tests/detection/row/test_held_works.py`` runs the script once each way; this
runs it ``--runs`` times each way and prints how many exits were clean.

    python benchmarks/script_exit.py --runs 10
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

# The script is the test's own, so the test and this repetition can never drift apart.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.detection.row.test_held_works import SCRIPT


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="exits of each kind (default 10)")
    args = parser.parse_args()
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(SCRIPT)
        for label, inject in (("after an alarm", "weight-flip@1:5"), ("clean", "")):
            clean = 0
            for _ in range(args.runs):
                done = subprocess.run(
                    [sys.executable, str(script), inject],
                    capture_output=True,
                    text=True,
                    timeout=180,
                )
                aborted = "terminate called" in done.stderr or done.returncode != 0
                clean += not aborted
            failures += args.runs - clean
            print(f"{label:>15}: {clean}/{args.runs} exits clean")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
