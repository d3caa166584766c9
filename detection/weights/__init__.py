"""The weights: their fingerprint, the replicas' vote on it, and what else a replica holds.

* :mod:`~detection.weights.fingerprint` — the definition and proofs (a contract: checkpoints,
  the ledger and the report carry its values); :mod:`~detection.weights.fingerprint_kernels`
  computes it; :mod:`~detection.weights.plan` takes it every step for one fixed list;
* :mod:`~detection.weights.sharded` — the same fingerprint of sharded weights (FSDP2, HSDP,
  DTensor): each shard at its unsharded positions, one all-reduce of the parts;
* :mod:`~detection.weights.sharded_checkpoint` — a ``torch.distributed.checkpoint`` directory
  sealed by a manifest, checked file by file before loading (imported where used: it loads DCP);
* :mod:`~detection.weights.vote` — a strict-majority verdict over one value per rank;
* :mod:`~detection.weights.state` — the model's and optimizer's state as tensor lists;
* :mod:`~detection.weights.load_check` — every replica holds the checkpoint's weights after load;
* :mod:`~detection.weights.buffers` — persistent buffers, checked where an invariant holds;
* :mod:`~detection.weights.optstate` — a non-finite value in the optimizer state;
* :mod:`~detection.weights.device_graph` — the per-step reductions replayed as a CUDA graph.
"""

from detection.weights.fingerprint import (
    Fingerprint,
    fingerprint_from_tensor,
    fingerprint_on_device,
    to_fingerprint,
    weight_fingerprint,
)
from detection.weights.load_check import LoadVerificationError, verify_after_load
from detection.weights.plan import FingerprintPlan
from detection.weights.sharded import (
    ShardLayoutError,
    sharded_fingerprint,
    sharded_fingerprint_on_device,
)
from detection.weights.state import model_state_tensors, optimizer_state_tensors, persistent_buffers
from detection.weights.vote import KnownDivergence, VoteVerdict, majority_vote

__all__ = [
    "Fingerprint",
    "FingerprintPlan",
    "KnownDivergence",
    "LoadVerificationError",
    "ShardLayoutError",
    "VoteVerdict",
    "fingerprint_from_tensor",
    "fingerprint_on_device",
    "majority_vote",
    "model_state_tensors",
    "optimizer_state_tensors",
    "persistent_buffers",
    "sharded_fingerprint",
    "sharded_fingerprint_on_device",
    "to_fingerprint",
    "verify_after_load",
    "weight_fingerprint",
]
