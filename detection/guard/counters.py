"""What the guard has done on this rank, counted (:class:`GuardCounters`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GuardCounters"]


@dataclass
class GuardCounters:
    """What the guard has done, on this rank (identical on every rank: all decide alike).

    ``steps``: guarded steps decided; ``votes``: fingerprint votes taken (one per step);
    ``nonfinite_checks``: steps whose gradients went through the non-finite check;
    ``audits``: ring audits run (calibration audits included); ``audits_passed``: audits that
    passed with every value finite; ``audits_inconclusive``: audits over non-finite values
    (never counted as passed — NaN is bit-equal to NaN); ``calibration_audits``: audits spent
    calibrating; ``overflow_steps``: non-finite steps a GradScaler accounted for;
    ``overflow_resolutions``: partner recomputations that told an overflow from SDC;
    ``batches_shipped``: micro-batches this rank sent to its auditor; ``alarms``: alarms raised;
    ``step_checks``: steps the per-step layer tested (finite statistics; non-finite steps are
    the non-finite check's).
    """

    steps: int = 0
    votes: int = 0
    nonfinite_checks: int = 0
    audits: int = 0
    audits_passed: int = 0
    audits_inconclusive: int = 0
    calibration_audits: int = 0
    overflow_steps: int = 0
    overflow_resolutions: int = 0
    batches_shipped: int = 0
    alarms: int = 0
    step_checks: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)
