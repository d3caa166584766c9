"""An alarm naming nodes outside the job's rank map never gets them cordoned.

The incident flow runs for real (local backends, Prefect API): the alarm names the faulty
node of the job *and* two nodes the job does not run on (a node of another team, a made-up
name). No foreign node is ever cordoned or tainted; they stay on the incident as evidence.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from db import IncidentState, Ledger
from recovery.aws.local import LocalAws, start_local_aws
from recovery.jobs import JobKind, JobRef
from tests.flows.test_incident import FAULTY, JOB, Approver, Site, build_site

pytestmark = pytest.mark.usefixtures("prefect_api")

FOREIGN = ["ip-10-9-9-9.other-team", "node-77"]


@pytest.fixture(scope="module")
def local_aws() -> Iterator[LocalAws]:
    with start_local_aws() as aws:
        yield aws


@pytest.fixture(autouse=True)
def _fast_approval_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SDCGUARD_FLOW_APPROVAL_POLL_S", "1")


@pytest.fixture
def foreign_site(tmp_path: Path, sqlite_ledger: Ledger, local_aws: LocalAws) -> Iterator[Site]:
    built = build_site(tmp_path, sqlite_ledger, local_aws, suspects=[FAULTY, *FOREIGN])
    yield built
    built.jobs.stop(JobRef(JOB, kind=JobKind.LOCAL))


def test_an_alarm_naming_nodes_outside_the_rank_map_never_cordons_them(
    foreign_site: Site,
) -> None:
    incident = foreign_site.incident()
    assert incident.suspect_nodes == [FAULTY]
    assert incident.outside_rank_map == sorted(FOREIGN)
    assert incident.needs_review

    answer = {"decision": "reject", "approver": "bob", "reason": "look at the foreign nodes"}
    with Approver(foreign_site.incident_id, answer) as approver:
        foreign_site.run()
    assert approver.error is None

    done = foreign_site.incident()
    assert done.state is IncidentState.REJECTED
    cordoned = {target for kind, target in foreign_site.effects.done if kind in ("cordon", "taint")}
    assert cordoned <= {FAULTY}
    assert not cordoned & set(FOREIGN)
    targets = {action.target for action in done.actions}
    assert not targets & set(FOREIGN)
    assert done.outside_rank_map == sorted(FOREIGN)
