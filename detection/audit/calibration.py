"""Before the audit may accuse anyone: agree on what makes replays comparable, then calibrate.

A replay is evidence only if it reproduces the original bitwise (DESIGN). Two things can make
a clean loop look corrupt, and both are found before the first alarm can be raised:

* ranks that compute differently — another GPU model, another torch/CUDA/cuDNN/NCCL build,
  another deterministic or TF32 setting, another intra-op thread count. :func:`replay_environment`
  describes a rank; :func:`check_agreement` refuses to start (naming the setting and the ranks)
  unless every rank describes the same.
* a loop that is not replayable — randomness from a generator the guard does not seed, a
  forward that reads state a replay cannot restore, a loss handed to ``guard.backward`` that is
  not what ``loss_fn(model, batch)`` returns. With ``GuardConfig(calibrate=N)`` the first ``N``
  audits also replay each rank's *own* micro-batch on that rank; a self-replay that differs from
  the original cannot be hardware on another rank, so the guard refuses to arm
  (:class:`NotReplayableError`) and says what in the loop to change.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "NotReplayableError",
    "calibration_causes",
    "check_agreement",
    "diagnose_self_replay",
    "replay_environment",
]


class NotReplayableError(RuntimeError):
    """Calibration (or a replay that cannot run at all, e.g. a gradient replay through
    reentrant activation checkpointing) found that the loop cannot be replayed bitwise; the
    message says why and what to change. Raised identically on every rank (all ranks decide
    from the same rows, and run the same model code)."""


def replay_environment(device: torch.device) -> dict[str, Any]:
    """Everything on this rank that decides the bits a replay computes."""
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "device_type": device.type,
    }
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        env.update(
            device_name=props.name,
            capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
            tf32_cudnn=torch.backends.cudnn.allow_tf32,
            cudnn_deterministic=torch.backends.cudnn.deterministic,
            cudnn_benchmark=torch.backends.cudnn.benchmark,
        )
    return env


_FIXES = {
    "threads": "call torch.set_num_threads with the same value on every rank",
    "deterministic": "call torch.use_deterministic_algorithms the same way on every rank",
    "float32_matmul_precision": "call torch.set_float32_matmul_precision the same way everywhere",
    "tf32_matmul": "set torch.backends.cuda.matmul.allow_tf32 the same way on every rank",
    "tf32_cudnn": "set torch.backends.cudnn.allow_tf32 the same way on every rank",
    "cudnn_benchmark": "set torch.backends.cudnn.benchmark the same way (off) on every rank",
    "cudnn_deterministic": "set torch.backends.cudnn.deterministic the same way on every rank",
    "native_kernels": (
        "give every rank a C compiler and a writable SDCGUARD_CACHE_DIR, or set "
        "SDCGUARD_NATIVE=0 on every rank (ranks compare their bucket sums bit for bit)"
    ),
}


def check_agreement(environments: Sequence[dict[str, Any]]) -> list[str]:
    """Every setting on which the ranks differ, as a sentence naming the values, the ranks
    and what to change (empty: they agree). Hardware and build differences have no in-loop fix:
    audits between such ranks are not comparable, so the job must not mix them."""
    problems: list[str] = []
    keys = sorted({k for env in environments for k in env})
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for rank, env in enumerate(environments):
            by_value.setdefault(repr(env.get(key)), []).append(rank)
        if len(by_value) > 1:
            seen = "; ".join(f"{v} on ranks {r}" for v, r in by_value.items())
            fix = _FIXES.get(key, "run every rank on the same hardware and software build")
            problems.append(f"{key} differs ({seen}): replays would not be bitwise; {fix}")
    return problems


def _loss_value(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


def diagnose_self_replay(
    rank: int,
    step: int,
    own: Sequence[int],
    first: Sequence[int],
    second: Sequence[int],
    *,
    mode: str,
) -> str | None:
    """Why rank ``rank``'s replay of its own micro-batch at ``step`` differs from the original
    (``own``), from two self-replays ``first`` and ``second``; ``None`` when they agree."""
    if tuple(first) == tuple(own):
        return None
    where = f"rank {rank}, step {step}: replaying its own micro-batch"
    if tuple(first) != tuple(second):
        return (
            f"{where} twice from the same seed gave two different results. The forward draws "
            "randomness the guard does not seed (a torch.Generator of your own, numpy, "
            "random, torch.rand on another device) or runs nondeterministic kernels: draw "
            "randomness from the default generators (the guard seeds them per step, rank and "
            "micro-batch), or turn on torch.use_deterministic_algorithms(True)"
        )
    loss, again = _loss_value(own[0]), _loss_value(first[0])
    if own[0] != first[0] and again != 0.0 and loss != 0.0:
        ratio = loss / again
        for k in range(2, 65):
            if abs(ratio * k - 1.0) < 1e-6 or abs(ratio - k) < 1e-6 * k:
                return (
                    f"{where}: the loss given to guard.backward ({loss!r}) is the replay's "
                    f"loss_fn(model, batch) ({again!r}) scaled by {ratio:.6g}. Pass the loss "
                    "as loss_fn returns it (do any division by the accumulation count inside "
                    "loss_fn; with a GradScaler use guard.backward(loss, scaler=scaler))"
                )
    what = "loss" if own[0] != first[0] else "local gradient"
    return (
        f"{where} reproduces itself but not the original ({what} differs): the original "
        "forward ran in a state the replay does not see. Compute the loss only with "
        "loss_fn(model, batch) on the model the guard was given, keep state the forward reads "
        "in registered buffers (not Python attributes), draw any randomness inside the "
        f"forward, and keep autocast around the forward call ({mode} audits)"
    )


def calibration_causes(
    step: int,
    partners: Sequence[int],
    own: Sequence[Sequence[int]],
    replayed: Sequence[Sequence[int]],
    selves: Sequence[Sequence[int]],
    *,
    mode: str,
) -> list[str]:
    """What keeps a calibration audit from being clean (empty: it is). ``own[r]``: rank r's
    original ``[loss bits, gradient fingerprint]``; ``replayed[r]``: rank r's replay of
    ``partners[r]``; ``selves[r]``: rank r's two replays of its own micro-batch, concatenated."""
    causes = [
        cause
        for r, row in enumerate(selves)
        if (cause := diagnose_self_replay(r, step, own[r], row[:3], row[3:], mode=mode))
    ]
    if causes:
        return causes
    pairs = [
        f"rank {auditor} replaying rank {partner}"
        for auditor, partner in enumerate(partners)
        if auditor != partner and tuple(replayed[auditor]) != tuple(own[partner])
    ]
    if not pairs:
        return []
    return [
        f"step {step}: every rank reproduces its own micro-batch, but {', '.join(pairs)} "
        "differs. The ranks compute differently although they agreed at start-up: a batch "
        "that is not the same when recomputed elsewhere (microbatch(step, rank) must be a pure "
        "function of its arguments; pass batch= otherwise), per-rank state read in the forward "
        "(a parameter DDP ignores and nobody synchronises), or a faulty device (calibrate on "
        "other hardware)"
    ]
