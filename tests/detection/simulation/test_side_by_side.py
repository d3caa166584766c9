"""``benchmarks/side_by_side.py``: another version's guard, imported under another name, runs in
the same rank processes as this one's, each beside a plain DDP replica.

What must hold: the copy imports none of this checkout's modules (every ``detection`` import
rewritten), and a short run of this checkout against itself prints both guards' ratios.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _script() -> ModuleType:
    """The script as the module ``side_by_side`` (the name its spawned ranks import it by)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    return importlib.import_module("side_by_side")


def test_the_copy_imports_only_itself(tmp_path: Path) -> None:
    copied = _script().copy_as_base(ROOT, tmp_path)
    assert (copied / "guard" / "sdcguard.py").exists()
    for path in copied.rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import) detection\b(?!_base)", text, re.M), path


def test_this_checkout_against_itself_prints_both_ratios(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        sys, "argv", ["side_by_side.py", "--base", str(ROOT), "--steps", "70", "--defer"]
    )
    _script().main()
    line = capfd.readouterr().out.strip().splitlines()[-1]
    found = re.search(r"this (\d+\.\d+), base (\d+\.\d+)", line)
    assert found is not None, line
    assert all(0.5 < float(ratio) < 5.0 for ratio in found.groups())
