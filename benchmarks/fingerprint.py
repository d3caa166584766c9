"""Weight fingerprint speed next to ``torch.sum`` over the same float32 parameters.

Run: ``.venv/bin/python benchmarks/fingerprint.py`` (about a minute on two cores, most of it
compiling). For 2.7M (the overhead benchmark's model), 10M and 100M elements, held as a list
of parameter-sized tensors like a transformer's, it measures side by side in one process,
interleaved repeat by repeat:

* ``torch.sum``: one ``torch.sum`` per tensor, stacked and summed: the bandwidth reference;
* ``fused``: :func:`detection.weights.fingerprint.fingerprint_on_device` with the fused kernel;
* ``eager``: the same with the eager kernel (the fallback without a compiler);
* ``native``: the same with :mod:`detection.native`'s C kernel (CPU only; what ``auto`` takes
  on a CPU where it builds), its ratio to ``torch.sum`` printed next to the fused one's;
* ``plan``: the per-step :class:`~detection.weights.plan.FingerprintPlan` a guard keeps for its
  weights, under ``fused``: up to 4M elements on a CPU without a native 64-bit vector multiply
  (AVX2) it compiles a pass that reads each word's multiplier from a table it holds (one 64-bit
  multiplication a word instead of three); above that, and on AVX-512, it is ``fused``;
* ``naive``: the reference formula, every tensor widened to int64 at once.

It prints medians, the ratio fused / torch.sum against the 1.5 target (and the ratio of the
fastest runs, which is what an idle machine shows), the compile time (paid once per layout)
and checks that every method returns the same fingerprint.

A second table times the per-step layer's statistics pass
(:class:`detection.stepcheck.gradstats.LocalGradStats`: the local bucket's sum, L2 norm and peak,
then the
reduced bucket's sum) over the same elements cut into DDP's default 25 MB buckets, against one
``torch.sum`` per bucket.

``--device cuda`` runs both on the GPU (the fused kernel is then Triton's). A timed repeat
there is ``--inner`` back-to-back calls closed by one device synchronisation, divided by
``--inner``, so launches overlap as they do in a training step; every fingerprint is also
checked against the eager kernel's on the CPU copy of the same tensors.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from detection import native
from detection.stepcheck.gradstats import LocalGradStats
from detection.weights import fingerprint as fp
from detection.weights import fingerprint_kernels as fk
from detection.weights.plan import FingerprintPlan

TARGET = 1.5
BUCKET_ELEMENTS = 25 * 1024 * 1024 // 4  # DDP's default bucket_cap_mb=25, float32


def model_like(total: int, seed: int = 0) -> list[torch.Tensor]:
    """Embedding, then blocks of attention and MLP weights with biases and norm vectors, until
    ``total`` elements; the last tensor is trimmed so the count is exact (and not round)."""
    gen = torch.Generator().manual_seed(seed)
    d = 256 if total < 5_000_000 else 512 if total <= 20_000_000 else 1024
    block = [(3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d)]
    block += [(d,), (d,), (d,)]
    shapes: list[tuple[int, ...]] = []
    count = 0
    for shape in itertools.chain([(8192, d)], itertools.cycle(block)):
        n = math.prod(shape)
        if count + n >= total:
            shapes.append(shape if count + n == total else (total - count,))
            break
        shapes.append(shape)
        count += n
    return [torch.randn(shape, generator=gen) for shape in shapes]


def naive(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The definition written directly: full-size int64 copies, one per tensor."""
    device = tensors[0].device
    a = torch.zeros((), dtype=torch.int64, device=device)
    b = torch.zeros((), dtype=torch.int64, device=device)
    offset = 0
    for t in tensors:
        w = t.reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        n = w.numel()
        idx = torch.arange(offset, offset + n, dtype=torch.int64, device=device)
        a = a + w.sum()
        b = b + (w * fk.multipliers(idx)).sum()
        offset += n
    return torch.stack([a, b])


def sum_all(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.sum(t) for t in tensors]).sum()


def with_kernel(kernel: fk.Kernel) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    def run(tensors: list[torch.Tensor]) -> torch.Tensor:
        fk.set_kernel(kernel)
        return fp.fingerprint_on_device(tensors)

    return run


def with_plan(tensors: list[torch.Tensor]) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    fk.set_kernel(fk.Kernel.FUSED)
    plan = FingerprintPlan(tensors)

    def run(_: list[torch.Tensor]) -> torch.Tensor:
        fk.set_kernel(fk.Kernel.FUSED)
        return plan()

    return run


def bucket_sums(buckets: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.sum(b) for b in buckets])


def stats_pass(buckets: list[torch.Tensor]) -> torch.Tensor:
    """What the comm hook adds per bucket: statistics of the local bucket before all-reduce and
    the sum of the reduced one after (the same tensor here: the arithmetic is what is timed)."""
    stats = LocalGradStats(buckets[0].device)
    for key, bucket in enumerate(buckets):
        stats.on_local(key, bucket)
        stats.on_reduced(key, bucket)
    return stats.row()


