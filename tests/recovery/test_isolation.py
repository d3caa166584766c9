"""Isolation on both node backends: cordoned, tainted and labelled for forensics, once; the
same incident's uncordon takes all of it off; a foreign cordon never becomes ours."""

from __future__ import annotations

import pytest

from recovery.isolation import IsolateRemediation
from recovery.nodes import (
    ANNOTATION_CORDONED_BY,
    ANNOTATION_ISOLATION_NOTE,
    LABEL_ISOLATED,
    TAINT_KEY,
)
from recovery.remediation import RemediationOutcome, RemediationVerb
from tests.recovery.test_nodes import INCIDENT, Backend, _ours, backend

__all__ = ["backend"]  # the two-backend fixture of test_nodes, used here too


def test_isolate_keeps_the_node_out_of_service_and_is_done_once(backend: Backend) -> None:
    backend.seed("node-1")
    remediation = IsolateRemediation(backend.ops)
    plan = remediation.plan("node-1", INCIDENT, RemediationVerb.REPLACE)

    remediation.start(plan, first=True)
    first = backend.ops.get("node-1")
    remediation.start(plan, first=False)  # a repeat after a crash changes nothing

    info = backend.ops.get("node-1")
    assert _ours(info) == _ours(first)
    assert info.unschedulable is True
    assert info.labels[LABEL_ISOLATED] == INCIDENT
    assert "investigation" in info.annotations[ANNOTATION_ISOLATION_NOTE]
    assert [t.value for t in info.taints if t.key == TAINT_KEY] == [INCIDENT]
    result = remediation.wait(plan, timeout_s=1, taken=set())
    assert (result["outcome"], result["new_node"]) == (RemediationOutcome.ISOLATED.value, None)
    assert remediation.release(result, INCIDENT) is False  # the human's to lift


def test_isolate_never_takes_over_a_foreign_cordon_and_uncordon_undoes_only_ours(
    backend: Backend,
) -> None:
    backend.seed("node-1", unschedulable=True)  # an operator cordoned it first
    IsolateRemediation(backend.ops).start({"node": "node-1", "incident_id": INCIDENT}, first=True)
    assert ANNOTATION_CORDONED_BY not in backend.ops.get("node-1").annotations

    assert backend.ops.uncordon("node-1", INCIDENT) is False  # not our cordon: it stays
    info = backend.ops.get("node-1")
    assert info.unschedulable is True
    assert _ours(info) == {"labels": {}, "annotations": {}, "taints": []}


@pytest.mark.parametrize("verb", list(RemediationVerb))
def test_isolate_describes_what_it_does_whatever_was_asked(
    backend: Backend, verb: RemediationVerb
) -> None:
    assert "nothing is replaced or rebooted" in IsolateRemediation(backend.ops).describe(verb)
