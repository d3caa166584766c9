"""The per-step row every rank all-gathers, and the decision every rank reaches from the table.

Each rank contributes one int64 row (:func:`step_row`); after the all-gather every rank holds
the same table and :class:`StepDecision` turns it into at most one
:class:`~detection.transport.alarm.Alarm` and a :class:`~detection.gate.StepOutcome` — the same on
every
rank, with no further communication (the one exception, a GradScaler's lone overflow, is
resolved by a collective the caller passes in).

Row layout (``ROW`` words): step, pre- and post-all-reduce non-finite flags, the weight
fingerprint (2), the optimizer-state fingerprint (2), own [loss bits, local-gradient
fingerprint (2)], the same three recomputed for the partner, one word of flags (``STEPPED``:
an optimizer stepped; ``WEIGHTS_NONFINITE``: read only after a non-finite step was applied;
``STATE_NONFINITE``: the per-step layer's optimizer-state check) and the persistent buffers'
evidence (:mod:`detection.weights.buffers`).

Only what truly follows from an alarmed event is not raised again: once a non-finite gradient
was applied and the weights are actually non-finite, everything computed from them is
(``poisoned``); replicas an alarm named as holding different weights
(:class:`~detection.weights.vote.KnownDivergence`) disagree from then on, so their further
divergence,
audit mismatches between them, and non-finite local gradients of replicas a majority named as
wrong are theirs. Everything else is checked every step: a non-finite gradient the loop skipped
poisons nothing, and a divergence without a majority leaves every class of equal replicas under
watch.
"""

from __future__ import annotations

import array
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from detection.audit.attribution import attribute_pairs
from detection.audit.ring import AuditMode, AuditVerdict, attribute_audit
from detection.gate import StepOutcome
from detection.guard.comm_hook import NonFiniteVerdict, attribute_nonfinite
from detection.stepcheck.checks import StepChecks
from detection.transport.alarm import Alarm, Layer, Phase
from detection.weights.buffers import BUFFER_ROW, buffer_finding
from detection.weights.fingerprint import Fingerprint, to_fingerprint
from detection.weights.vote import KnownDivergence, VoteVerdict, majority_vote

__all__ = [
    "OWN",
    "REPLAY",
    "ROW",
    "STEP",
    "Decision",
    "Finding",
    "ScalerResolution",
    "StepDecision",
    "all_finite",
    "any_nonfinite",
    "flags_word",
    "step_row",
]

# Layout of the row each rank contributes to the per-step all-gather.
STEP, PRE, POST = 0, 1, 2
W = slice(3, 5)  # weight fingerprint after the step
S = slice(5, 7)  # optimizer-state fingerprint after the step
OWN = slice(7, 10)  # own [loss bits, local-gradient fingerprint a, b]
REPLAY = slice(10, 13)  # the same three values recomputed for the partner
NF = 13  # flags: optimizer.step ran, weights non-finite, optimizer state non-finite
BUF = slice(14, 14 + BUFFER_ROW)  # persistent buffers (detection.weights.buffers)
ROW = 14 + BUFFER_ROW
STEPPED, WEIGHTS_NONFINITE, STATE_NONFINITE = 1, 2, 4  # bits of the NF word

# (non-finite verdict) -> (verdict left once overflows are accounted for, detail, overflow)
ScalerResolution = Callable[
    [NonFiniteVerdict | None], tuple[NonFiniteVerdict | None, dict[str, Any], bool]
]


class Finding(NamedTuple):
    layer: Layer
    phase: Phase
    suspects: tuple[int, ...]
    detail: dict[str, Any]


