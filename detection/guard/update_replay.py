"""Under pure FSDP2, the owner's update verified by a rotating buddy replay, and its shard's
custody between updates.

FSDP2 keeps one copy of each shard: no vote can compare it with another, so a wrong update or
a flipped stored weight would pass unseen. Two checks stand in for the vote.

**The buddy replay (a wrong update).** The parameters are dealt, once, into ``K =
update_replay_every`` slices balanced by element count (largest first into the lightest slice;
every rank derives the same slices from the global shapes). At step ``s`` each rank — the
*owner* of its local shards — snapshots, in the optimizer's pre-hook, the local shards of slice
``s mod K``: the parameter, its gradient, its optimizer state and its group's hyperparameters
as they are now (a scheduler may have moved ``lr``). In the post-hook it fingerprints what the
update wrote (the parameter and every state tensor). As the step ends it sends the snapshot and
the fingerprints to its *buddy*, rank ``(r + 1) mod W``, which re-runs the same optimizer class
with the same group options (``foreach``, ``fused``, ``maximize``, …) on plain local tensors and
compares the fingerprints — bitwise. The replay runs the owner's arithmetic on the owner's
inputs, elementwise the same kernels (a DTensor's update runs on its local tensor), so a clean
step agrees to the bit (:mod:`detection.guard.update_payload`); the classes whose replay is
tested exact (``REPLAYABLE``: SGD, Adam, AdamW) are the ones taken, any other is refused at
construction.

*Bound.* Every parameter shard is replayed once every ``K`` optimizer steps. A compute fault in
the update that recurs is caught within ``K`` steps; a one-off one is caught with probability
``1/K`` — only if it strikes the slice replayed that step.

*Attribution.* A mismatch is evidence against the pair, owner first, buddy second: the owner
may have computed its update wrong, or the buddy its replay, and two results alone cannot say
which. With three ranks or more a third replay, by the rank after the buddy, sides with one
of them and the other is named alone (:mod:`detection.guard.update_referee`; run only on a
mismatch); with two ranks there is no third, and the pair stays named (``ambiguous``). Alarm
``audit``, phase ``weights`` (the parameter differs) or ``optimizer-state`` (only the state
does).

**Custody (a flipped stored weight or optimizer state).** A replay that starts from a flipped
pre-update value reproduces the flip, so the replay alone never sees a weight, or a moment,
that changed *between* updates. Custody does: each optimizer's post-hook fingerprints the local
shards of its parameters — and, with ``GuardConfig(vote_optimizer_state=True)``, of their
optimizer state (the tensors shaped like a shard; not a 0-d step count), at two or three times
the reads, as that flag's vote does under DDP — and its next pre-hook fingerprints them again.
Nobody is meant to write them in between (FSDP2's all-gather reads the shard, it never writes
it), so a difference names the owner alone: its memory changed with nobody writing. Alarm
``fingerprint``, phase ``weights`` (or ``optimizer-state`` when only the state changed), with
``majority: false`` (one copy's history, not a vote). A stored flip is caught at the next step.
A loop that writes the weights or the state itself between steps (loading a checkpoint) must
call ``guard.verify_loaded()``, which restarts custody.

**Cost per step** (``n``: the rank's local shard elements, ``b``: bytes an element): custody,
two fingerprint passes over the local shard (``2·n·b`` read; with the state, times 2 for SGD
with momentum, 3 for Adam/AdamW), of which the record after the update is also the step's row
fingerprint: its words are numbered at their unsharded positions, and when the optimizers hold
every parameter exactly once the records add up to the row's part, so the guard takes no third
pass (:mod:`detection.guard.shard_positions`); the replay, a copy of ``1/K`` of the shard, its
gradient and its state on the owner, into one buffer (SGD with momentum ``3·n·b/K``, Adam/AdamW
``4·n·b/K``; kept until the next step begins, for a third replay), the same bytes sent to the
buddy as they are (one point-to-point exchange around the ring, after a header of a few hundred
bytes a parameter), and on the buddy the same bytes received and replayed in place: ``1/K`` of
an update and the fingerprints of its result. What an update wrote is fingerprinted tensor by
tensor, owner and buddy alike, in one multi-tensor pass a side
(:mod:`detection.weights.fingerprint_each`: a few operations, not a few a tensor). A parameter
larger than ``n/K`` makes its slice that much heavier. ``benchmarks/update_replay_cost.py``
measures the parts against the update.

Runs under pure FSDP2 only. Under HSDP each shard's replicas are voted on every step, which
sees a wrong update and a flipped weight on one replica; DDP likewise. With one rank there is
no buddy: custody runs, the replay does not.

The row words the two checks write, and the alarms every rank reads from them, are
:mod:`detection.guard.update_alarm`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from detection.guard.config import GuardConfigError
from detection.guard.shard_positions import UnshardedPositions
from detection.guard.update_alarm import (
    NO_REPLAY,
    NO_REPLAY_WORDS,
    PARAM_MISMATCH,
    REPLAY_WORDS,
    STATE_CHANGED,
    STATE_MISMATCH,
    WEIGHTS_CHANGED,
    ReplayRow,
    custody_alarm,
    is_replay_alarm,
    replay_alarm,
)
from detection.guard.update_payload import (
    AMP,
    REPLAYABLE,
    Package,
    Replayed,
    Snapshot,
    amp_of,
    encode,
    replay_payload,
    ship,
    take_snapshots,
)
from detection.weights.fingerprint import fingerprint_on_device
from detection.weights.fingerprint_each import fingerprints_each

__all__ = [
    "NO_REPLAY",
    "NO_REPLAY_WORDS",
    "REPLAY_WORDS",
    "ReplayRow",
    "UpdateReplay",
    "balanced_slices",
    "custody_alarm",
    "is_replay_alarm",
    "replay_alarm",
]

_log = logging.getLogger(__name__)


def balanced_slices(sizes: Sequence[int], k: int) -> list[int]:
    """The slice (``0 … k-1``) of each parameter: largest first into the lightest slice, ties to
    the lowest slice — the same on every rank from the same global sizes."""
    load = [0] * k
    slices = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        lightest = min(range(k), key=lambda j: (load[j], j))
        slices[index] = lightest
        load[lightest] += sizes[index]
    return slices


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _options(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's options as they are now (tensors copied: a scheduler may change them)."""
    return {
        key: value.detach().clone() if isinstance(value, torch.Tensor) else value
        for key, value in group.items()
        if key != "params"
    }


