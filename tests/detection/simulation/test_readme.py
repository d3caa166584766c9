"""The README's quick start runs as written: its ``sdcguard train`` line, in a scratch directory.

What must hold: the command exits 0, and its report holds the one alarm the README promises
(the fingerprint vote, on the step of the flip, naming rank 2) — so a README that drifts from
the command line or the report contract fails here.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from detection.harness import main

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.slow]


def _quick_start_command() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "the quick start has no bash block"
    lines = [line for line in block.group(1).splitlines() if "sdcguard train" in line]
    assert len(lines) == 1, lines
    words = shlex.split(lines[0])
    return words[words.index("train") + 1 :]


def test_the_readme_quick_start_runs_and_reports_what_it_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(_quick_start_command()) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    [alarm] = report["alarms"]
    assert (alarm["layer"], alarm["step"], alarm["suspect_ranks"]) == ("fingerprint", 20, [2])
