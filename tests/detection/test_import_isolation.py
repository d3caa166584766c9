"""detection ships in training images: every module must import with torch, httpx and the
stdlib alone. A fresh interpreter refuses our other packages and the service stack, then imports
every module that pkgutil finds in the package, so modules added later are covered too; each
one first (the package's modules unloaded before it), as a script that imports only it would."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

REFUSED = [
    "prefect",
    "boto3",
    "botocore",
    "kubernetes",
    "sqlalchemy",
    "alembic",
    "fastapi",
    "pydantic",
    "moto",
    "db",
    "recovery",
    "flows",
]

SCRIPT = textwrap.dedent(
    """
    import importlib, importlib.abc, json, pkgutil, sys

    REFUSED = set(json.loads(sys.argv[1]))
    attempts = []

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in REFUSED:
                attempts.append(name)
                raise ModuleNotFoundError(f"{name} is not in a training image", name=name)
            return None

    sys.meta_path.insert(0, Refuse())
    import detection

    modules = ["detection"] + sorted(
        info.name for info in pkgutil.walk_packages(detection.__path__, "detection.")
    )
    failed = {}
    for name in modules:
        # Each module first, as a script importing it alone would: an import cycle that only
        # works in one order shows here.
        for loaded_name in [m for m in sys.modules if m.split(".")[0] == "detection"]:
            del sys.modules[loaded_name]
        try:
            importlib.import_module(name)
        except Exception as err:
            failed[name] = f"{type(err).__name__}: {err}"
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in REFUSED)
    print(json.dumps({"modules": modules, "failed": failed, "loaded": loaded,
                      "attempts": sorted(set(attempts))}))
    """
)


def test_every_detection_module_imports_with_torch_httpx_and_the_stdlib_only() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(REFUSED)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["failed"] == {}, report["attempts"]
    assert report["loaded"] == []
    modules = set(report["modules"])
    assert {
        "detection.weights.fingerprint",
        "detection.transport.sender",
        "detection.identity",
    } <= modules
    assert {"detection.transport.signing"} <= modules
