"""The checkpoint gate: a checkpoint is trusted only on evidence gathered after it was taken.

Every checkpoint is recorded ``pending``, becomes ``verified`` on a passed audit (or, without
audits, a passed vote) at or after its step, and is quarantined after an alarm; the ledger hears
the same. Three modules, one job each:

* :mod:`~detection.gate.records` — the vocabulary: the guard's :class:`StepOutcome`, the
  :class:`CheckpointRecord` and its status, the refusals, the checkpoints' file names;
* :mod:`~detection.gate.provenance` — the state machine: evidence, closing, publishing, the posts
  to the ledger (no I/O);
* :mod:`~detection.gate.checkpoint` — :class:`CheckpointGate`, which writes a checkpoint (a file,
  or a sharded model's ``torch.distributed.checkpoint`` directory) and the guard's state beside
  it, and records it.

Every name that ``detection.gate`` exported as one module it still exports here.
"""

from detection.gate.checkpoint import CheckpointGate
from detection.gate.records import (
    CheckpointNotVerifiedError,
    CheckpointRecord,
    CheckpointStatus,
    GateClosedError,
    GateError,
    ProvenanceSink,
    StepOutcome,
    checkpoint_path,
    sharded_checkpoint_path,
    state_path,
)

__all__ = [
    "CheckpointGate",
    "CheckpointNotVerifiedError",
    "CheckpointRecord",
    "CheckpointStatus",
    "GateClosedError",
    "GateError",
    "ProvenanceSink",
    "StepOutcome",
    "checkpoint_path",
    "sharded_checkpoint_path",
    "state_path",
]
