"""A newcomer approves in the Prefect UI exactly what ``sdcguard demo --approve-in-ui`` prints.

The demo runs as a subprocess from an environment with no ``PREFECT_*`` setting (and a home of
its own, so no profile either): it starts its one Prefect server, runs the incident flow on it
and prints the address of the paused run. Debian's chromium, driven by Playwright, opens that
address — nothing else — and answers the form the way an approver does: Resume, read the
evidence, choose approve, name the approver and the reason, and keep only one of the two
suspect nodes. Nothing else answers the form, so the demo ending exact with that approver and
that reason in the ledger, and only that node replaced, proves the address was the right one
and the UI's answer reached the flow.

The scenario is the demo's ``--transient``: a one-off upset of node-2's recomputation of node-1's
micro-batch at an audited step (node-2 audits node-1 in the ring of four). Training stays clean —
the per-step layer, armed from the first step, rightly raises nothing, and the faulty run's
weights are the reference's step for step — so the ring audit's one disagreeing pair is the
only evidence, and it names both nodes; the diagnostic run finds no mismatch on any node. The
approver reads that the training record checks out, so the wrong value was the auditor's
recomputation, and keeps node-2. Afterwards no process of the demo is left: not its Prefect
server, not a training process.

Screenshots (the filled-in form; the page as it was on failure) go to ``artifacts/ui-approval/``.
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from playwright.sync_api import Locator, Page, expect

from db import IncidentState, Ledger
from flows.incident.approval.form import ApprovalChoice, artifact_key
from recovery.local.cluster import LocalCluster
from tests.e2e.conftest import UI_TIMEOUT_MS
from tests.e2e.processes import CliProcess, cli_process, prefect_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

APPROVER = "carol.approver@example.com"
REASON = (
    "node-1's step reruns clean on every node and no per-step check fired: the wrong value was "
    "node-2's recomputation of node-1's batch: replace node-2"
)
APPROVED, NOT_APPROVED = "node-2", "node-1"
RUN_ADDRESS = re.compile(r"approve at (http://\S+/runs/flow-run/[0-9a-f-]{36})\s*$")
# The demo's own scale, shortened: the upset at step 10 (an audited step), 16 steps in all.
DEMO_ARGS = ["--approve-in-ui", "--transient", "--steps", "16", "--fault-step", "10"]


@pytest.fixture
def newcomer_demo(tmp_path: Path) -> Iterator[CliProcess]:
    args = ["demo", *DEMO_ARGS, "--report", str(tmp_path / "report.json")]
    with cli_process(args, tmp_path / "demo", tmp_path / "home") as demo:
        yield demo


def _weights_by_step(trace: Path) -> dict[int, str]:
    """A training trace's weight fingerprint after each step it ran."""
    rows = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    return {int(row["step"]): str(row["weight_fingerprint"]) for row in rows}


def _form_property(dialog: Locator, title: str) -> Locator:
    """One field of the form Prefect renders from the run's input schema, by its label."""
    return dialog.locator(
        "xpath=.//div[contains(concat(' ', @class, ' '), ' schema-form-property ')]"
        "[./div[contains(@class, 'p-label__header')]"
        f"//span[contains(@class, 'schema-form-property__label') and normalize-space()='{title}']]"
    )


def _node_items(dialog: Locator) -> Locator:
    return _form_property(dialog, "Nodes (Optional)").locator(".schema-form-property-array-item")


def _listed_nodes(dialog: Locator) -> list[str]:
    items = _node_items(dialog)
    return [items.nth(i).locator("textarea").input_value() for i in range(items.count())]


def _approve_only(page: Page, dialog: Locator, node: str) -> None:
    """Choose approve, sign, and remove every listed node but ``node`` from the form."""
    decision = _form_property(dialog, "Decision")
    choose_decision(page, decision, ApprovalChoice.APPROVE.value)
    _form_property(dialog, "Approver").locator("textarea").fill(APPROVER)
    _form_property(dialog, "Reason").locator("textarea").fill(REASON)
    for other in [n for n in _listed_nodes(dialog) if n != node]:
        row = _node_items(dialog).nth(_listed_nodes(dialog).index(other))
        row.get_by_role("button").first.click()  # the row's delete button
    expect(_node_items(dialog)).to_have_count(1, timeout=UI_TIMEOUT_MS)
    assert _listed_nodes(dialog) == [node]


def choose_decision(page: Page, decision: Locator, value: str) -> None:
    """Pick ``value`` in the decision select. The select opens its options on a click or on
    ArrowDown (and, closed, ArrowDown may pick the next option at once): whichever happens, the
    option is clicked once it shows, and the select must end showing ``value``."""
    control = decision.locator("button.p-select-button__control")
    shown = decision.locator(".p-select-button__value")
    option = page.get_by_text(value, exact=True)
    for attempt in range(2 * len(ApprovalChoice)):
        if shown.inner_text().strip() == value:
            return
        if attempt % 2 == 0:
            control.click()
        else:
            control.focus()
            page.keyboard.press("ArrowDown")
        page.wait_for_timeout(500)
        visible = [o for o in option.all() if o.is_visible()]
        if visible:
            visible[0].click()
            page.wait_for_timeout(300)
    raise AssertionError(f"the decision select never showed {value!r}")


