"""How ``sdcguard train --parallel ddp|fsdp|hsdp`` lays the job out, and what a sharded job
refuses — torch-free, as :mod:`detection.simulation.config` is (the launcher and the control
plane check a job's options before any torch import).

* ``ddp`` (the default): every rank holds the whole model; nothing here applies.
* ``fsdp``: FSDP2's ``fully_shard`` on each transformer block and on the root, over a 1-D
  mesh of every rank: one copy of each shard.
* ``hsdp``: the same on a 2-D ``(replicate, shard)`` mesh of ``world_size / S`` replicas of
  ``S`` shards each: ``S`` is ``--shard-size``, or the ranks of one node (a node's ranks
  share its fast interconnect, so the shards of one replica stay inside it).

The sharded guard (:mod:`detection.guard.sharded`) does not run every layer the DDP guard
does. A sharded job audits as a DDP job does, in loss mode (the sharded guard replays a
partner's micro-batch with every rank at once; gradient mode is refused), and writes and resumes
checkpoints: a sharded checkpoint is a directory ``ckpt-<step>/`` sealed by its
``manifest.json``, written by every rank through the gate, resumed from the directory or the
manifest under any mesh.
Options the sharded guard refuses are refused before any rank starts, naming the option and
the reason (:func:`parallel_checks`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from detection.faults.spec import Computation, FaultKind, FaultSpec, FaultSpecError

__all__ = [
    "PARALLEL_MODES",
    "SHARDED_FAULT_KINDS",
    "audit_every_of",
    "is_sharded",
    "mesh_shape",
    "parallel_checks",
]

PARALLEL_MODES = ("ddp", "fsdp", "hsdp")
_MANIFEST = "manifest.json"  # what seals a sharded checkpoint (weights.sharded_checkpoint)


class TrainConfig(Protocol):
    """The options read here (:class:`detection.simulation.config.TrainConfig`'s, which
    imports this module)."""

    parallel: str
    shard_size: int | None
    world_size: int
    audit_every: int
    audit_mode: str
    inject: list[str]
    abft: bool | None
    abft_every: int | None
    skip_update_on_alarm: bool
    defer_decision: bool
    trace: Path | None
    probe: Path | None
    checkpoint_every: int
    resume_from: Path | None

    def node_names(self) -> list[str]: ...


#: The ``--inject`` kinds a sharded job suffers (:mod:`detection.simulation.sharded_faults`):
#: a rank's own unsharded gradient before the reduce-scatter, its forward, its weight shards
#: after the update. ``reduced-flip`` (a reduced gradient is a shard: the element of the
#: unsharded numbering lies on one rank only) and ``optim-flip`` are not injected.
SHARDED_FAULT_KINDS = frozenset(
    {FaultKind.GRAD_FLIP, FaultKind.GRAD_NAN, FaultKind.ACT_FLIP, FaultKind.WEIGHT_FLIP}
)


def is_sharded(config: TrainConfig) -> bool:
    return config.parallel != "ddp"


def audit_every_of(config: TrainConfig) -> int:
    """The ring audit's period the job runs with: ``--audit-every``, sharded or not (the
    sharded guard replays a partner's micro-batch in loss mode, every rank at once)."""
    return config.audit_every


def shard_size(config: TrainConfig) -> int:
    """Ranks per replica: the whole job under ``fsdp``; ``--shard-size`` or the ranks of one
    node under ``hsdp``."""
    if config.parallel == "fsdp":
        return config.world_size
    if config.shard_size is not None:
        return config.shard_size
    nodes = config.node_names()
    return nodes.count(nodes[0]) if nodes else 1


def mesh_shape(config: TrainConfig) -> tuple[int, ...]:
    """The device mesh: ``(world,)`` for ``fsdp``, ``(replicas, shards)`` for ``hsdp``."""
    if config.parallel == "fsdp":
        return (config.world_size,)
    size = shard_size(config)
    return (config.world_size // size, size)


def parallel_checks(config: TrainConfig) -> list[tuple[bool, str]]:
    """``(holds, message)`` pairs :meth:`TrainConfig.validate` raises the first failing of."""
    mode = config.parallel
    checks = [(mode in PARALLEL_MODES, f"--parallel is one of {'|'.join(PARALLEL_MODES)}")]
    if mode not in PARALLEL_MODES:
        return checks
    if mode != "hsdp":
        checks.append((config.shard_size is None, "--shard-size applies to --parallel hsdp"))
    if mode == "ddp":
        checks.append(
            (
                config.resume_from is None or config.resume_from.name != _MANIFEST,
                f"--resume-from {config.resume_from}: a sharded checkpoint's manifest; resume "
                "it with the --parallel fsdp|hsdp it was written under (or another mesh)",
            )
        )
        return checks
    why = f"--parallel {mode}"
    checks += _layout_checks(config)
    checks += [
        (
            not _abft_asked(config),
            f"{why}: the sharded guard runs no layer checksums (--abft, --abft-every)",
        ),
        (
            not config.skip_update_on_alarm,
            f"{why}: the sharded guard decides a step after its update (--skip-update-on-alarm)",
        ),
        (
            not config.defer_decision,
            f"{why}: the sharded guard decides every step as it ends (--defer-decision)",
        ),
        (
            config.audit_mode == "loss" or audit_every_of(config) == 0,
            f"{why}: the sharded guard audits in loss mode only (--audit-mode loss): a "
            "partner's gradient is reduce-scattered with every rank's",
        ),
        (
            config.trace is None and config.probe is None,
            f"{why}: --trace and --probe record "
            "DDP's gradient buckets and the diagnostic replay, which trace DDP jobs only",
        ),
    ]
    checks.append(
        (
            config.resume_from is None
            or config.resume_from.name == _MANIFEST
            or not config.resume_from.is_file(),
            f"{why}: --resume-from {config.resume_from} is a file; a sharded checkpoint is "
            f"a directory (ckpt-<step>/) or its {_MANIFEST}",
        )
    )
    checks += [(False, f"{why}: {problem}") for problem in _fault_problems(config)]
    return checks


def _abft_asked(config: TrainConfig) -> bool:
    return config.abft is True or config.abft_every is not None


def _layout_checks(config: TrainConfig) -> list[tuple[bool, str]]:
    if config.parallel == "fsdp":
        return []
    if config.shard_size is not None and config.shard_size < 1:
        return [(False, "--shard-size must be ≥ 1")]
    size = shard_size(config)
    nodes = config.node_names()
    return [
        (
            config.world_size % size == 0,
            f"--parallel hsdp: {config.world_size} ranks do not split into replicas of "
            f"{size} shards (--shard-size, default: the ranks of one node)",
        ),
        (
            config.shard_size is not None
            or all(nodes[r] == nodes[r - r % size] for r in range(len(nodes))),
            "--parallel hsdp: the nodes hold different numbers of ranks, or a node's ranks "
            "are not consecutive: give --shard-size",
        ),
    ]


def _fault_problems(config: TrainConfig) -> list[str]:
    problems: list[str] = []
    for text in config.inject:
        try:
            spec = FaultSpec.parse(text)
        except FaultSpecError:
            continue  # the spec check names it
        if spec.kind not in SHARDED_FAULT_KINDS:
            kinds = ", ".join(sorted(k.value for k in SHARDED_FAULT_KINDS))
            problems.append(f"--inject {text}: {spec.kind} is not injected (only {kinds})")
        elif spec.computation is Computation.RECOMPUTE:
            problems.append(
                f"--inject {text}: a sharded job's audit recomputes a partner's micro-batch "
                "through the whole mesh: no fault is injected into it"
            )
    return problems
