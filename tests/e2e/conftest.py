"""Fixtures of the browser tests: Debian's chromium driven by Playwright, a real Prefect server
with its UI, and a local site with one incident to approve.

The browser is the system's ``/usr/bin/chromium``, never a Playwright download. When it is
missing, ``scripts/ensure-chromium.sh`` installs it once per session, at collection (root only).
Without root the browser tests are skipped with the reason — unless
``SDCGUARD_REQUIRE_BROWSER=1`` (CI), where a missing browser is a failure.

Screenshots go to ``artifacts/ui-approval/`` at the repository root (git-ignored) and are kept:
the filled-in form and the final run page on success, the page as it was on failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from playwright.sync_api import Browser, Page, sync_playwright
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.input.run_input import keyset_from_paused_state
from prefect.settings import PREFECT_API_URL, temporary_settings

from db import Ledger
from flows.approval import ApprovalChoice, ApprovalDecision, flow_run_name, submit_decision
from flows.incident import incident_response
from flows.policy import IncidentPolicy
from flows.prefect_server import local_prefect_server
from flows.wiring import use_backends
from recovery.aws_local import LocalAws, start_local_aws
from recovery.jobs import JobKind, JobRef
from tests.flows.test_incident import JOB, Site, build_site

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
ENSURE_CHROMIUM = REPO / "scripts" / "ensure-chromium.sh"
REQUIRE_BROWSER_ENV = "SDCGUARD_REQUIRE_BROWSER"
UI_ARTIFACTS = REPO / "artifacts" / "ui-approval"

# Headless and quiet: no sandbox (root in a container), no GPU, and no traffic of its own —
# the only thing this browser may reach is the Prefect server on loopback.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Every Playwright wait in these tests is bounded by this (milliseconds). Two shared cores and a
# Prefect server answering the UI make tens of seconds possible, never minutes.
UI_TIMEOUT_MS = 30_000


@dataclass(frozen=True)
class PrefectUI:
    """A running ``prefect server start``: its API (for the client) and its UI (for the browser)."""

    api_url: str
    home: Path

    @property
    def root_url(self) -> str:
        """The UI is served at the server's root, beside ``/api``."""
        return self.api_url.removesuffix("/api")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    """Keep each phase's report on the item, so the page fixture knows if the test failed."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"_report_{report.when}", report)


_INSTALL_LOG = pytest.StashKey[str]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Install chromium once, before any test runs, when a collected test needs it and it is
    missing: before the per-test timeouts start, so a slow mirror cannot eat a test's time."""
    needs_browser = any(
        "chromium_executable" in getattr(item, "fixturenames", ()) for item in items
    )
    if not needs_browser or CHROMIUM.exists() or os.geteuid() != 0:
        return
    try:
        done = subprocess.run(
            ["bash", str(ENSURE_CHROMIUM)],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        config.stash[_INSTALL_LOG] = f"timed out after {err.timeout:g} s"
        return
    config.stash[_INSTALL_LOG] = f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="session")
def chromium_executable(pytestconfig: pytest.Config) -> Path:
    """Debian's chromium, installed by ``scripts/ensure-chromium.sh`` at collection if missing."""
    if CHROMIUM.exists():
        return CHROMIUM
    script = ENSURE_CHROMIUM.relative_to(REPO)
    if os.geteuid() != 0:
        message = (
            f"{CHROMIUM} is missing and installing it needs root: run `sudo {script}` "
            "(or apt-get install chromium)"
        )
        if os.environ.get(REQUIRE_BROWSER_ENV) == "1":
            pytest.fail(f"{REQUIRE_BROWSER_ENV}=1 but {message}")
        pytest.skip(message)
    log = pytestconfig.stash.get(_INSTALL_LOG, "it was not run")
    pytest.fail(f"{CHROMIUM} is missing; {script} did not install it: {log}")


@pytest.fixture
def chromium_browser(chromium_executable: Path) -> Iterator[Browser]:
    """A headless chromium for one test; closed, with Playwright's driver, afterwards."""
    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(
            executable_path=str(chromium_executable),
            headless=True,
            args=CHROMIUM_ARGS,
            timeout=UI_TIMEOUT_MS,
        )
        try:
            yield instance
        finally:
            instance.close()


@pytest.fixture
def ui_artifacts() -> Path:
    """``artifacts/ui-approval/``, emptied of an earlier run's screenshots."""
    shutil.rmtree(UI_ARTIFACTS, ignore_errors=True)
    UI_ARTIFACTS.mkdir(parents=True)
    return UI_ARTIFACTS


@pytest.fixture
def ui_page(
    chromium_browser: Browser, ui_artifacts: Path, request: pytest.FixtureRequest
) -> Iterator[Page]:
    """A page with bounded waits; when the test fails, its last view is saved as
    ``failure.png`` beside the other screenshots."""
    context = chromium_browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(UI_TIMEOUT_MS)
    context.set_default_navigation_timeout(UI_TIMEOUT_MS)
    try:
        page = context.new_page()
        yield page
        report = getattr(request.node, "_report_call", None)
        if report is None or report.failed:
            page.screenshot(path=str(ui_artifacts / "failure.png"), full_page=True)
    finally:
        context.close()


