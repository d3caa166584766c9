"""``benchmarks/cuda_llama.py``, the real-size GPU benchmark of ``make bench-cuda``, at its toy
size on the CPU: the script builds the Llama-style decoder (RMSNorm, rotary positions, SwiGLU,
bf16 autocast), trains the three replicas side by side under DDP and prints every row, and the
guarded replicas (the default budget and full checksums) raise no alarm on clean steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_real_size_benchmark_runs_at_a_toy_size_on_the_cpu() -> None:
    argv = ["--tiny", "--cpu", "--rounds", "1", "--block", "1", "--warmup", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cuda_llama.py"), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "Llama-style decoder" in out
    assert "alarms: 0" in out
    rows = {line.split()[0] for line in out.splitlines() if line.split()}
    assert {"plain", "default", "full"} <= rows
