"""The verdict of a deep diagnosis: rerun the suspect steps on chosen nodes and say who is at fault.

A rerun is evidence only if it is deterministic: the same checkpoint, micro-batches, RNG state
(dropout), intra-op thread count, library versions and device model as the original. The
verdict therefore first checks that the rerun is reproducible (two spare nodes, or the same
spare twice, must agree bit for bit) before it believes any difference between nodes.

Verdicts (DESIGN):
- ``hardware``: the mismatch follows the suspect node — spares agree with each other, the
  suspect node computes something else. The first diverging step is then rerun with a
  per-submodule probe to name the first submodule (and its operation kind) whose forward
  output or gradient differs.
- ``software``: every node computes the same thing but not what training recorded before the
  alarm could have happened (the environment or code differs), or the reruns do not even agree
  with each other (nondeterminism): the rerun is not evidence against any node.
- ``inconclusive``: no node reproduces a mismatch. A transient fault stays possible; the node is
  *not* cleared by this.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from recovery.diagnosis.batch import nodes_are_machines, rerun_all
from recovery.diagnosis.rerun import Rerunner, RerunRequest, RerunResult, StepRecord
from recovery.errors import PermanentError

__all__ = ["Verdict", "VerdictResult", "diagnose", "first_diverging_module", "first_mismatch"]

log = logging.getLogger(__name__)


class Verdict(StrEnum):
    HARDWARE = "hardware"
    SOFTWARE = "software"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class VerdictResult:
    verdict: Verdict
    node: str | None
    first_step: int | None
    submodule: str | None = None
    op_kind: str | None = None
    reason: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict.value,
            "node": self.node,
            "first_step": self.first_step,
            "submodule": self.submodule,
            "op_kind": self.op_kind,
            "reason": self.reason,
            "detail": self.detail,
        }


def first_mismatch(a: Sequence[StepRecord], b: Sequence[StepRecord]) -> int | None:
    """The first step present in both traces whose records differ, or None."""
    by_step = {r.step: r for r in b}
    for record in sorted(a, key=lambda r: r.step):
        other = by_step.get(record.step)
        if other is not None and not record.same_as(other):
            return record.step
    return None


def first_diverging_module(
    probe_a: dict[str, Any], probe_b: dict[str, Any]
) -> tuple[str, str, str] | None:
    """(module, direction, op kind) of the first submodule, in execution order, whose forward
    output (then gradient) differs on any rank between two probes of the same step."""
    order: list[str] = list(probe_a.get("order") or [])
    kinds: dict[str, str] = dict(probe_a.get("kinds") or {})
    ranks_a: dict[str, Any] = probe_a.get("ranks", {})
    ranks_b: dict[str, Any] = probe_b.get("ranks", {})
    for direction, modules in (("forward", order), ("backward", list(reversed(order)))):
        for name in modules:
            for rank, rec_a in sorted(ranks_a.items()):
                rec_b = ranks_b.get(rank, {})
                va = rec_a.get(direction, {}).get(name)
                vb = rec_b.get(direction, {}).get(name)
                if va is not None and vb is not None and va != vb:
                    return name, direction, kinds.get(name, "unknown")
    return None


def diagnose(
    runner: Rerunner,
    base: RerunRequest,
    suspect_nodes: Sequence[str],
    spare_nodes: Sequence[str],
    *,
    reference: Sequence[StepRecord] | None = None,
    alarm_step: int | None = None,
) -> VerdictResult:
    """Rerun ``base`` on the spares and on every suspect node and decide who is at fault.

    Invariant: a node is named only when (1) the rerun is reproducible — the two spare runs
    agree bit for bit — and (2) the suspect's rerun differs from the spares'.

    A runner whose nodes are separate machines (``parallel``) reruns in two rounds, the
    reruns of different nodes at once (:func:`~recovery.diagnosis.batch.rerun_all`): the spares
    and every suspect, then the probes of the first differing suspect's first diverging step
    on it and on a spare. Any other reruns one by one, each suspect only once the spares
    agree. The verdict reads the reruns in the same order either way.
    """
    if not spare_nodes:
        raise PermanentError("replay", "diagnose", base.job_id, "no spare node to compare against")
    spare_a_node = spare_nodes[0]
    spare_b_node = spare_nodes[1] if len(spare_nodes) > 1 else spare_nodes[0]
    # Where the nodes are separate machines, the suspects rerun beside the spares (one round);
    # elsewhere each suspect only once the spares agree, and only until one differs.
    at_once = nodes_are_machines(runner)
    first = rerun_all(
        runner,
        [
            replace(base, node=node, probe_step=None)
            for node in (spare_a_node, spare_b_node, *(suspect_nodes if at_once else ()))
        ],
    )
    spare_a, spare_b = first[0], first[1]
    on_suspects: Iterator[RerunResult] = (
        iter(first[2:])
        if at_once
        else (runner.rerun(replace(base, node=s, probe_step=None)) for s in suspect_nodes)
    )
    reruns = {spare_a_node: _summary(spare_a)}
    nondet = first_mismatch(spare_a.steps, spare_b.steps)
    if nondet is not None:
        return VerdictResult(
            Verdict.SOFTWARE,
            node=None,
            first_step=nondet,
            reason=(
                f"replays on healthy spares {spare_a_node} and {spare_b_node} disagree from step "
                f"{nondet}: the computation is not deterministic, so no rerun is evidence"
            ),
            detail={"replays": reruns},
        )

    for suspect, result in zip(suspect_nodes, on_suspects, strict=True):
        reruns[suspect] = _summary(result)
        step = first_mismatch(result.steps, spare_a.steps)
        if step is None:
            continue
        probe_s, probe_p = rerun_all(
            runner,
            [
                replace(base, node=suspect, end=step, probe_step=step),
                replace(base, node=spare_a_node, end=step, probe_step=step),
            ],
        )
        where = None
        if probe_s.probe is not None and probe_p.probe is not None:
            where = first_diverging_module(probe_s.probe, probe_p.probe)
        module, direction, kind = where if where else (None, None, None)
        return VerdictResult(
            Verdict.HARDWARE,
            node=suspect,
            first_step=step,
            submodule=module,
            op_kind=kind,
            reason=(
                f"the mismatch follows {suspect}: spares agree, {suspect} differs from step {step}"
                + (f", first in {module} ({kind}, {direction})" if module else "")
            ),
            detail={"replays": reruns, "direction": direction},
        )

    if reference:
        step = first_mismatch(spare_a.steps, reference)
        if step is not None and (alarm_step is None or step < alarm_step):
            return VerdictResult(
                Verdict.SOFTWARE,
                node=None,
                first_step=step,
                reason=(
                    f"every node computes the same result, and it differs from the training "
                    f"record at step {step}, before the alarm: the environment or code differs"
                ),
                detail={"replays": reruns},
            )
        if step is not None:
            return VerdictResult(
                Verdict.INCONCLUSIVE,
                node=None,
                first_step=step,
                reason=(
                    f"training diverged at step {step} but no node reproduces it: a transient "
                    "fault stays possible; the suspect node is not cleared"
                ),
                detail={"replays": reruns},
            )
    return VerdictResult(
        Verdict.INCONCLUSIVE,
        node=None,
        first_step=None,
        reason="no mismatch on any node: the suspect node is not cleared (a transient fault?)",
        detail={"replays": reruns},
    )


def _summary(result: RerunResult) -> dict[str, Any]:
    last = result.steps[-1] if result.steps else None
    return {
        "steps": len(result.steps),
        "final_weight_fingerprint": last.weight_fingerprint if last else None,
    }
