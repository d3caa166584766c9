"""Replacement after a crash converges on one HyperPod replacement; its wait obeys the policy.

moto reports a node ``Running`` for a while after ``BatchReplaceClusterNodes`` accepted it (as
AWS may: it replaces asynchronously), and refuses a second replace of it with
``InstanceIdInUse``. A flow that crashed right after the call and is run again by a new process
(a new adapter, no memory of the call) must take that refusal for "already replacing" and wait
for the one replacement, never fail or replace twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from moto.moto_api import state_manager

from db import ActionStatus, IncidentState, Ledger
from flows.incident.flow import IncidentFailed
from recovery.aws import moto_hyperpod
from recovery.aws.hyperpod import sagemaker_client
from recovery.aws.local import LocalAws, start_local_aws
from recovery.jobs import JobKind, JobRef
from tests.flows.test_incident import AUTO, FAULTY, JOB, CountingHyperPod, Crash, Site, build_site

pytestmark = pytest.mark.usefixtures("prefect_api")


@pytest.fixture(scope="module")
def local_aws() -> Iterator[LocalAws]:
    with start_local_aws() as aws:
        yield aws


@pytest.fixture(autouse=True)
def _fast_approval_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SDCGUARD_FLOW_APPROVAL_POLL_S", "1")


@pytest.fixture
def replacement_steps() -> Iterator[Callable[[int], None]]:
    """How many HyperPod reads each step of a replacement lasts (moto's state manager)."""

    def reads_per_step(times: int) -> None:
        state_manager.set_transition(
            moto_hyperpod.REPLACE_MODEL, {"progression": "manual", "times": times}
        )

    yield reads_per_step
    state_manager.unset_transition(moto_hyperpod.REPLACE_MODEL)


def _new_process(site: Site, aws: LocalAws) -> None:
    """What a re-run in another process has: a HyperPod adapter that never saw the call."""
    client = sagemaker_client(aws.region, aws.endpoint_url, max_attempts=1, session=aws.session())
    fresh = CountingHyperPod(
        client, site.hyperpod.cluster_name, poll_interval_s=0.01, wait_timeout_s=30
    )
    fresh.effects = site.effects
    site.hyperpod = fresh
    site.backends = dataclasses.replace(site.backends, hyperpod=fresh)


@pytest.fixture
def crash_site(tmp_path: Path, sqlite_ledger: Ledger, local_aws: LocalAws) -> Iterator[Site]:
    built = build_site(tmp_path, sqlite_ledger, local_aws)
    yield built
    built.jobs.stop(JobRef(JOB, kind=JobKind.LOCAL))


def test_in_use_after_a_crash_converges_to_one_replacement(
    crash_site: Site, local_aws: LocalAws, replacement_steps: Callable[[int], None]
) -> None:
    site = crash_site
    replacement_steps(4)  # the node stays reported Running through the re-run's first looks
    calls_before = moto_hyperpod.call_count("BatchReplaceClusterNodes")
    old = site.instance_ids[FAULTY]
    site.effects.crash_after = {4}  # stop, cordon, taint, replace: dies right after the call
    with pytest.raises(Crash):
        site.run(AUTO)
    assert site.hyperpod.describe(old).status == "Running"  # accepted, still reported Running

    _new_process(site, local_aws)
    summary = site.run(AUTO)

    incident = site.incident()
    assert incident.state is IncidentState.RESOLVED, incident.reason
    # the re-run asked again and AWS said InstanceIdInUse: two calls, one replacement
    assert moto_hyperpod.call_count("BatchReplaceClusterNodes") - calls_before == 2
    assert [t for v, t in site.effects.done if v == "replace"] == [old]
    group = site.hyperpod.list_nodes("workers")
    new_ids = {n.instance_id for n in group} - set(site.instance_ids.values())
    assert len(new_ids) == 1
    (replaced,) = summary["replaced"]
    assert (replaced["instance_id"], replaced["new_instance_id"]) == (old, new_ids.pop())
    replace = next(a for a in incident.actions if a.kind == "replace")
    assert (replace.status, replace.attempts) == (ActionStatus.SUCCEEDED, 2)


def test_the_wait_for_a_replacement_is_bounded_by_the_policy(
    crash_site: Site, replacement_steps: Callable[[int], None]
) -> None:
    replacement_steps(1_000_000)  # HyperPod never gets on with it
    policy = AUTO.model_copy(update={"replacement_timeout_s": 1, "task_retries": 0})
    with pytest.raises(IncidentFailed):
        crash_site.run(policy)
    incident = crash_site.incident()
    assert incident.state is IncidentState.FAILED
    # the policy's 1 s, not the adapter's default of 30 s
    assert "WaitTimeout" in (incident.reason or "")
    assert "not done after 1 s" in (incident.reason or "")
