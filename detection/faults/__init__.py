"""Fault injection as DESIGN's fault spec: the spec (torch-free) and the injector.

:mod:`detection.faults.spec` parses ``KIND@RANK:STEP[:BIT][:in=recompute]`` and
``KIND@node=NAME[:from=STEP]`` with the stdlib alone (the launcher checks ``--inject`` before
it starts a rank);
:mod:`detection.faults.injector` makes a rank suffer one, in its own steps or in a recomputation.
"""

from typing import TYPE_CHECKING

from detection._lazy import lazy_exports

if TYPE_CHECKING:
    from detection.faults.injector import FaultInjector, flip_bit_
    from detection.faults.spec import (
        DEFAULT_BIT,
        Computation,
        FaultInjectionError,
        FaultKind,
        FaultSpec,
        FaultSpecError,
    )

__all__ = [
    "DEFAULT_BIT",
    "Computation",
    "FaultInjectionError",
    "FaultInjector",
    "FaultKind",
    "FaultSpec",
    "FaultSpecError",
    "flip_bit_",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "DEFAULT_BIT": "spec",
        "Computation": "spec",
        "FaultInjectionError": "spec",
        "FaultKind": "spec",
        "FaultSpec": "spec",
        "FaultSpecError": "spec",
        "FaultInjector": "injector",
        "flip_bit_": "injector",
    },
)
