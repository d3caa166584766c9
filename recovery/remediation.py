"""Remediation: what happens to an approved faulty node, behind one small interface.

Outside SageMaker HyperPod a cluster replaces nodes its own way, so the fix stage does not
talk to HyperPod directly: it asks the :class:`Remediation` wired for the cluster
(``SDCGUARD_RECOVERY_REMEDIATION``) to plan, start, wait for and finally release one node's
remediation. The backends (:class:`RemediationKind`):

- ``hyperpod`` — ``BatchReplaceClusterNodes`` / ``BatchRebootClusterNodes``
  (:mod:`recovery.aws.remediation`);
- ``kubernetes`` — drain (PodDisruptionBudgets honoured), delete the Node, and wait for the
  cluster's autoscaler to bring a new node (:mod:`recovery.kube.remediation`);
- ``nvsentinel`` — an NVIDIA NVSentinel ``ExternalFault`` for the node, followed to completion
  and deleted when the incident resolves (:mod:`recovery.kube.nvsentinel`);
- ``isolate`` — the node stays cordoned, tainted and labelled for forensics; nothing is
  replaced and a human takes over (:mod:`recovery.isolation`, any :class:`NodeOps`).

The invariant every backend keeps: **one remediation per node and incident, even across
crashes.** The caller (the fix stage) stores the :meth:`Remediation.plan` with its ledger claim
*before* :meth:`Remediation.start`; a later attempt gets ``first=False`` and the same plan, and
``start`` must then look at the outside system before it asks again (a deleted node stays
deleted; an existing ``ExternalFault`` is not created twice). The other safety rules are the
caller's and hold for every backend alike: only approved (accused) nodes reach ``plan``, the
storm guard runs before, and only our own marks are undone.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from recovery.errors import PermanentError

__all__ = [
    "Remediation",
    "RemediationKind",
    "RemediationOutcome",
    "RemediationVerb",
    "UnsupportedRemediation",
    "remedy",
]


class RemediationKind(StrEnum):
    """Which system remediates an approved node (``SDCGUARD_RECOVERY_REMEDIATION``)."""

    HYPERPOD = "hyperpod"
    """SageMaker HyperPod replaces (or reboots) the instance: the default."""
    KUBERNETES = "kubernetes"
    """Drain, delete the Node; Karpenter or the cluster autoscaler brings a new one."""
    NVSENTINEL = "nvsentinel"
    """NVIDIA NVSentinel takes an ``ExternalFault`` and cordons, drains and remediates."""
    ISOLATE = "isolate"
    """Keep the node out of service, untouched, for investigation; a human takes over."""


class RemediationVerb(StrEnum):
    """What the approval asked for (the policy's ``action``)."""

    REPLACE = "replace"
    REBOOT = "reboot"


class RemediationOutcome(StrEnum):
    """Where the node stands once :meth:`Remediation.wait` returned; tells the flow what next."""

    REPLACED = "replaced"
    """The node left the cluster; ``new_node`` joined in its place (the job resumes there)."""
    RESTORED = "restored"
    """The same node is healthy again (rebooted in place): our cordon comes off, it resumes."""
    ISOLATED = "isolated"
    """The node stays out of service on purpose; training is not resumed automatically."""


class UnsupportedRemediation(PermanentError):
    """The wired backend cannot do what the policy asked (e.g. a reboot without HyperPod)."""


@runtime_checkable
class Remediation(Protocol):
    """One node's remediation: plan, start, wait, and release when the incident resolves.

    Plans and results are JSON objects, because the ledger keeps them with the action claim.
    A result always holds ``node``, ``outcome`` (a :class:`RemediationOutcome` value) and
    ``new_node`` (the node the job resumes on, or None when isolated).
    """

    @property
    def kind(self) -> RemediationKind: ...

    @property
    def releases_on_resolve(self) -> bool:
        """Whether :meth:`release` has anything to remove when the incident resolves."""
        ...

    def describe(self, verb: RemediationVerb) -> str:
        """One sentence for the approval form: who acts on the node and what happens to it."""
        ...

    def plan(self, node: str, incident_id: str, verb: RemediationVerb) -> dict[str, Any]:
        """Everything a later attempt must know, read *before* any change (the node may be
        gone afterwards). Raises :class:`UnsupportedRemediation` for a verb it cannot do."""
        ...

    def start(self, plan: Mapping[str, Any], *, first: bool) -> None:
        """Ask for the remediation. ``first=False``: an earlier attempt may have asked
        already — look first and never ask for a second remediation of the node."""
        ...

    def wait(
        self, plan: Mapping[str, Any], *, timeout_s: float, taken: Collection[str]
    ) -> dict[str, Any]:
        """Until the remediation is done, at most ``timeout_s``; the result (see above).

        ``taken``: nodes and instances this incident's other remediations already took as
        their replacement — never claimed twice.
        """
        ...

    def release(self, result: Mapping[str, Any], incident_id: str) -> bool:
        """When the incident resolves: remove what this backend left behind for it (e.g. the
        ``ExternalFault``). True if something was removed now; idempotent."""
        ...


def remedy(
    node: str, outcome: RemediationOutcome, new_node: str | None, **detail: Any
) -> dict[str, Any]:
    """A :meth:`Remediation.wait` result in the one shape the fix stage reads."""
    return {"node": node, "outcome": outcome.value, "new_node": new_node, **detail}
