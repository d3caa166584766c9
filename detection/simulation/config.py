"""What a ``sdcguard train`` job is given (:class:`TrainConfig`), checked before anything starts.

Torch-free, as :mod:`detection.simulation.train_args` is: the control plane reads and rewrites
a job's arguments with these names and defaults in an image with no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from detection.faults.spec import FaultSpec
from detection.simulation.parallel import parallel_checks

__all__ = [
    "AUDIT_MODES",
    "KEY_ID_ENV",
    "SECRET_ENV",
    "HarnessConfigError",
    "HarnessError",
    "RankFailedError",
    "TrainConfig",
    "injected_faults",
]

#: The values of :class:`detection.audit.AuditMode` (a test holds the two equal).
AUDIT_MODES = ("loss", "gradient")
SECRET_ENV = "SDCGUARD_WEBHOOK_SECRET"
KEY_ID_ENV = "SDCGUARD_WEBHOOK_KEY_ID"  # which of the webhook's scoped keys the secret is


class HarnessError(RuntimeError):
    """The job could not run to its end."""


class HarnessConfigError(HarnessError, ValueError):
    """The options contradict each other or name something that is not there."""


class RankFailedError(HarnessError):
    """A rank process died; the others were stopped."""

    def __init__(self, rank: int, exitcode: int | None, tail: str) -> None:
        super().__init__(f"rank {rank} exited with code {exitcode}{': ' + tail if tail else ''}")
        self.rank = rank
        self.exitcode = exitcode


@dataclass
class TrainConfig:
    """The options of ``sdcguard train`` (DESIGN names, ARCHITECTURE extensions)."""

    world_size: int = 4
    ranks_per_node: int = 1
    nodes: list[str] | None = None
    seed: int = 0
    steps: int = 200
    audit_every: int = 10
    audit_mode: str = "loss"
    inject: list[str] = field(default_factory=list)
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    resume_from: Path | None = None
    webhook: str | None = None
    report: Path | None = None
    plain: bool = False
    job_id: str | None = None
    threads: int = 1
    trace: Path | None = None
    probe_step: int | None = None
    probe: Path | None = None
    halt_on_alarm: bool = False
    abft: bool | None = None  # None: GuardConfig's default (on for the eager model)
    abft_every: int | None = None  # None: GuardConfig's checksum budget; 1: every layer, step
    step_checks: bool = True  # the per-step layer (tests of the other layers turn it off)
    skip_update_on_alarm: bool = False
    defer_decision: bool = False
    hold_after_halt_s: float = 0.0
    """With ``halt_on_alarm``: how long a halted job stays alive, training no further, for its
    stop (as a job halted by its guard waits for its operator); 0 ends it at once."""
    parallel: str = "ddp"  # ddp | fsdp | hsdp (detection.simulation.parallel)
    shard_size: int | None = None  # hsdp: ranks per replica (None: the ranks of one node)

    def node_names(self) -> list[str]:
        """Node of each rank: ``nodes`` if given, else ``node-{rank // ranks_per_node}``."""
        if self.nodes is not None:
            return list(self.nodes)
        return [f"node-{r // self.ranks_per_node}" for r in range(self.world_size)]

    @property
    def job(self) -> str:
        return self.job_id or f"local-{self.seed}"

    def validate(self) -> None:
        """Raise :class:`HarnessConfigError` naming the first contradiction."""
        for ok, message in [*parallel_checks(self), *self._checks()]:
            if not ok:
                raise HarnessConfigError(message)
        for spec in self.inject:
            try:
                FaultSpec.parse(spec)
            except ValueError as err:
                raise HarnessConfigError(str(err)) from err

    def _checks(self) -> list[tuple[bool, str]]:
        return [
            (self.world_size >= 1, "--world-size must be ≥ 1"),
            (self.ranks_per_node >= 1, "--ranks-per-node must be ≥ 1"),
            (self.steps >= 0, "--steps must be ≥ 0"),
            (self.audit_every >= 0, "--audit-every must be ≥ 0"),
            (self.audit_mode in AUDIT_MODES, "--audit-mode is loss|gradient"),
            (self.checkpoint_every >= 0, "--checkpoint-every must be ≥ 0"),
            (
                self.checkpoint_every == 0 or self.checkpoint_dir is not None,
                "--checkpoint-every needs --checkpoint-dir",
            ),
            (self.threads >= 1, "--threads must be ≥ 1"),
            (
                (self.probe_step is None) == (self.probe is None),
                "--probe-step and --probe go together",
            ),
            (not (self.plain and self.inject), "--plain runs no sdcguard: it cannot --inject"),
            (not (self.plain and self.webhook), "--plain runs no sdcguard: it has no --webhook"),
            (
                self.nodes is None or len(self.nodes) == self.world_size,
                f"--nodes must name one node per rank ({self.world_size})",
            ),
            (self.nodes is None or all(self.nodes), "--nodes names must not be empty"),
            (
                self.resume_from is None
                or self.resume_from.is_file()
                or (self.parallel != "ddp" and self.resume_from.is_dir()),
                f"--resume-from {self.resume_from}: no such checkpoint file",
            ),
            (
                self.webhook is None or bool(os.environ.get(SECRET_ENV)),
                f"--webhook needs the secret in {SECRET_ENV}",
            ),
        ]


def injected_faults(config: TrainConfig) -> tuple[str, ...]:
    """The faults this run suffers. A resumed run recomputes steps a run already computed, and
    a transient upset (``KIND@RANK:STEP``) does not repeat: only the nodes' persistent faults
    follow it, as they follow a diagnostic run."""
    if config.resume_from is None:
        return tuple(config.inject)
    return tuple(s for s in config.inject if FaultSpec.parse(s).persistent)
