"""The fault spec of ``--inject`` (DESIGN), parsed: which fault strikes where and when.

Torch-free: the launcher and the control plane check a spec without a training stack;
:mod:`detection.faults.injector` applies one inside a rank.

Two forms:

* ``KIND@RANK:STEP[:BIT][:in=recompute]`` — one transient fault in rank ``RANK``'s own
  computation at step ``STEP`` (never in a replay that rank runs for a partner: a transient
  upset does not repeat); with ``in=recompute``, in that rank's recomputation of its ring
  partner's micro-batch at ``STEP`` instead (an audited step), while its own training step stays
  clean: the upset strikes the auditor, not the audited. Only the kinds a recomputation runs
  take it: ``act-flip`` (its forward) and ``grad-flip``/``grad-nan`` (its gradient, in gradient
  audits). ``in=own`` is the default, spelled out.
* ``KIND@node=NAME[:from=STEP]`` — a persistent fault of node ``NAME``: every process on that
  node suffers it at every step from ``STEP`` (default 0), audit replays included.

``act-flip`` takes a ``/MODULE`` suffix (a qualified submodule name such as ``blocks.0.mlp``);
without it the target is the model's last ``nn.Linear`` in registration order, whose output
always reaches the loss.

Which element flips (deterministic, so a run can be replayed): element
``(step * 7919) mod n`` of the flattened target, where the target is, per kind,

* ``grad-nan``, ``grad-flip`` — the rank's local gradient, all parameters concatenated in
  ``module.parameters()`` order (before all-reduce; in a replay, the recomputed ``.grad``);
* ``reduced-flip`` — the same element of the rank's gradient after all-reduce;
* ``act-flip`` — the target module's output (its first tensor when it returns several);
* ``weight-flip`` — all parameters concatenated in ``module.parameters()`` order (a sharded
  model's: the shards the rank holds, so the flip strikes that rank's memory);
* ``optim-flip`` — the optimizer's floating-point state tensors of rank ≥ 1, in parameter order
  and, per parameter, in sorted state-key order (Adam: ``exp_avg`` then ``exp_avg_sq``).

``BIT`` counts in a float32 word (default 30, the top exponent bit). For other widths the same
position relative to the sign bit is flipped (bit 30 → bit 14 of bfloat16/float16, bit 62 of
float64); a bit that does not exist in the dtype is a :class:`FaultInjectionError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "DEFAULT_BIT",
    "RECOMPUTED_KINDS",
    "Computation",
    "FaultInjectionError",
    "FaultKind",
    "FaultSpec",
    "FaultSpecError",
    "element_index",
]


DEFAULT_BIT = 30


_STRIDE = 7919


_ONE_SHOT = re.compile(r"^(?P<rank>\d+):(?P<step>\d+)(?::(?P<bit>\d+))?(?::in=(?P<where>[a-z]+))?$")


_PERSISTENT = re.compile(r"^node=(?P<node>[^:/\s]+)(?::from=(?P<step>\d+))?$")


class FaultKind(StrEnum):
    """Where the bit flips (DESIGN fault table)."""

    GRAD_NAN = "grad-nan"
    GRAD_FLIP = "grad-flip"
    REDUCED_FLIP = "reduced-flip"
    ACT_FLIP = "act-flip"
    WEIGHT_FLIP = "weight-flip"
    OPTIM_FLIP = "optim-flip"


class Computation(StrEnum):
    """Which computation of its rank a transient fault strikes (``:in=…``)."""

    OWN = "own"
    """The rank's own training step (the default)."""
    RECOMPUTE = "recompute"
    """The rank's recomputation of its ring partner's micro-batch, at an audited step."""


#: The kinds a recomputation runs: its forward and, in a gradient audit, its local gradient.
RECOMPUTED_KINDS = frozenset({FaultKind.ACT_FLIP, FaultKind.GRAD_FLIP, FaultKind.GRAD_NAN})


class FaultSpecError(ValueError):
    """A ``--inject`` spec is malformed; the message quotes it and says what is wrong."""


class FaultInjectionError(RuntimeError):
    """A well-formed spec cannot be applied to this model (no such module, no such bit)."""


