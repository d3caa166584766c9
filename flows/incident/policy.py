"""What the incident flow may do on its own, and the storm guard that limits it.

The policy is a typed flow parameter (``incident_response(incident_id, policy)``): an operator
sees it in the Prefect UI next to every run and can change it per run or per deployment without
touching code. Its dangerous knobs — auto-approval and the storm thresholds — are bounded by
server-side limits (``SDCGUARD_POLICY_…``, read by the flow's own process): anyone with Prefect
API access can set a run's parameters, so a parameter may only make the policy *stricter*
(:func:`within_limits`). The two guards here are pure functions of ledger facts so that they can
be tested exhaustively and so that a re-run of the flow reaches the same decision from the same
facts.

Invariants:
- The storm guard trips when at least ``storm_min_nodes`` (two or more) implicated nodes are
  *more than* ``storm_node_share`` of a job's nodes, or when *more than*
  ``storm_max_nodes_per_hour`` distinct nodes are implicated within the window. One implicated
  node is never a storm by share alone, so a 3-node job can still cordon its one bad node. A
  storm is more likely a software fault (a bad rollout, a numerics bug) than many GPUs failing at
  once, so it forbids any automatic replacement and hands the incident to a human.
- The effective policy of a run is never looser than the server's limits: auto-approval only
  when both allow it, the lowest share and count thresholds, the longest window.
- Auto-approval approves only a ``hardware`` verdict that names one node, backed by alarm
  evidence that itself names exactly that node (a strict-majority fingerprint vote or a ring
  audit), and never while the storm guard trips. Two replicas that disagree can say "they
  differ", never "which one", so weaker evidence always waits for a human.
- The per-step layer's findings (``gradstats``, ``allreduce``, ``optstate``, ``abft``) are weaker
  evidence: a statistical outlier, a rounding bound or a calibrated tolerance, not a recomputation
  or a majority. They never back an automatic approval on their own; an incident whose only
  evidence they are waits for a human, and the refusal says why.
- An alarm of another detector (layer ``external``: Megatron's exit 16/17, torchtitan's
  ``SDCReplayMismatch``, a hardware health event) is weaker still for attribution: it comes from
  outside, through an adapter, and sdcguard cannot check how it named the node. It never backs
  an automatic approval, alone or with the per-step layer; only sdcguard's own vote, audit or
  pre-all-reduce non-finite check naming the same node can.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from detection.external.alarm import EXTERNAL_LAYER

__all__ = [
    "EXTERNAL_LAYER",
    "WEAKER_LAYERS",
    "AlarmEvidence",
    "AutoApproval",
    "IncidentPolicy",
    "NodeAction",
    "PolicyLimits",
    "StormCheck",
    "auto_approval",
    "storm_guard",
    "within_limits",
]

# Alarm layers whose evidence can name a single node (DESIGN, "What each detection layer can see").
_MAJORITY_LAYER = "fingerprint"
_AUDIT_LAYER = "audit"
_NONFINITE_LAYER = "nonfinite"
_PRE_ALLREDUCE = "pre-allreduce"
_HARDWARE = "hardware"
# The per-step layer (detection.stepcheck): evidence on the step itself, weaker than a vote or
# an audit, so never sufficient alone for auto-approval.
WEAKER_LAYERS = frozenset({"gradstats", "allreduce", "optstate", "abft"})


class NodeAction(StrEnum):
    """What an approved incident does to the faulty node's instance."""

    REPLACE = "replace"
    """HyperPod replaces the instance; the new instance joins under a new node name."""
    REBOOT = "reboot"
    """HyperPod reboots the instance in place; the node keeps its name and is uncordoned."""


