"""detection.native: the C kernels against the definitions they replace, bit for bit, and the
torch path wherever they cannot run."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from detection import native
from detection.audit.calibration import check_agreement
from detection.native import build as native_build
from detection.stepcheck.allreduce import CHUNK, WIDE_MAX, chunked_sum, native_chunk
from detection.stepcheck.gradstats import LocalGradStats
from detection.weights import fingerprint_kernels as fk
from detection.weights.fingerprint import fingerprint_from_tensor, fingerprint_on_device
from detection.weights.fingerprint_kernels import Kernel
from detection.weights.optstate import StateFlag
from detection.weights.plan import FingerprintPlan
from tests.detection.weights.test_fingerprint import random_bits, reference

LANES = 16
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    kernel, enabled = fk.get_kernel(), native.is_enabled()
    yield
    fk.set_kernel(kernel)
    native.set_enabled(enabled)


def _tree(lanes: np.ndarray) -> np.ndarray:
    """Lanes (last axis, 16) combined as the C file's tree: (j, j + 8), (j, j + 4), ..."""
    while lanes.shape[-1] > 1:
        half = lanes.shape[-1] // 2
        lanes = lanes[..., :half] + lanes[..., half:]
    return lanes[..., 0]


def _per_lane(x: np.ndarray, dtype: type[np.floating]) -> np.ndarray:
    """Each lane's elements (i % 16) added in index order, in ``dtype``."""
    return np.array(
        [np.add.accumulate(x[j::LANES], dtype=dtype)[-1] if j < x.size else 0 for j in range(16)],
        dtype=dtype,
    )


