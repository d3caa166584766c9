"""The layout of ``detection/`` holds what docs/ARCHITECTURE.md draws.

What must hold: no import cycle anywhere in the package (between rooms or inside one), and the
modules that leave the rank or that the control plane imports — the alarm transport, the
``sdcguard train`` argument spec, the fault spec — import no torch. The import contracts in
``pyproject.toml`` say the same for ``lint-imports``; these run with the tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import grimp

from detection.audit import AuditMode
from detection.simulation.config import AUDIT_MODES

ROOT = Path(__file__).resolve().parents[2]

TORCH_FREE = [
    "detection.transport",
    "detection.transport.alarm",
    "detection.transport.signing",
    "detection.transport.sender",
    "detection.external",
    "detection.external.alarm",
    "detection.external.delivery",
    "detection.external.megatron",
    "detection.external.torchtitan",
    "detection.simulation",
    "detection.simulation.config",
    "detection.simulation.train_args",
    "detection.faults",
    "detection.faults.spec",
    "detection.guard",
    "detection.guard.trace_mode",
]


def _cycles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), or a module that
    imports itself."""
    modules = sorted(m for m in graph.modules if m == package or m.startswith(package + "."))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for t in sorted(graph.find_modules_directly_imported_by(m)):
            if not t.startswith(package):
                continue
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in on_stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            component = []
            while True:
                t = stack.pop()
                on_stack.discard(t)
                component.append(t)
                if t == m:
                    break
            if len(component) > 1 or m in graph.find_modules_directly_imported_by(m):
                found.append(sorted(component))

    for m in modules:
        if m not in index:
            visit(m)
    return found


def test_detection_has_no_import_cycle() -> None:
    graph = grimp.build_graph("detection", cache_dir=None)
    assert _cycles(graph, "detection") == []


def test_the_cycle_finder_sees_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(m)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.a")
    graph.add_import(importer="p.c", imported="p.a")
    assert _cycles(graph, "p") == [["p.a", "p.b"]]


def test_the_transport_and_the_argument_spec_import_no_torch() -> None:
    script = textwrap.dedent(
        """
        import importlib, importlib.abc, json, sys

        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "numpy"):
                    raise ModuleNotFoundError(f"{name} is not in a control-plane image")
                return None

        sys.meta_path.insert(0, Refuse())
        failed = {}
        for name in json.loads(sys.argv[1]):
            try:
                module = importlib.import_module(name)
                if name not in ("detection.simulation", "detection.faults", "detection.guard"):
                    for attr in module.__all__:
                        getattr(module, attr)
            except Exception as err:
                failed[name] = f"{type(err).__name__}: {err}"
        print(json.dumps(failed))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(TORCH_FREE)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {}


def test_the_argument_spec_offers_every_audit_mode() -> None:
    assert tuple(m.value for m in AuditMode) == AUDIT_MODES
