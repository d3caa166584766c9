"""The per-step layer: statistics, all-reduce algebra and checksums, decided before the update.

* :mod:`~detection.stepcheck.checks` — the layer as the guard drives it (:class:`StepChecks`);
* :mod:`~detection.stepcheck.gradstats` (with its engines ``gradstats_detector`` and
  ``gradstats_arrays``) — cross-rank and temporal statistics of the local gradients, and
  :mod:`~detection.stepcheck.headroom`, how close clean steps came to their floor;
* :mod:`~detection.stepcheck.allreduce` — an algebraic check of the all-reduce;
* :mod:`~detection.stepcheck.abft` and ``abft_layers`` — checksums of the layers' arithmetic,
  read in units of the rounding bound :mod:`~detection.stepcheck.abft_bound` derives.
"""

from detection.stepcheck.abft import LinearChecksums
from detection.stepcheck.checks import StepChecks
from detection.stepcheck.gradstats import StatsConfig, StatsConfigError

__all__ = [
    "LinearChecksums",
    "StatsConfig",
    "StatsConfigError",
    "StepChecks",
]