class IncidentPolicy(BaseModel):
    """Operator policy for one incident run; every field is bounded so a typo cannot disarm it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    action: NodeAction = Field(
        NodeAction.REPLACE,
        description="What to do with a node found faulty once the incident is approved.",
    )
    auto_approve: bool = Field(
        False,
        description=(
            "Approve without a human, only for a hardware verdict backed by a strict majority "
            "or a ring audit naming exactly one node, and never during an alarm storm."
        ),
    )
    approval_timeout_s: int = Field(
        3600,
        ge=1,
        le=7 * 24 * 3600,
        description="How long to wait for a human decision before the incident expires.",
    )
    uncordon_on_reject: bool = Field(
        False,
        description="The approval form's default for uncordoning the suspect nodes on reject.",
    )
    storm_node_share: float = Field(
        0.25,
        gt=0.0,
        le=1.0,
        description="Alarms implicating more than this share of a job's nodes form a storm.",
    )
    storm_min_nodes: int = Field(
        2,
        ge=2,
        le=10_000,
        description=(
            "The share rule counts only when at least this many nodes are implicated: one bad "
            "node is never a storm by share alone, however small the job."
        ),
    )
    storm_max_nodes_per_hour: int = Field(
        4,
        ge=1,
        le=10_000,
        description="More distinct nodes than this implicated within the window form a storm.",
    )
    storm_window_s: int = Field(
        3600,
        ge=60,
        le=7 * 24 * 3600,
        description="The window over which implicated nodes are counted (one hour by default).",
    )
    cordon_in_storm: bool = Field(
        False,
        description=(
            "Cordon the implicated nodes even during a storm. Off by default: a storm is likely "
            "software, and cordoning a quarter of a fleet for it would drain the cluster."
        ),
    )
    task_retries: int = Field(
        3, ge=0, le=20, description="Retries of a stage after a temporary error."
    )
    retry_delay_s: float = Field(
        2.0,
        ge=0.0,
        le=600.0,
        description="Base delay of the exponential backoff between retries of a stage.",
    )
    spare_nodes: int = Field(
        2,
        ge=1,
        le=8,
        description="Spare nodes the diagnostic rerun runs on (two spares prove determinism).",
    )
    replacement_timeout_s: int = Field(
        1800,
        ge=1,
        le=24 * 3600,
        description="How long to wait for HyperPod to bring up a replacement instance.",
    )

    def retry_delays(self) -> list[float]:
        """Exponential backoff (1x, 2x, 4x, ... the base) for the stage retries."""
        return [self.retry_delay_s * (2**i) for i in range(self.task_retries)]


class PolicyLimits(Protocol):
    """The server's bounds on the dangerous knobs (``flows.settings.PolicySettings``)."""

    @property
    def auto_approve(self) -> bool: ...
    @property
    def storm_node_share(self) -> float: ...
    @property
    def storm_min_nodes(self) -> int: ...
    @property
    def storm_max_nodes_per_hour(self) -> int: ...
    @property
    def storm_window_s(self) -> int: ...


def within_limits(policy: IncidentPolicy, limits: PolicyLimits) -> tuple[IncidentPolicy, list[str]]:
    """The run's effective policy: ``policy`` made no looser than the server's ``limits``.

    Returns it with one line per knob the run's parameter tried to loosen (for the log and the
    report). Stricter is: auto-approval off, a lower share, a lower minimum count, a lower
    hourly count, a longer window (more alarms counted).
    """
    bounded = {
        "auto_approve": policy.auto_approve and limits.auto_approve,
        "storm_node_share": min(policy.storm_node_share, limits.storm_node_share),
        "storm_min_nodes": min(policy.storm_min_nodes, limits.storm_min_nodes),
        "storm_max_nodes_per_hour": min(
            policy.storm_max_nodes_per_hour, limits.storm_max_nodes_per_hour
        ),
        "storm_window_s": max(policy.storm_window_s, limits.storm_window_s),
    }
    refused = [
        f"{name}={getattr(policy, name)!r} is looser than the server's limit; {value!r} applies"
        for name, value in bounded.items()
        if getattr(policy, name) != value
    ]
    return policy.model_copy(update=bounded), refused


@dataclass(frozen=True)
class AlarmEvidence:
    """The part of a recorded alarm that the guards reason about."""

    layer: str
    suspect_nodes: tuple[str, ...]
    at: datetime
    detail: Mapping[str, Any]
    phase: str = ""


@dataclass(frozen=True)
class StormCheck:
    """Outcome of the storm guard, with a reason an operator can act on."""

    tripped: bool
    reason: str
    implicated: tuple[str, ...]
    job_nodes: int
    share: float | None
    recent_nodes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "tripped": self.tripped,
            "reason": self.reason,
            "implicated": list(self.implicated),
            "job_nodes": self.job_nodes,
            "share": self.share,
            "recent_nodes": list(self.recent_nodes),
        }


@dataclass(frozen=True)
class AutoApproval:
    """Whether the policy may approve on its own, and why (or why not)."""

    approved: bool
    reason: str