@dataclass(frozen=True)
class FaultSpec:
    """One parsed ``--inject`` spec. Exactly one of ``rank`` (transient) and ``node``
    (persistent) is set; ``step`` is the transient step or the first persistent step;
    ``computation`` is what a transient fault strikes (a persistent one strikes both)."""

    kind: FaultKind
    step: int
    rank: int | None = None
    node: str | None = None
    bit: int = DEFAULT_BIT
    module: str | None = None
    computation: Computation = Computation.OWN

    @property
    def persistent(self) -> bool:
        return self.node is not None

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """Parse one spec; raise :class:`FaultSpecError` naming the problem."""
        spec = text.strip()
        kind_text, at, target = spec.partition("@")
        if not at:
            raise FaultSpecError(
                f"fault spec {text!r}: expected KIND@RANK:STEP[:BIT] or KIND@node=NAME[:from=STEP]"
            )
        try:
            kind = FaultKind(kind_text)
        except ValueError:
            kinds = ", ".join(k.value for k in FaultKind)
            raise FaultSpecError(
                f"fault spec {text!r}: unknown kind {kind_text!r} (one of {kinds})"
            ) from None
        target, slash, module = target.partition("/")
        if slash:
            if kind is not FaultKind.ACT_FLIP:
                raise FaultSpecError(f"fault spec {text!r}: only act-flip takes a /MODULE suffix")
            if not re.fullmatch(r"[A-Za-z0-9_.]+", module):
                raise FaultSpecError(
                    f"fault spec {text!r}: /MODULE must be a qualified name such as blocks.0.mlp"
                )
        one_shot = _ONE_SHOT.match(target)
        if one_shot:
            bit = int(one_shot["bit"]) if one_shot["bit"] is not None else DEFAULT_BIT
            if not 0 <= bit <= 31:
                raise FaultSpecError(f"fault spec {text!r}: BIT must lie in 0..31, got {bit}")
            return cls(
                kind=kind,
                rank=int(one_shot["rank"]),
                step=int(one_shot["step"]),
                bit=bit,
                module=module or None,
                computation=_computation(text, kind, one_shot["where"]),
            )
        persistent = _PERSISTENT.match(target)
        if persistent:
            step = int(persistent["step"]) if persistent["step"] is not None else 0
            return cls(kind=kind, node=persistent["node"], step=step, module=module or None)
        raise FaultSpecError(
            f"fault spec {text!r}: target {target!r} is neither RANK:STEP[:BIT][:in=recompute] "
            "nor node=NAME[:from=STEP]"
        )

    def applies(self, *, rank: int, node: str, step: int, replay: bool) -> bool:
        """Whether this fault strikes that rank's computation at ``step``.

        A replay is a recomputation a rank runs for its audit partner: the node's persistent
        faults reach it, and a transient fault only when it names it (``in=recompute``) — then
        it does not reach the rank's own step.
        """
        if self.node is not None:
            return node == self.node and step >= self.step
        in_replay = self.computation is Computation.RECOMPUTE
        return replay == in_replay and rank == self.rank and step == self.step

    def __str__(self) -> str:
        where = (
            f"node={self.node}:from={self.step}"
            if self.node is not None
            else f"{self.rank}:{self.step}:{self.bit}"
            + (":in=recompute" if self.computation is Computation.RECOMPUTE else "")
        )
        suffix = f"/{self.module}" if self.module else ""
        return f"{self.kind}@{where}{suffix}"


def _computation(text: str, kind: FaultKind, where: str | None) -> Computation:
    """The ``in=`` field of a transient spec: ``own`` (the default) or ``recompute``, the
    latter only for a kind a recomputation runs."""
    if where is None:
        return Computation.OWN
    try:
        computation = Computation(where)
    except ValueError:
        raise FaultSpecError(
            f"fault spec {text!r}: in={where} names no computation (own or recompute)"
        ) from None
    if computation is Computation.RECOMPUTE and kind not in RECOMPUTED_KINDS:
        raise FaultSpecError(
            f"fault spec {text!r}: a recomputation runs no {kind} (it has no all-reduce, "
            "optimizer step or update): in=recompute takes act-flip, grad-flip or grad-nan"
        )
    return computation


def element_index(step: int, numel: int) -> int:
    """The flat index that flips at ``step`` in a target of ``numel`` elements."""
    if numel <= 0:
        raise FaultInjectionError("cannot inject into an empty tensor")
    return (step * _STRIDE) % numel