class UpdateReplay:
    """One rank's share of the buddy replay and the custody check (see the module); the guard
    calls :meth:`before` and :meth:`after` from its optimizer hooks and :meth:`exchange` as
    the step ends (collective: every rank)."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        optimizers: Sequence[torch.optim.Optimizer],
        every: int,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        state_custody: bool = False,
    ) -> None:
        if every < 1:
            raise GuardConfigError(f"update_replay_every must be ≥ 1 to replay, got {every}")
        refused = sorted({type(o).__name__ for o in optimizers if type(o) not in REPLAYABLE})
        if refused and world_size > 1:
            raise GuardConfigError(
                f"the buddy replay of the update replays {[c.__name__ for c in REPLAYABLE]} "
                f"exactly, not {refused}: pass GuardConfig(update_replay_every=0) to run "
                "without it (a wrong update under FSDP2 then goes unseen)"
            )
        self.every = every
        self.state_custody = state_custody
        self.rank, self.world_size, self.device, self.group = rank, world_size, device, group
        self.params = list(params)
        self.optimizers = list(optimizers)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.slices = balanced_slices([p.numel() for p in self.params], every)
        self.replaying = world_size > 1
        self.buddy, self.owner = (rank + 1) % world_size, (rank - 1) % world_size
        self.sent: Package | None = None  # this step's snapshot, as sent
        self.results: list[Replayed] = []  # this step's replay of the owner's
        self._custody: dict[int, torch.Tensor] = {}  # optimizer → fingerprint after its update
        self._covered: dict[int, list[int]] = {}  # optimizer → the parameters in its record
        self.positions = UnshardedPositions(self.params)
        self._broken = torch.zeros((), dtype=torch.int64, device=device)
        self._snaps: list[Snapshot] = []
        self._buffers: list[torch.Tensor] = []  # the step's snapshot copies, one an optimizer
        self.checked: set[int] = set()  # the owner's parameters this rank has replayed

    # -- the owner's side, from the optimizer hooks ------------------------------------------------
    def _held(self, opt: torch.optim.Optimizer) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
        """The model's parameters ``opt`` updates, and (``state_custody``) this rank's local
        shards of their optimizer state (the tensors shaped like a shard; a 0-d step count
        stays out)."""
        params = [p for g in opt.param_groups for p in g["params"] if id(p) in self.index]
        state = [
            _local(v).detach()
            for p in (params if self.state_custody else [])
            for _, v in sorted(opt.state.get(p, {}).items())
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]
        return params, state

    def _fingerprint(
        self, tensors: Sequence[torch.Tensor], offsets: Sequence[int] | None = None
    ) -> torch.Tensor:
        """The list's fingerprint, each tensor at ``offsets`` (default: one after another)."""
        kept = [
            (t.reshape(-1), o) for t, o in zip(tensors, offsets or _packed(tensors), strict=True)
        ]
        kept = [(run, o) for run, o in kept if run.numel()]
        if not kept:
            return torch.zeros(2, dtype=torch.int64, device=self.device)
        return fingerprint_on_device([run for run, _ in kept], offsets=[o for _, o in kept]).to(
            self.device
        )

    def _custody_now(self, opt: torch.optim.Optimizer) -> torch.Tensor:
        """``[2, 2]``: the fingerprints of the weight shards — at their unsharded positions,
        so that the records add up to the row's part (:mod:`detection.guard.shard_positions`)
        — and of their optimizer state."""
        params, state = self._held(opt)
        return torch.stack(
            [self._fingerprint(*self.positions.runs(params)), self._fingerprint(state)]
        )

    def row_part(self) -> torch.Tensor | None:
        """This rank's part of the row's fingerprint, from the custody records of the last
        updates (no pass of its own), or ``None`` when the records do not cover every parameter
        exactly once (the guard then takes its own pass)."""
        if len(self._custody) != len(self.optimizers) or not self.positions.partition(
            self._covered.values()
        ):
            return None
        records = [self._custody[which][0] for which in range(len(self.optimizers))]
        return records[0] if len(records) == 1 else torch.stack(records).sum(0)

    def before(self, opt: torch.optim.Optimizer, step: int) -> None:
        """Pre-hook: custody (the shards as the update finds them against what the last
        update left), then the snapshot of this step's slice."""
        which = self.optimizers.index(opt)
        recorded = self._custody.get(which)
        if recorded is not None:
            changed = (self._custody_now(opt) != recorded).any(dim=1).to(torch.int64)
            self._broken = self._broken | changed[0] * WEIGHTS_CHANGED | changed[1] * STATE_CHANGED
        if not self.replaying:
            return
        due = step % self.every
        amp = amp_of(opt)
        items = []
        for g in opt.param_groups:
            options: dict[str, Any] | None = None
            for p in g["params"]:
                index = self.index.get(id(p))
                if index is None or self.slices[index] != due or p.grad is None:
                    continue
                if _local(p).numel() == 0:
                    continue  # an uneven shard's empty end: nothing to update
                if options is None:
                    options = {**_options(g), AMP: amp} if amp else _options(g)
                state = {
                    key: _local(value) if isinstance(value, torch.Tensor) else value
                    for key, value in opt.state.get(p, {}).items()
                }
                items.append((index, which, options, _local(p), _local(p.grad), state))
        snaps, buffer = take_snapshots(items, len(self._buffers), self.device)
        if buffer is not None:
            self._snaps.extend(snaps)
            self._buffers.append(buffer)

    def after(self, opt: torch.optim.Optimizer) -> None:
        """Post-hook: what the update wrote — the fingerprint of the snapshotted parameters
        and their state, and the custody record of every shard this optimizer updates."""
        which = self.optimizers.index(opt)
        self._custody[which] = self._custody_now(opt)
        self._covered[which] = [id(p) for p in self._held(opt)[0]]
        by_index = {id(p): p for g in opt.param_groups for p in g["params"]}
        done: list[Snapshot] = []
        wrote: list[torch.Tensor] = []  # each snapshot's parameter, then its state by key
        for snap in self._snaps:
            if snap.post is not None or snap.opt != which:
                continue
            p = self.params[snap.index]
            if id(p) not in by_index:
                continue
            state = opt.state.get(p, {})
            snap.post_keys = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor))
            wrote += [_local(p), *(_local(state[k]) for k in snap.post_keys)]
            done.append(snap)
        if done:  # one multi-tensor pass for every tensor the update wrote, a row each
            rows = fingerprints_each(wrote, self.device)
            at = 0
            for snap in done:
                snap.post = rows[at : at + 1 + len(snap.post_keys)]
                at += 1 + len(snap.post_keys)

    def begin_step(self) -> None:
        """Drop the last step's evidence, and what an aborted step left (never sent)."""
        self._snaps, self._buffers = [], []
        self.sent, self.results = None, []

    def forget(self) -> None:
        """The weights were written on purpose (a checkpoint loaded): restart custody."""
        self._custody.clear()
        self._covered.clear()
        self._broken = torch.zeros((), dtype=torch.int64, device=self.device)

    # -- as the step ends: send, replay, compare ---------------------------------------------------
    def exchange(self) -> torch.Tensor:
        """Send this step's snapshot to the buddy, replay the owner's, and return this rank's
        :data:`REPLAY_WORDS` row words (collective: every rank, every step). What was sent and
        what the replay found stay until the next step (:mod:`detection.guard.update_referee`
        replays them a third time on a mismatch)."""
        broken = self._broken
        self._broken = torch.zeros((), dtype=torch.int64, device=self.device)
        snaps, self._snaps = self._snaps, []
        buffers, self._buffers = self._buffers, []
        verdict, first, replayed = 0, -1, 0
        if self.replaying:
            self.sent = encode(snaps, buffers)
            got = ship({self.buddy: self.sent}, [self.owner], self.device, self.group)
            self.results = replay_payload(
                got[self.owner], self.optimizers, self.device, consume=True
            )
            verdict, first, replayed = self._verdict(self.results)
        words = torch.tensor([verdict, first, replayed], dtype=torch.int64, device=self.device)
        return torch.cat([broken.reshape(1), words])

    def _verdict(self, results: Sequence[Replayed]) -> tuple[int, int, int]:
        verdict, first, replayed = 0, -1, 0
        for result in results:
            self.checked.add(result.index)
            replayed += result.elements
            bad = (PARAM_MISMATCH if result.param_differs else 0) | (
                STATE_MISMATCH if result.state_differs else 0
            )
            if bad:
                verdict |= bad
                first = result.index if first < 0 else first
                _log.warning(
                    "the replay of rank %d's update of parameter %d differs (%s)",
                    self.owner,
                    result.index,
                    "parameter" if bad & PARAM_MISMATCH else "optimizer state",
                )
        return verdict, first, replayed


def _packed(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Offsets of tensors numbered one after another from 0."""
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += t.numel()
    return offsets