def timer(device: torch.device, inner: int) -> Callable[[Callable[[], object]], float]:
    """Seconds per call: ``inner`` calls, then a wait for the device, divided by ``inner``."""

    def timed(call: Callable[[], object]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / inner

    return timed


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2700000,10000000,100000000")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--naive-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: default)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--inner", type=int, default=0, help="calls per repeat (0: 1 CPU, 20 GPU)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    timed = timer(device, args.inner or (20 if cuda else 1))
    where = (
        f"GPU: {torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}; host "
        if cuda
        else "CPU: "
    )
    print(
        f"{where}{cpu_name()} ({os.cpu_count()} logical CPUs); torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads; medians of {args.repeats} repeats "
        f"({args.naive_repeats} for naive), interleaved; load average before: "
        f"{os.getloadavg()[0]:.2f}"
    )
    rows = []
    stats_rows = []
    for total in (int(s) for s in args.sizes.split(",")):
        host = model_like(total)
        params = [t.to(device) for t in host]
        methods: dict[str, Callable[[list[torch.Tensor]], torch.Tensor]] = {
            "sum": sum_all,
            "fused": with_kernel(fk.Kernel.FUSED),
            "eager": with_kernel(fk.Kernel.EAGER),
            "plan": with_plan(params),
            "naive": naive,
        }
        if not cuda and native.available():
            methods["native"] = with_kernel(fk.Kernel.NATIVE)
        start = time.perf_counter()
        results = {name: fn(params) for name, fn in methods.items()}
        if cuda:
            torch.cuda.synchronize(device)
        compile_s = time.perf_counter() - start
        checked = tuple(n for n in ("fused", "eager", "plan", "naive", "native") if n in methods)
        prints = {n: fp.fingerprint_from_tensor(results[n]) for n in checked}
        if cuda:  # the device's integer arithmetic against the CPU's, on the same words
            fk.set_kernel(fk.Kernel.EAGER)
            prints["cpu eager"] = fp.fingerprint_from_tensor(fp.fingerprint_on_device(host))
        if len(set(prints.values())) != 1:
            raise SystemExit(f"fingerprints disagree at {total}: {prints}")
        del host
        times: dict[str, list[float]] = {name: [] for name in methods}
        for rep in range(args.repeats):
            for name, fn in methods.items():
                if name == "naive" and rep >= args.naive_repeats:
                    continue
                times[name].append(timed(functools.partial(fn, params)))
        med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
        best = min(times["fused"]) / min(times["sum"])
        rows.append((total, len(params), med, best, compile_s))

        buckets = list(torch.cat([t.reshape(-1) for t in params]).split(BUCKET_ELEMENTS))
        stats_pass(buckets)  # warm-up
        pair: dict[str, list[float]] = {"sum": [], "stats": []}
        for _ in range(args.repeats):
            pair["sum"].append(timed(functools.partial(bucket_sums, buckets)))
            pair["stats"].append(timed(functools.partial(stats_pass, buckets)))
        stats_med = {k: statistics.median(v) * 1e3 for k, v in pair.items()}
        stats_rows.append((total, len(buckets), stats_med))
    fk.set_kernel(fk.Kernel.AUTO)

    header = (
        f"{'elements':>11} {'tensors':>7} {'torch.sum ms':>12} {'fused ms':>9} "
        f"{'ratio':>6} {'target':>6} {'best':>5} {'eager ms':>9} {'plan ms':>8} {'naive ms':>9} "
        f"{'first call s':>12} {'native ms':>9} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    for total, count, med, best, compile_s in rows:
        ratio = med["fused"] / med["sum"]
        print(
            f"{total:>11,} {count:>7} {med['sum']:>12.3f} {med['fused']:>9.3f} "
            f"{ratio:>6.2f} {TARGET:>6.1f} {best:>5.2f} {med['eager']:>9.3f} {med['plan']:>8.3f} "
            f"{med['naive']:>9.3f} {compile_s:>12.1f}"
            + (
                f" {med['native']:>9.3f} {med['native'] / med['sum']:>6.2f}"
                if "native" in med
                else f" {'-':>9} {'-':>6}"
            )
        )
    checked_against = " and the CPU's eager kernel" if cuda else ""
    print(
        "ratio = median fused / median torch.sum; best = fastest fused / fastest torch.sum.\n"
        f"Every method returned the same fingerprint{checked_against}; 'first call' includes "
        "compiling the layout."
    )
    print()
    header = f"{'elements':>11} {'buckets':>7} {'torch.sum ms':>12} {'stats ms':>9} {'ratio':>6}"
    print("statistics pass of the per-step layer, per step, over 25 MB buckets")
    print(header)
    print("-" * len(header))
    for total, count, med in stats_rows:
        print(
            f"{total:>11,} {count:>7} {med['sum']:>12.3f} {med['stats']:>9.3f} "
            f"{med['stats'] / med['sum']:>6.2f}"
        )
    print(
        "stats = local sum, L2 norm and peak of each bucket, then the reduced bucket's sum; "
        "torch.sum = one sum per bucket.\n"
        f"Load average after: {os.getloadavg()[0]:.2f} (other processes share these cores)."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
