"""Soak: an approval answered after Prefect's *default* concurrency-lease period (300 s).

``make test`` runs ``tests/flows/test_deploy.py`` with the server's deployment lease at its
30 s minimum; this runs the same test — real ``prefect server start``, ``prefect deploy --all``
from prefect.yaml, a process worker; the run suspends for approval; the worker is killed and a
new one started; the server is restarted; then more than one lease period passes before the
answer — with the lease at Prefect's default, so the wait is over five minutes. The incident
must end ``resolved`` with exactly one replacement.

    .venv/bin/python benchmarks/durable_approval.py            # default lease, 300 s
    .venv/bin/python benchmarks/durable_approval.py --lease-s 600

Prints the outcome and the wall time; exits non-zero when the test fails.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lease-s", type=float, default=300.0, help="deployment lease (s)")
    args = parser.parse_args(argv)
    env = {
        **os.environ,
        "SDCGUARD_SOAK_LEASE_S": f"{args.lease_s:g}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
    }
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "tests/flows/test_deploy.py",
            "-p",
            "no:cacheprovider",
        ],
        cwd=REPO,
        env=env,
        check=False,
    )
    elapsed = time.monotonic() - started
    verdict = "resolved" if done.returncode == 0 else f"FAILED (pytest exit {done.returncode})"
    print(f"durable approval, lease {args.lease_s:g} s: {verdict} in {elapsed:.0f} s")
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())
