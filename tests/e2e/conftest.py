"""Fixtures of the browser tests: Debian's chromium driven by Playwright, with bounded waits and
screenshots (the command under test starts its own Prefect server with its UI).

The browser is the system's ``/usr/bin/chromium``, never a Playwright download. When it is
missing, ``scripts/ensure-chromium.sh`` installs it once per session, at collection (root only).
Without root the browser tests are skipped with the reason — unless
``SDCGUARD_REQUIRE_BROWSER=1`` (CI), where a missing browser is a failure.

Screenshots go to ``artifacts/ui-approval/`` at the repository root (git-ignored) and are kept:
the filled-in form on success, the page as it was on failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

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