def storm_guard(
    *,
    implicated: Collection[str],
    job_nodes: Collection[str],
    recent: Iterable[tuple[str, datetime]],
    now: datetime,
    policy: IncidentPolicy,
) -> StormCheck:
    """Decide whether the alarms look like a storm rather than one bad node.

    ``implicated`` are the nodes this incident's alarms name; ``job_nodes`` the nodes the job
    runs on (empty when the job registered no ranks: only the hourly count applies then);
    ``recent`` every (node, alarm time) pair the ledger holds, across all jobs, so a bad software
    rollout that trips alarms in many jobs at once is caught too.
    """
    names = tuple(sorted(set(implicated)))
    nodes = set(job_nodes)
    since = now - timedelta(seconds=policy.storm_window_s)
    recent_nodes = tuple(sorted({node for node, at in recent if since <= at <= now} | set(names)))
    reasons = []
    share: float | None = None
    if nodes:
        share = len(names) / len(nodes)
        if len(names) >= policy.storm_min_nodes and share > policy.storm_node_share:
            reasons.append(
                f"alarms implicate {len(names)} of the job's {len(nodes)} nodes "
                f"({share:.0%} > {policy.storm_node_share:.0%})"
            )
    if len(recent_nodes) > policy.storm_max_nodes_per_hour:
        reasons.append(
            f"{len(recent_nodes)} distinct nodes implicated within {policy.storm_window_s} s "
            f"(> {policy.storm_max_nodes_per_hour})"
        )
    if reasons:
        reason = (
            "alarm storm, suspected software fault: "
            + "; ".join(reasons)
            + " — no automatic replacement, a human must decide"
        )
    else:
        reason = "no storm: " + (
            f"{len(names)} of {len(nodes)} nodes implicated"
            if nodes
            else f"{len(names)} node(s) implicated, job size unknown"
        )
    return StormCheck(
        tripped=bool(reasons),
        reason=reason,
        implicated=names,
        job_nodes=len(nodes),
        share=share,
        recent_nodes=recent_nodes,
    )


def auto_approval(
    *,
    policy: IncidentPolicy,
    verdict: str | None,
    verdict_node: str | None,
    alarms: Sequence[AlarmEvidence],
    storm: StormCheck,
) -> AutoApproval:
    """May the policy approve this incident without a human? Only on the strongest evidence."""
    if not policy.auto_approve:
        return AutoApproval(False, "auto-approval is off in the policy")
    if storm.tripped:
        return AutoApproval(False, f"auto-approval refused: {storm.reason}")
    if verdict != _HARDWARE or not verdict_node:
        return AutoApproval(
            False, f"auto-approval refused: the verdict is {verdict or 'missing'}, not hardware"
        )
    backing = [a for a in alarms if _names_exactly(a, verdict_node)]
    if not backing and any(a.layer == EXTERNAL_LAYER for a in alarms):
        sources = sorted({a.phase or "unknown" for a in alarms if a.layer == EXTERNAL_LAYER})
        return AutoApproval(
            False,
            f"auto-approval refused: the evidence is another detector's alarm "
            f"({', '.join(sources)}), weaker than sdcguard's own vote or audit; a human decides",
        )
    if not backing and any(a.layer in WEAKER_LAYERS for a in alarms):
        weaker = sorted({a.layer for a in alarms if a.layer in WEAKER_LAYERS})
        return AutoApproval(
            False,
            f"auto-approval refused: the only evidence is the per-step layer ({', '.join(weaker)})"
            ", statistical or algebraic findings weaker than a vote or an audit; a human decides",
        )
    if not backing:
        return AutoApproval(
            False,
            f"auto-approval refused: no strict-majority vote, ring audit or pre-all-reduce "
            f"non-finite check names only {verdict_node}",
        )
    names = {
        _MAJORITY_LAYER: "strict-majority vote",
        _AUDIT_LAYER: "ring audit",
        _NONFINITE_LAYER: "non-finite local gradient before all-reduce",
    }
    kinds = sorted({names[a.layer] for a in backing})
    return AutoApproval(
        True,
        f"auto-approved by policy: hardware verdict on {verdict_node}, backed by "
        + " and ".join(kinds),
    )


def _names_exactly(alarm: AlarmEvidence, node: str) -> bool:
    """An alarm whose attribution is direct and names exactly ``node``: a ring audit, a
    strict-majority vote (which must not deny its majority), or a non-finite check *before*
    all-reduce — the rank's own local gradient was NaN/Inf, so no other rank produced it. A
    non-finite check after all-reduce names nobody: every replica sees the same sum."""
    if alarm.suspect_nodes != (node,):
        return False
    if alarm.layer == _AUDIT_LAYER:
        return True
    if alarm.layer == _NONFINITE_LAYER:
        return alarm.phase == _PRE_ALLREDUCE
    return alarm.layer == _MAJORITY_LAYER and alarm.detail.get("majority", True) is not False
