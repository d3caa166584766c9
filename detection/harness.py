"""``python -m detection.harness``: ``sdcguard train`` in a training image (stdlib argparse).

The job itself is :mod:`detection.simulation`; this module keeps the command and the names
scripts import from it.
"""

import sys

if __name__ == "__main__":  # the ranks' imports start now, beside the launcher's own
    from detection.simulation.forkserver import start_early

    start_early(sys.argv[1:])

from detection.simulation.cli import main
from detection.simulation.config import (
    HarnessConfigError,
    HarnessError,
    RankFailedError,
    TrainConfig,
)
from detection.simulation.launch import run
from detection.simulation.train_args import parse_config

__all__ = [
    "HarnessConfigError",
    "HarnessError",
    "RankFailedError",
    "TrainConfig",
    "main",
    "parse_config",
    "run",
]

if __name__ == "__main__":
    sys.exit(main())
