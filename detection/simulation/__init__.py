"""The simulation behind ``sdcguard train``: a local DDP job of simulated nodes on CPU.

* :mod:`~detection.simulation.train_args` and :mod:`~detection.simulation.config` — the
  arguments and the job's configuration, stdlib only (the control plane imports them);
* :mod:`~detection.simulation.launch`, :mod:`~detection.simulation.rank`,
  :mod:`~detection.simulation.rank_setup`, :mod:`~detection.simulation.report`,
  :mod:`~detection.simulation.cli` — the launcher, one rank's loop, its set-up and resume, its
  report, the command line;
* :mod:`~detection.simulation.diagnostics` — the trace and probe of a diagnostic run;
* :mod:`~detection.simulation.model`, :mod:`~detection.simulation.workloads` — the built-in
  model and the guarded loops the benchmarks and tests share;
* :mod:`~detection.simulation.forkserver`, :mod:`~detection.simulation.termination` — fast rank
  start, and SIGTERM as a stop.

Names are imported on first use, so ``from detection.simulation import resume_args`` imports no
torch.
"""

from typing import TYPE_CHECKING

from detection._lazy import lazy_exports

if TYPE_CHECKING:
    from detection.simulation.cli import main
    from detection.simulation.config import (
        HarnessConfigError,
        HarnessError,
        RankFailedError,
        TrainConfig,
    )
    from detection.simulation.launch import run
    from detection.simulation.train_args import (
        TrainArgsError,
        known_train_args,
        parse_config,
        resume_args,
        train_parser,
    )

__all__ = [
    "HarnessConfigError",
    "HarnessError",
    "RankFailedError",
    "TrainArgsError",
    "TrainConfig",
    "known_train_args",
    "main",
    "parse_config",
    "resume_args",
    "run",
    "train_parser",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "HarnessConfigError": "config",
        "HarnessError": "config",
        "RankFailedError": "config",
        "TrainConfig": "config",
        "TrainArgsError": "train_args",
        "known_train_args": "train_args",
        "parse_config": "train_args",
        "resume_args": "train_args",
        "train_parser": "train_args",
        "run": "launch",
        "main": "cli",
    },
)
