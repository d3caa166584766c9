"""The per-step row: the words each rank contributes, and the one all-gather that carries them.

Plumbing under every layer: a layer puts its evidence into words of one int64 row
(:mod:`~detection.row.words`), the guard all-gathers the rows once a step
(:mod:`~detection.row.gather`), and the collectives' works stay referenced until the training
thread drops them (:mod:`~detection.row.held_works`). Nothing here knows what a word means.
"""

from detection.row.gather import GatherInFlight, all_gather_rows, all_gather_table
from detection.row.held_works import hold
from detection.row.words import nonfinite_flag, on_host

__all__ = [
    "GatherInFlight",
    "all_gather_rows",
    "all_gather_table",
    "hold",
    "nonfinite_flag",
    "on_host",
]