@pytest.fixture
def prefect_ui(tmp_path: Path) -> Iterator[PrefectUI]:
    """A real ``prefect server start`` with its UI, private to the test (own PREFECT_HOME).

    Not the session's ``prefect_api`` harness: that one serves no UI.
    """
    home = tmp_path / "prefect-server"
    with local_prefect_server(home) as api_url:
        yield PrefectUI(api_url=api_url, home=home)


@pytest.fixture
def local_aws() -> Iterator[LocalAws]:
    """SageMaker HyperPod served by moto over HTTP on loopback."""
    with start_local_aws() as aws:
        yield aws


@pytest.fixture
def site(tmp_path: Path, sqlite_ledger: Ledger, local_aws: LocalAws) -> Iterator[Site]:
    """The flow tests' site: node-2 went bad at step 37, one incident open, local backends."""
    built = build_site(tmp_path, sqlite_ledger, local_aws)
    try:
        yield built
    finally:
        built.jobs.stop(JobRef(JOB, kind=JobKind.LOCAL))


@dataclass(frozen=True)
class PausedRun:
    """The incident's flow run, paused for approval, with the form the UI renders from."""

    id: UUID
    form_schema: dict[str, Any]
    """The JSON schema of the form as saved on the run: what the UI builds its fields from."""


class IncidentFlowThread:
    """``incident_response`` for one incident in a background thread, on one Prefect API.

    Prefect's settings context and our injected backends are entered inside the thread: the
    settings context does not follow a new thread, and the session may have another Prefect API
    active in the main one.
    """

    def __init__(self, site: Site, api_url: str) -> None:
        self.site = site
        self.api_url = api_url
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, policy: IncidentPolicy) -> None:
        assert self._thread is None, "the flow was started already"
        self._thread = threading.Thread(
            target=self._run, args=(policy,), name="incident-flow", daemon=True
        )
        self._thread.start()

    def _run(self, policy: IncidentPolicy) -> None:
        try:
            with (
                temporary_settings(updates={PREFECT_API_URL: self.api_url}),
                use_backends(self.site.backends),
            ):
                self.result = incident_response(self.site.incident_id, policy)
        except BaseException as err:  # handed to the test's thread by join()
            self.error = err

    def wait_until_paused(self, timeout_s: float, poll_s: float = 0.5) -> PausedRun:
        """Block until the run is paused and its form (schema and description) is saved.

        The run pauses first and saves its form just after; a UI opened in between would find
        no form to render.
        """
        name = flow_run_name(self.site.incident_id)
        deadline = time.monotonic() + timeout_s
        with (
            temporary_settings(updates={PREFECT_API_URL: self.api_url}),
            get_client(sync_client=True) as client,
        ):
            while True:
                if self._thread is not None and not self._thread.is_alive():
                    raise AssertionError(
                        f"the flow ended before pausing: {self.error!r}"
                    ) from self.error
                runs = client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name]))
                )
                for run in runs:
                    if run.state is None or not run.state.is_paused():
                        continue
                    keyset = keyset_from_paused_state(run.state)
                    saved = {
                        part: client.filter_flow_run_input(
                            run.id, key_prefix=keyset[part], limit=1, exclude_keys=set()
                        )
                        for part in ("schema", "description")
                    }
                    if all(saved.values()):
                        return PausedRun(run.id, json.loads(saved["schema"][0].value))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no paused flow run {name} within {timeout_s:g} s")
                time.sleep(poll_s)

    def join(self, timeout_s: float) -> dict[str, Any]:
        """The flow's result; its exception re-raised; a ``TimeoutError`` if it is still on."""
        assert self._thread is not None, "the flow was never started"
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the incident flow still runs after {timeout_s:g} s")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def stop(self, timeout_s: float) -> None:
        """Answer a still-paused run with a reject, through the API, and wait for the thread.

        A test that failed before approving leaves the run paused for the policy's whole
        timeout, holding the injected backends: this ends it the way an approver would.
        """
        if not self.running:
            return
        decision = ApprovalDecision(
            decision=ApprovalChoice.REJECT,
            approver="e2e-teardown",
            reason="the test ended before the form was answered",
        )
        try:
            with temporary_settings(updates={PREFECT_API_URL: self.api_url}):
                submit_decision(self.site.incident_id, decision, timeout_s=timeout_s)
        finally:
            assert self._thread is not None
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"the incident flow still runs {timeout_s:g} s after a reject")


@pytest.fixture
def incident_flow(
    site: Site, prefect_ui: PrefectUI, monkeypatch: pytest.MonkeyPatch
) -> Iterator[IncidentFlowThread]:
    """The site's incident flow on the test's Prefect server, started by the test.

    The paused run checks for an answer every second, so the approval form's answer is taken
    up promptly. Stopped (rejected) before the server goes if the test left it paused.
    """
    monkeypatch.setenv("SDCGUARD_FLOW_APPROVAL_POLL_S", "1")
    flow = IncidentFlowThread(site, prefect_ui.api_url)
    try:
        yield flow
    finally:
        flow.stop(timeout_s=60)