def _lane_model(x: np.ndarray, chunk: int) -> tuple[float, float, float]:
    """The C kernel's order of operations, in numpy: what makes its result the same on every
    CPU whatever vector width the compiler chose."""
    f32, f64 = np.float32, np.float64
    if chunk == 0:
        total = float(_tree(_per_lane(x, f64)))
    else:
        head = x.size - x.size % chunk
        blocks = x[:head].reshape(-1, chunk // LANES, LANES)
        acc = blocks[:, 0, :].copy()
        for k in range(1, chunk // LANES):
            acc = acc + blocks[:, k, :]  # float32, one rounding per add
        total = 0.0
        for s in _tree(acc):
            total = float(f64(total) + f64(s))
        tail = f32(0.0)
        for v in x[head:]:
            tail = f32(tail + v)
        total = float(f64(total) + f64(tail))
    squares = (x * x).astype(f32)
    norm = float(np.sqrt(f32(_tree(_per_lane(squares, f32)))))
    peak = float(np.max(np.abs(x))) if x.size else 0.0
    return total, norm, peak


@pytest.mark.parametrize("numel", [1, 15, 64, 1000, WIDE_MAX, WIDE_MAX + 1, 100_003])
def test_the_bucket_statistics_follow_the_documented_lane_order_bit_for_bit(numel: int) -> None:
    gen = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=gen) * torch.exp(3 * torch.randn(numel, generator=gen))
    chunk = native_chunk(numel)
    total, norm, peak = native.stats_f32(x, chunk).tolist()
    want = _lane_model(x.numpy(), chunk)
    assert (total, norm, peak) == want
    assert native.sum_f32(x, chunk).item() == total
    # and the statistics themselves: the norm within float32 rounding, the peak exact
    assert norm == pytest.approx(float(torch.linalg.vector_norm(x.double())), rel=1e-5)
    assert peak == float(x.abs().max())


@pytest.mark.parametrize("numel", [1_000, 200_003])
def test_a_sum_through_the_kernel_stays_within_the_bound_the_reduction_check_charges(
    numel: int,
) -> None:
    """chunked_sum takes the kernel here: against the exact sum, within gamma(C - 1) times the
    absolute sum (float64 outright for a small bucket, far below it)."""
    gen = torch.Generator().manual_seed(numel)
    bucket = torch.randn(numel, generator=gen) * torch.exp(4 * torch.randn(numel, generator=gen))
    values = bucket.tolist()
    exact, absolute = math.fsum(values), math.fsum(abs(v) for v in values)
    got = chunked_sum(bucket).item()
    assert got == native.sum_f32(bucket, native_chunk(numel)).item()
    u = 2.0**-24
    assert abs(got - exact) <= (CHUNK - 1) * u / (1 - (CHUNK - 1) * u) * absolute
    native.set_enabled(False)
    torch_sum = chunked_sum(bucket).item()
    assert abs(torch_sum - exact) <= (CHUNK - 1) * u / (1 - (CHUNK - 1) * u) * absolute


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("numel", [100, 70_001])
def test_a_non_finite_element_makes_the_sum_non_finite_and_nan_the_peak(
    value: float, numel: int
) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    x[numel // 3] = value
    total, _, peak = native.stats_f32(x, native_chunk(numel)).tolist()
    assert not math.isfinite(total)
    assert math.isnan(peak) if math.isnan(value) else peak == math.inf


def test_local_statistics_on_the_kernel_match_the_torch_ops() -> None:
    """LocalGradStats takes the kernel for a float32 bucket: the same sum as chunked_sum's, the
    norm and the peak as torch computes them (within float32 rounding for the norm)."""
    x = torch.randn(300_001, generator=torch.Generator().manual_seed(8))
    fast = LocalGradStats(torch.device("cpu"))
    fast.on_local(0, x)
    native.set_enabled(False)
    slow = LocalGradStats(torch.device("cpu"))
    slow.on_local(0, x)
    a, b = fast.row().tolist(), slow.row().tolist()
    assert a[0] == b[0] == 1.0  # one bucket
    assert a[1] == pytest.approx(b[1], rel=1e-6, abs=1e-3)  # the sums: two summation orders
    assert a[2] == pytest.approx(b[2], rel=1e-5)
    assert a[3] == b[3]


FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", FLOATS)
def test_the_non_finite_kernel_flags_exactly_nan_and_infinities(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    big = torch.finfo(dtype).max
    tensors = [torch.randn(n, generator=gen).to(dtype) for n in (3, 17, 1000, 4099)]
    tensors[2][7] = big
    tensors[2][8] = -big
    tensors[1][0] = -0.0
    codes = [native.nonfinite_kind(t) for t in tensors]
    assert None not in codes
    clean = native.PointerList(tensors, [c for c in codes if c is not None])
    assert native.nonfinite(clean) is False  # the largest finite values are finite
    for which, at in ((0, 2), (3, 4098), (3, 0), (2, 500)):
        for value in (math.nan, math.inf, -math.inf):
            before = tensors[which][at].clone()
            tensors[which][at] = value
            assert native.nonfinite(clean) is True, (which, at, value)
            tensors[which][at] = before
    assert native.nonfinite(clean) is False


def test_the_state_flag_takes_one_native_call_and_follows_the_state() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    flag = StateFlag(opt, list(model.parameters()), torch.device("cpu"))
    assert flag().tolist() == [0]
    assert flag._native is not None  # the kernel's list, not the torch sums
    opt.state[model[2].weight]["exp_avg_sq"][1, 3] = math.inf
    assert flag().tolist() == [1]
    opt.state[model[2].weight]["exp_avg_sq"][1, 3] = 0.5
    assert flag().tolist() == [0]
    native.set_enabled(False)  # the torch path: the same verdicts
    torch_flag = StateFlag(opt, list(model.parameters()), torch.device("cpu"))
    assert torch_flag().tolist() == [0]
    assert torch_flag._native is None
    opt.state[model[0].bias]["exp_avg"][0] = math.nan
    assert torch_flag().tolist() == [1]


def _mixed(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        random_bits((1001,), torch.float32, gen),
        random_bits((7, 3), torch.bfloat16, gen),
        random_bits((33,), torch.uint8, gen),
        random_bits((17,), torch.float64, gen),
        random_bits((5,), torch.float16, gen),
        random_bits((0,), torch.float32, gen),
        random_bits((9,), torch.int64, gen),
    ]


def test_the_native_fingerprint_is_the_definition_for_every_word_size() -> None:
    tensors = _mixed(11)
    fk.set_kernel(Kernel.NATIVE)
    got = fingerprint_from_tensor(fingerprint_on_device(tensors, start=12_345))
    offsets, at = [], 12_345
    for t in tensors:
        offsets.append(at)
        at += t.numel()
    assert got == reference(tensors, offsets)
    # scattered offsets (DDP buckets at their parameters' global places), a non-contiguous view
    strided = torch.arange(40, dtype=torch.float32).reshape(5, 8)[:, ::3]
    scattered = [tensors[0], strided]
    got = fingerprint_from_tensor(fingerprint_on_device(scattered, offsets=[2**40, 7]))
    assert got == reference(scattered, [2**40, 7])


def test_a_plan_under_auto_runs_the_native_kernel_and_follows_its_tensors() -> None:
    """On a CPU with the kernels, ``auto`` takes them whatever the list's size: no table, no
    compiled layout; in-place updates and a replaced tensor both show."""
    fk.set_kernel(Kernel.AUTO)
    tensors = _mixed(12)
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += t.numel()
    layouts = set(fk.FUSED_STATE.layouts)
    plan = FingerprintPlan(tensors)
    assert fingerprint_from_tensor(plan()) == reference(tensors, offsets)
    assert plan._native is not None
    assert plan._words is None
    assert plan._ordered is None
    assert fk.FUSED_STATE.layouts == layouts
    tensors[0][999] += 1.0
    assert fingerprint_from_tensor(plan()) == reference(tensors, offsets)
    tensors[3] = tensors[3].clone()  # a new storage: the plan rebuilds
    tensors[3][2] = 1.5
    plan.tensors[3] = tensors[3]
    assert fingerprint_from_tensor(plan()) == reference(tensors, offsets)
    # switched off later, the kernels stop new callers, not a plan already built on them
    native.set_enabled(False)
    tensors[0][5] = 0.25
    assert fingerprint_from_tensor(plan()) == reference(tensors, offsets)
    assert plan._native is not None


def test_ranks_that_disagree_on_the_kernels_are_told_how_to_fix_it() -> None:
    problems = check_agreement([{"native_kernels": True}, {"native_kernels": False}])
    assert len(problems) == 1
    assert "SDCGUARD_NATIVE=0" in problems[0]
    assert check_agreement([{"native_kernels": True}, {"native_kernels": True}]) == []


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "detection.native"],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_without_a_compiler_the_kernels_are_unavailable_and_say_why(tmp_path: Path) -> None:
    done = _probe({"CC": "false", "SDCGUARD_CACHE_DIR": str(tmp_path), "TMPDIR": str(tmp_path)})
    assert done.returncode == 1
    assert "unavailable" in done.stdout
    assert "false" in done.stdout
    assert "native CPU kernels unavailable" in done.stderr  # the warning, once


def test_switched_off_the_kernels_are_unavailable(tmp_path: Path) -> None:
    done = _probe({"SDCGUARD_NATIVE": "0", "SDCGUARD_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 1
    assert "switched off" in done.stdout
    assert not list(tmp_path.iterdir())  # nothing built


def test_a_fresh_cache_builds_the_library_once(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {"SDCGUARD_CACHE_DIR": str(tmp_path), "TMPDIR": str(scratch)}
    first = _probe(env)
    assert first.returncode == 0, first.stderr
    built = sorted((tmp_path / "native").iterdir())
    assert len(built) == 1
    assert built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    again = _probe(env)
    assert again.returncode == 0
    assert sorted((tmp_path / "native").iterdir()) == built
    assert built[0].stat().st_mtime_ns == stamp
    assert not list(scratch.iterdir())  # nothing in the fallback


def test_an_unwritable_cache_falls_back_to_the_temporary_directory(tmp_path: Path) -> None:
    """A read-only home (a locked-down container): the library goes to the temporary
    directory instead, and the kernels run."""
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = _probe({"SDCGUARD_CACHE_DIR": str(blocked), "TMPDIR": str(scratch)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "available"
    assert len(list(scratch.glob("sdcguard-*/native/kernels-*.so"))) == 1


def test_auto_leaves_a_large_list_to_the_compiled_kernel_when_torch_runs_threads() -> None:
    """The C kernel is one thread: with several intra-op threads a list the compiled kernel
    takes stays there; a small list, or one thread, takes the C kernel."""
    fk.set_kernel(Kernel.AUTO)
    large = [torch.zeros(fk.FUSED_MIN_ELEMENTS)]
    small = [torch.zeros(1000)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert not fk.use_native(large)
        assert fk.use_native(small)
        torch.set_num_threads(1)
        assert fk.use_native(large)
    finally:
        torch.set_num_threads(threads)
    native.set_enabled(False)
    assert not fk.use_native(small)


@pytest.mark.parametrize("capability", ["AVX2", "AVX512"])
def test_a_large_plan_takes_the_table_where_64_bit_multiplies_are_emulated(
    capability: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``auto`` a plan of a million words or more takes the compiled table on a CPU
    without 64-bit vector multiplies (AVX2: the C kernel's three emulated multiplications a
    word cost more than the table's load), the C kernel where they are native (AVX-512); a
    short list takes the C kernel on both."""
    fk.set_kernel(Kernel.AUTO)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # with more, a large list goes to the compiled kernel anyway
    try:
        large = FingerprintPlan([torch.zeros(fk.FUSED_MIN_ELEMENTS), torch.zeros(7)])
        large._build(large._signature())
        small = FingerprintPlan([torch.zeros(1000)])
        small._build(small._signature())
    finally:
        torch.set_num_threads(threads)
    assert small._native is not None
    if capability == "AVX2":
        assert large._native is None
        assert large._ordered is not None  # the compiled table's multipliers, in list order
    else:
        assert large._native is not None


def test_the_portable_build_computes_the_same_bits_as_this_cpus(tmp_path: Path) -> None:
    """The kernels have two shapes — 16-lane vectors where the CPU has 64-byte registers
    (AVX-512), 8-lane halves elsewhere (AVX2, NEON, or no ``-march=native``) — and a bucket's
    sums must be the same bits on both, as ranks on different CPUs compare them. The library
    built for this CPU against one built without ``-march=native`` (the baseline instruction
    set: the halves), on sums of every length and chunking, non-finite elements included; and
    the integer kernels (state flag, fingerprint) likewise."""
    import ctypes

    assert native.available(), native.unavailable_reason()
    portable = tmp_path / "portable.so"
    command = [
        *native_build._compiler(),
        *native_build._FLAGS,
        str(native_build._SOURCE),
        "-o",
        str(portable),
    ]
    subprocess.run([*command, "-lm"], check=True, capture_output=True, timeout=120)
    other = native_build._declare(ctypes.CDLL(str(portable)))
    here = native_build.library()
    gen = torch.Generator().manual_seed(4)
    for numel in (1, 15, 16, 17, 1000, WIDE_MAX + 1, 70_001):
        x = torch.randn(numel, generator=gen) * torch.exp(3 * torch.randn(numel, generator=gen))
        if numel > 100:
            x[numel // 3] = math.inf if numel % 2 else math.nan
        for chunk in {0, native_chunk(numel), 64}:
            outs = []
            for lib in (here, other):
                out = torch.zeros(3, dtype=torch.float64)
                lib.sdc_stats_f32(x.data_ptr(), numel, chunk, 3, out.data_ptr())
                outs.append(out.view(torch.int64).tolist())
            assert outs[0] == outs[1], (numel, chunk)
        pointers = native.PointerList([x], [native.nonfinite_kind(x) or 0])
        flags = [
            lib.sdc_nonfinite(pointers.count, pointers.ptrs, pointers.numels, pointers.codes)
            for lib in (here, other)
        ]
        assert flags[0] == flags[1] == int(not bool(torch.isfinite(x).all()))
        words = native.PointerList([x], [4], [numel])
        prints = []
        for lib in (here, other):
            out = torch.zeros(2, dtype=torch.int64)
            lib.sdc_fingerprint(
                1, words.ptrs, words.numels, words.codes, words.offsets, out.data_ptr()
            )
            prints.append(out.tolist())
        assert prints[0] == prints[1] == native.fingerprint(words).tolist()
