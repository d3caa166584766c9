"""The ``sdcguard train`` arguments of a resumed run, derived from the original run's.

A resumed run keeps every original argument except where to resume from and on which nodes,
and never writes over the original run's report and trace: they are the incident's evidence.
The arguments are declared once, by the job itself (:mod:`detection.simulation.train_args`).
"""

from __future__ import annotations

from detection.simulation import resume_args

__all__ = ["resume_args"]