def any_nonfinite(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """1 (int64, on the device) when any floating-point parameter holds a NaN or an infinity.

    One multi-tensor max-abs (``torch._foreach_norm`` of order ∞: a kernel a chunk of tensors
    on a GPU, not a handful a tensor) and one test of the maxima: a tensor's max |x| is finite
    exactly when every element is (a NaN propagates through the max, an infinity is the max),
    and unlike an L2 norm it cannot overflow on finite values. Empty tensors hold nothing and
    have no max: left out."""
    values = [p.detach() for p in params if p.is_floating_point() and p.numel() > 0]
    if not values:
        return torch.zeros((), dtype=torch.int64, device=params[0].device)
    maxima = torch._foreach_norm(values, ord=float("inf"))
    return (~torch.isfinite(torch.stack(maxima)).all()).to(torch.int64)


def flags_word(
    *,
    stepped: bool,
    weights_nonfinite: torch.Tensor | None,
    state_nonfinite: torch.Tensor,
) -> torch.Tensor:
    """The ``NF`` word: one int64 on the device of ``state_nonfinite`` (a ``[1]`` int64 flag),
    built from it in place, with no host-to-device copy."""
    nf = state_nonfinite.reshape(1) * STATE_NONFINITE
    if weights_nonfinite is not None:
        nf.add_(weights_nonfinite, alpha=WEIGHTS_NONFINITE)
    if stepped:
        nf.add_(STEPPED)
    return nf


def step_row(
    step: int,
    *,
    flags: torch.Tensor,
    weights: torch.Tensor,
    state: torch.Tensor,
    own: Sequence[torch.Tensor],
    replay: torch.Tensor,
    nf: torch.Tensor,
    buffers: torch.Tensor,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's ``ROW`` int64 words, in the layout above (on the device), followed by
    ``extra`` (the per-step layer's words) when given. ``own`` comes in pieces (the loss bits,
    the gradient fingerprint): the row is joined in one ``cat``, as each op is part of a small
    model's fixed cost."""
    device = flags.device
    # a fill, not torch.tensor(..., device=): no host-to-device copy, no sync
    head = torch.full((1,), step, dtype=torch.int64, device=device)
    tail = [extra] if extra is not None else []
    row = torch.cat([head, flags, weights.to(device), state, *own, replay, nf, buffers, *tail])
    assert row.numel() == ROW + sum(t.numel() for t in tail), row.numel()
    return row


def step_row_on_host(
    step: int,
    *,
    flags: Sequence[int],
    weights: Sequence[int],
    state: Sequence[int],
    own: Sequence[int],
    replay: Sequence[int],
    nf: int,
    buffers: Sequence[int],
    extra: Sequence[int] = (),
) -> torch.Tensor:
    """:func:`step_row` from host ints, on a CPU (:mod:`detection.row.words`): the same words in
    the same layout, made a tensor once (over an int64 array, which takes half the time of
    ``torch.tensor`` reading a list; a word out of int64's range raises either way)."""
    words = [step, *flags, *weights, *state, *own, *replay, nf, *buffers]
    if len(words) != ROW:
        raise AssertionError(f"a row of {len(words)} words, the layout has {ROW}")
    words.extend(extra)
    return torch.frombuffer(array.array("q", words), dtype=torch.int64)


def all_finite(rows: Sequence[Sequence[int]]) -> bool:
    """No rank's loss or gradient was non-finite in this step (from the gathered rows)."""
    for r in rows:
        if r[PRE] or r[POST]:
            return False
        if not math.isfinite(struct.unpack("<d", struct.pack("<q", r[OWN][0]))[0]):
            return False
    return True


def _state_fingerprint(weights: Sequence[int], buffers: Sequence[int]) -> Fingerprint:
    """Weights plus buffers: buffers are numbered after the parameters, so the sum of the two
    fingerprints is that of the guard's ``state_tensors`` (what a checkpoint holds)."""
    return to_fingerprint(weights[0] + buffers[0], weights[1] + buffers[1])  # sums mod 2^64


@dataclass(frozen=True)
class Decision:
    """One step's verdict: the alarm (if any), the outcome for the checkpoint gate, and what
    the audit proved (``inconclusive``: it ran over non-finite values)."""

    alarm: Alarm | None
    outcome: StepOutcome
    audit_passed: bool
    inconclusive: bool


class StepDecision:
    """The decision, with what it remembers across steps (known divergence, possible poison).

    Identical on every rank: it only ever reads the gathered table.
    """

    def __init__(
        self,
        *,
        world_size: int,
        nodes: Sequence[str],
        partners: Sequence[int],
        mode: AuditMode,
        checks: StepChecks,
        buffers_broadcast: bool,
    ) -> None:
        self.world_size = world_size
        self.nodes = tuple(nodes)
        self.partners = list(partners)
        self.mode = mode
        self.checks = checks
        self.buffers_broadcast = buffers_broadcast
        self.known = KnownDivergence()  # replicas known (alarmed) to hold different weights
        self.poison_possible = False  # a non-finite step was applied: weights may be NaN

    def decide(
        self,
        step: int,
        rows: Sequence[Sequence[int]],
        *,
        audit: bool,
        rank: int,
        account_for_scaler: ScalerResolution,
    ) -> Decision:
        poisoned = self.poison_possible and any(r[NF] & WEIGHTS_NONFINITE for r in rows)
        findings: list[Finding] = []

        nonfinite = attribute_nonfinite([bool(r[PRE]) for r in rows], [bool(r[POST]) for r in rows])
        nonfinite, resolution, overflow = account_for_scaler(nonfinite)
        stepped = any(r[NF] & STEPPED for r in rows)
        self.poison_possible = nonfinite is not None and (stepped or poisoned)
        wrong = self.known.minority()  # replicas an alarm named as holding wrong weights
        follows = poisoned or (
            nonfinite is not None
            and bool(nonfinite.pre_ranks)
            and set(nonfinite.pre_ranks) <= wrong
        )
        if nonfinite is not None and not follows:
            finding = _nonfinite_finding(nonfinite)
            findings.append(finding._replace(detail={**finding.detail, **resolution}))

        weights = [tuple(r[W]) for r in rows]
        states = [tuple(r[S]) for r in rows]
        values = [w + s for w, s in zip(weights, states, strict=True)]
        verdict = majority_vote(values)
        known_before = self.known.snapshot()
        new_divergence = False
        if verdict.unanimous:
            if nonfinite is None:  # equal again (not merely equally NaN): forget the divergence
                self.known.clear()
        elif not poisoned and self.known.is_new(values):
            findings.append(self._vote_finding(verdict, weights, states))
            new_divergence = True

        buffers = buffer_finding([r[BUF] for r in rows], self.buffers_broadcast)
        if buffers is not None and not poisoned:
            findings.append(Finding(Layer.FINGERPRINT, Phase.WEIGHTS, buffers[0], buffers[1]))

        audit_passed = False
        inconclusive = audit and not all_finite(rows)
        if audit:
            result = attribute_audit(
                self.partners, [r[OWN] for r in rows], [r[REPLAY] for r in rows], self.nodes
            )
            # NaN is bit-equal to NaN: an audit over non-finite values proves nothing.
            audit_passed = result.passed and not inconclusive
            follows = poisoned or all(known_before.apart(a, b) for a, b in result.mismatches)
            if not result.passed and not follows:
                findings.append(self._audit_finding(result))

        findings = self.checks.merge(
            findings,
            [int(bool(r[NF] & STATE_NONFINITE)) for r in rows],
            known=_diverged(known_before),
            poisoned=poisoned,
            nonfinite=nonfinite is not None or overflow,
            make=Finding,
        )
        alarm = self._merge(step, findings)
        if new_divergence and alarm is not None:
            self.known.record(values)  # known only once alarmed
        own = rows[rank]
        outcome = StepOutcome(
            step=step,
            ranks=tuple(range(self.world_size)),
            fingerprint=_state_fingerprint(own[W], own[BUF][2:4]),
            vote_passed=verdict.unanimous and buffers is None,
            audit=self.mode if audit else None,
            audit_passed=audit_passed,
            alarm=alarm,
        )
        return Decision(alarm, outcome, audit_passed, inconclusive)

    def _vote_finding(
        self,
        verdict: VoteVerdict,
        weights: Sequence[tuple[int, ...]],
        states: Sequence[tuple[int, ...]],
    ) -> Finding:
        parts = [
            name
            for name, values in (("weights", weights), ("optimizer_state", states))
            if len(set(values)) > 1
        ]
        detail: dict[str, Any] = {
            "diverged": "+".join(parts),
            "replicas": self.world_size,
            "fingerprints": {str(r): to_fingerprint(*w).hex() for r, w in enumerate(weights)},
        }
        if "optimizer_state" in parts:
            detail["optimizer_state_fingerprints"] = {
                str(r): to_fingerprint(*s).hex() for r, s in enumerate(states)
            }
        if not verdict.culprit_known:
            detail["culprit"] = "unknown"
            detail["reason"] = (
                "two replicas can say that they differ, never which one is wrong"
                if self.world_size == 2
                else "no strict majority among the replicas"
            )
        return Finding(Layer.FINGERPRINT, Phase.WEIGHTS, verdict.divergent, detail)

    def _audit_finding(self, audit: AuditVerdict) -> Finding:
        lone = len(audit.mismatches) == 1
        phase = Phase.LOSS if self.mode is AuditMode.LOSS else Phase.GRADIENT
        return Finding(
            Layer.AUDIT,
            phase,
            audit.suspects,
            {
                "mode": str(self.mode),
                "mismatched_pairs": [{"auditor": a, "audited": b} for a, b in audit.mismatches],
                "attribution": "a single disagreeing pair: either side may have erred"
                if lone
                else "the smallest set of nodes explaining every disagreeing pair",
                **attribute_pairs(audit.mismatches, self.nodes).to_detail(),
            },
        )

    def _merge(self, step: int, findings: Sequence[Finding]) -> Alarm | None:
        """One alarm per step: the most specific finding leads (non-finite names the rank that
        produced the value, the vote names the divergent replica, the audit names pairs); the
        others ride along in ``detail.also``."""
        if not findings:
            return None
        lead = findings[0]
        detail = lead.detail
        if len(findings) > 1:
            also = [
                {
                    "layer": str(f.layer),
                    "phase": str(f.phase),
                    "suspect_ranks": list(f.suspects),
                    **f.detail,
                }
                for f in findings[1:]
            ]
            detail = {**detail, "also": also}
        return Alarm.for_ranks(step, lead.layer, lead.phase, lead.suspects, self.nodes, detail)


def _nonfinite_finding(verdict: NonFiniteVerdict) -> Finding:
    reason = (
        "non-finite local gradient"
        if verdict.pre_ranks
        else "non-finite gradient after all-reduce from finite local gradients"
    )
    return Finding(
        Layer.NONFINITE,
        verdict.phase,
        verdict.suspects,
        {
            "pre_allreduce_ranks": list(verdict.pre_ranks),
            "post_allreduce_ranks": list(verdict.post_ranks),
            "reason": reason,
        },
    )


def _diverged(known: KnownDivergence) -> frozenset[int]:
    """The replicas whose statistics and optimizer state follow from an alarmed divergence:
    the minority a majority named, or — with no majority — every replica (each one's gradient
    reaches the others through the all-reduce)."""
    if not known.classes:
        return frozenset()
    return known.minority() or frozenset().union(*known.classes)