def test_a_newcomer_approves_one_of_two_nodes_at_the_address_the_demo_prints(
    newcomer_demo: CliProcess, ui_page: Page, ui_artifacts: Path, tmp_path: Path
) -> None:
    demo, page = newcomer_demo, ui_page
    url = demo.wait_for_line(RUN_ADDRESS, timeout_s=900).group(1)
    servers = prefect_processes(demo.note_processes())
    assert servers, f"no Prefect server under the demo:\n{demo.output}"
    # the faulty job was running when its alarm came (the console wraps at its width)
    assert "while the job still runs" in " ".join(demo.output.split())

    page.goto(url)
    expect(page.get_by_text("Paused", exact=True).first).to_be_visible(timeout=UI_TIMEOUT_MS)
    page.get_by_role("button", name="Resume", exact=True).click()
    dialog = page.get_by_role("dialog").filter(has_text="Resume Flow Run")
    expect(dialog).to_be_visible(timeout=UI_TIMEOUT_MS)
    # the evidence the approver decides on is on the form: two suspects, nothing reproduced
    expect(dialog).to_contain_text("approval needed", timeout=UI_TIMEOUT_MS)
    expect(dialog).to_contain_text("no mismatch on any node", timeout=UI_TIMEOUT_MS)
    expect(_node_items(dialog)).to_have_count(2, timeout=UI_TIMEOUT_MS)  # rendered just after
    assert sorted(_listed_nodes(dialog)) == [NOT_APPROVED, APPROVED]
    # no decision is preselected: the approver must choose
    chosen = _form_property(dialog, "Decision").locator(".p-select-button__value")
    expect(chosen).to_have_text("", timeout=UI_TIMEOUT_MS)

    _approve_only(page, dialog, APPROVED)
    page.screenshot(path=str(ui_artifacts / "approval-form.png"))
    dialog.get_by_role("button", name="Submit", exact=True).click()
    expect(dialog).to_be_hidden(timeout=UI_TIMEOUT_MS)

    assert demo.wait(timeout_s=600) == 0, demo.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["recovered_fingerprint"] == report["reference_fingerprint"]
    # the ring audit alone saw it, as one pair: node-2 (rank 2) recomputed node-1's micro-batch
    assert [(a["layer"], a["suspect_nodes"]) for a in report["alarms"]] == [
        ("audit", [NOT_APPROVED, APPROVED])
    ]
    assert report["alarms"][0]["detail"]["mismatched_pairs"] == [{"auditor": 2, "audited": 1}]
    assert sorted(report["suspect_nodes"]) == [NOT_APPROVED, APPROVED]
    assert [r["node"] for r in report["replaced"]] == [APPROVED]
    assert report["approval"]["approver"] == APPROVER
    assert report["approval"]["reason"] == REASON
    # the stop stage found the faulty job running and stopped it; its process group is gone
    assert report["stop"]["running_at_alarm"] is True
    assert report["stop"]["result"] == "stopped", report["stop"]
    assert report["stop"]["pid_alive"] is False
    assert not psutil.pid_exists(report["stop"]["pid"])
    assert report["stopped_after_step"] == min(a["step"] for a in report["alarms"])

    run_dir = demo.workdir / "run"
    # training itself stayed clean: the faulty run's weights are the reference's at every step
    assert _weights_by_step(run_dir / "demo-job.trace.jsonl") == {
        step: fp
        for step, fp in _weights_by_step(run_dir / "reference.trace.jsonl").items()
        if step <= report["stopped_after_step"]
    }
    with Ledger.from_url(f"sqlite:///{run_dir / 'ledger.db'}") as ledger:
        incident = ledger.get_incident(report["incident_id"])
    assert incident.state is IncidentState.RESOLVED, incident.reason
    assert (incident.decision, incident.approver, incident.approval_reason) == (
        ApprovalChoice.APPROVE.value,
        APPROVER,
        REASON,
    )
    assert (incident.evidence or {})["approval"]["nodes"] == [APPROVED]
    cluster = LocalCluster(run_dir / "cluster.json")
    assert not cluster.node(NOT_APPROVED).unschedulable  # not approved: back to work
    assert APPROVED not in {n.name for n in cluster.nodes()}

    # The run and the report it published are on the demo's server: its own database, read
    # now that the server is stopped.
    with sqlite3.connect(demo.workdir / "prefect" / "prefect.db") as db:
        run_id = url.rsplit("/", 1)[-1]
        (state,) = db.execute("SELECT state_type FROM flow_run WHERE id = ?", (run_id,)).fetchone()
        keys = {k for (k,) in db.execute("SELECT key FROM artifact WHERE key IS NOT NULL")}
    assert state == "COMPLETED"
    assert artifact_key(report["incident_id"], "report") in keys

    assert demo.left_behind() == [], "processes of the demo outlived it"
    assert not any(p.is_running() for p in servers)
