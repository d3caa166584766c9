"""The ring audit: every audited step, each rank recomputes its ring partner's micro-batch.

* :mod:`~detection.audit.ring` — the ring, the seeds, the audit's comparison (:class:`AuditMode`);
* :mod:`~detection.audit.recompute` — what a recomputation must put back to be bitwise;
* :mod:`~detection.audit.batches` — shipping a micro-batch to its auditor;
* :mod:`~detection.audit.calibration` — agreeing and calibrating before anyone is accused;
* :mod:`~detection.audit.overflow` — a GradScaler's overflow told from a fault;
* :mod:`~detection.audit.attribution` — who is behind the mismatching pairs.
"""

from detection.audit.calibration import NotReplayableError
from detection.audit.ring import (
    AuditMode,
    PartnerRecompute,
    ring_order,
    ring_partners,
    seed_rng,
    step_seed,
)

__all__ = [
    "AuditMode",
    "NotReplayableError",
    "PartnerRecompute",
    "ring_order",
    "ring_partners",
    "seed_rng",
    "step_seed",
]
