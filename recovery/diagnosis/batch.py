"""Run several reruns at once: each node's one after the other, different nodes side by side.

A diagnosis needs the same steps recomputed on two spares and on every suspect. On a cluster
those are different machines, so nothing but the runner serialised them: run one after the
other, the time to a verdict was the sum of the reruns (each a Job that waits for its pod, its
image and its checkpoint). Side by side it is the longest of them. A runner says its nodes are
separate machines with ``parallel = True`` (``KubeRerunner``); one whose simulated nodes
share a host (``LocalRerunner``) keeps them one after the other, where lockstep ranks of
several reruns would only slow each other down.

Invariants:

* **One rerun at a time per node.** Two reruns of the same node (one spare, rerun twice
  to show the computation is reproducible) run in order, so neither waits on the other's
  devices and neither's timing bears on the other's result.
* **The outcome does not depend on the schedule.** Results come back in request order; if
  reruns fail, every other still runs to its end and the first failure *in request order* is
  raised, so a failure reads the same as when the reruns ran one by one. A runner without
  ``parallel`` runs them exactly so: in request order, stopping at the first failure.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from recovery.diagnosis.rerun import Rerunner, RerunRequest, RerunResult

__all__ = ["nodes_are_machines", "rerun_all"]

log = logging.getLogger(__name__)


def nodes_are_machines(runner: Rerunner) -> bool:
    """Whether ``runner``'s nodes are separate machines: its class says ``parallel = True``
    (an optional attribute of the :class:`~recovery.diagnosis.rerun.Rerunner` protocol; a runner
    that does not say so, or says anything else, reruns one at a time)."""
    return getattr(runner, "parallel", False) is True


def rerun_all(runner: Rerunner, requests: Sequence[RerunRequest]) -> list[RerunResult]:
    """The results of ``requests`` in their order; see the module for the schedule."""
    by_node: dict[str, list[int]] = {}
    for i, request in enumerate(requests):
        by_node.setdefault(request.node, []).append(i)
    results: list[RerunResult | None] = [None] * len(requests)
    errors: dict[int, BaseException] = {}

    def run_node(indices: list[int]) -> None:
        for i in indices:
            try:
                results[i] = runner.rerun(requests[i])
            except Exception as err:  # raised below, in request order, once all have ended
                log.warning(
                    "replay failed: %s",
                    err,
                    extra={"job": requests[i].job_id, "node": requests[i].node},
                )
                errors[i] = err

    if len(by_node) <= 1 or not nodes_are_machines(runner):
        # one after the other in request order, stopping at the first failure
        return [runner.rerun(request) for request in requests]
    else:
        with ThreadPoolExecutor(max_workers=len(by_node), thread_name_prefix="replay") as pool:
            for done in [pool.submit(run_node, indices) for indices in by_node.values()]:
                done.result()
    if errors:
        raise errors[min(errors)]
    return [r for r in results if r is not None]
