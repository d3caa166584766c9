"""Approval by a human in the real Prefect UI, in a real browser.

A ``prefect server start`` with its UI, the incident flow paused for approval on it, and Debian's
chromium driven by Playwright the way an approver works: open the UI at the server's root, go to
Runs, open the incident's run, Resume, read the evidence, fill in the form Prefect renders from
:class:`flows.approval.ApprovalDecision`, submit. Nothing else answers the form, so the incident
ending ``resolved`` with the approver and reason typed in the browser proves that the UI's form
reached the flow and the ledger.

The site is the flow tests' (``tests/flows/test_incident.py``): a SQLite ledger, a simulated
cluster, local processes as the training job, packaged telemetry, HyperPod on moto over HTTP and
the replay nodes reduced to their answers (node-2 computes something else from step 33 on).

Screenshots of the filled-in form and of the finished run are kept in ``artifacts/ui-approval/``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Locator, Page, expect
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL, temporary_settings

from db import IncidentState
from flows.approval import ApprovalChoice, artifact_key, flow_run_name
from flows.policy import IncidentPolicy
from tests.e2e.conftest import UI_TIMEOUT_MS, IncidentFlowThread, PrefectUI
from tests.flows.test_incident import FAULTY, Site

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# A human decides: no auto-approval, and far more time to answer than the test needs.
BY_HAND = IncidentPolicy(auto_approve=False, approval_timeout_s=600, task_retries=2)
APPROVER = "carol.approver@example.com"
REASON = "replay on the spares names node-2 from step 33: replace it"


def _form_label(schema: dict[str, Any], field: str) -> str:
    """The label Prefect's form shows for ``field``: its JSON-schema title, or — for a field
    that refers to a definition, as an enum does — the definition's title."""
    prop = schema["properties"][field]
    if "title" in prop:
        return str(prop["title"])
    definition = prop["$ref"].rsplit("/", 1)[-1]
    return str(schema["$defs"][definition]["title"])


def _form_field(dialog: Locator, schema: dict[str, Any], field: str) -> Locator:
    """The control of ``field`` in the form: the element its ``<label for=…>`` names, as the
    browser associates the two (a select's own aria-label hides the label from role queries)."""
    label = dialog.locator("label").filter(
        has_text=re.compile(rf"^\s*{re.escape(_form_label(schema, field))}\s*$")
    )
    control_id = label.get_attribute("for", timeout=UI_TIMEOUT_MS)
    assert control_id, f"the label of {field!r} names no control"
    return dialog.locator(f"[id='{control_id}']")


def _open_paused_run(page: Page, ui: PrefectUI, incident_id: str) -> None:
    """From the UI's front page to the incident's run, through the runs list."""
    page.goto(ui.root_url + "/")
    page.get_by_role("link", name="Runs", exact=True).click()
    page.get_by_role("link", name=flow_run_name(incident_id), exact=True).click()


def test_an_approver_resolves_the_incident_through_the_prefect_ui_form(
    site: Site,
    prefect_ui: PrefectUI,
    incident_flow: IncidentFlowThread,
    ui_page: Page,
    ui_artifacts: Path,
) -> None:
    page = ui_page
    incident_flow.start(BY_HAND)
    paused = incident_flow.wait_until_paused(timeout_s=180)
    assert site.incident().state is IncidentState.AWAITING_APPROVAL

    _open_paused_run(page, prefect_ui, site.incident_id)
    expect(page).to_have_url(re.compile(rf"/runs/flow-run/{paused.id}\b"), timeout=UI_TIMEOUT_MS)
    expect(page.get_by_text("Paused", exact=True).first).to_be_visible(timeout=UI_TIMEOUT_MS)

    # The run's actions menu: Resume opens the form rendered from the run's input schema.
    page.get_by_role("button", name="Open menu", exact=True).click()
    page.get_by_role("menuitem", name="Resume", exact=True).click()
    dialog = page.get_by_role("dialog", name="Resume Flow Run")
    expect(dialog).to_be_visible(timeout=UI_TIMEOUT_MS)
    # the evidence the approver decides on is on the form itself
    evidence_title = f"Incident {site.incident_id} — approval needed"
    expect(dialog.get_by_role("heading", name=evidence_title)).to_be_visible(timeout=UI_TIMEOUT_MS)
    expect(dialog).to_contain_text(f"hardware on {FAULTY}", timeout=UI_TIMEOUT_MS)

    decision = _form_field(dialog, paused.form_schema, "decision")
    # no decision is preselected: the approver must choose
    expect(decision).not_to_contain_text(ApprovalChoice.APPROVE.value, timeout=UI_TIMEOUT_MS)
    decision.click()
    page.get_by_role("option", name=ApprovalChoice.APPROVE.value, exact=True).click()
    expect(decision).to_contain_text(ApprovalChoice.APPROVE.value, timeout=UI_TIMEOUT_MS)
    _form_field(dialog, paused.form_schema, "approver").fill(APPROVER)
    reason = _form_field(dialog, paused.form_schema, "reason")
    reason.fill(REASON)
    reason.scroll_into_view_if_needed()
    page.screenshot(path=str(ui_artifacts / "approval-form.png"))

    dialog.get_by_role("button", name="Resume", exact=True).click()
    expect(page.get_by_text("Flow run resumed")).to_be_visible(timeout=UI_TIMEOUT_MS)
    expect(dialog).to_be_hidden(timeout=UI_TIMEOUT_MS)

    summary = incident_flow.join(timeout_s=120)
    incident = site.incident()
    assert incident.state is IncidentState.RESOLVED, incident.reason
    assert (incident.decision, incident.approver, incident.approval_reason) == (
        ApprovalChoice.APPROVE.value,
        APPROVER,
        REASON,
    )
    assert summary["approval"]["approver"] == APPROVER
    assert [r["node"] for r in summary["replaced"]] == [FAULTY]

    with (
        temporary_settings(updates={PREFECT_API_URL: prefect_ui.api_url}),
        get_client(sync_client=True) as client,
    ):
        run = client.read_flow_run(paused.id)
    assert run.state is not None
    assert run.state.is_completed(), run.state

    # The run's page now: completed, with the incident report the flow published after the
    # approval. (Task runs are not checked here: they reach a server through Prefect's events
    # worker, a per-process singleton that may still point at another test's server.)
    page.reload()
    expect(page.get_by_text("Completed", exact=True).first).to_be_visible(timeout=UI_TIMEOUT_MS)
    page.get_by_role("tab", name="Artifacts", exact=True).click()
    report_key = artifact_key(site.incident_id, "report")
    expect(page.get_by_text(report_key).first).to_be_visible(timeout=UI_TIMEOUT_MS)
    page.screenshot(path=str(ui_artifacts / "run-completed.png"), full_page=True)
