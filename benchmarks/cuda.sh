#!/usr/bin/env bash
# The detection benchmarks' CUDA figures, in one run on a machine with a GPU (`make bench-cuda`):
#
#   tests        the tests that need a GPU (tests/detection/weights/test_device_graph.py: the CUDA-graph
#                replays against the definition), with pytest;
#   llama        the guard on a model that fills the GPU: a Llama-style decoder of ~370M
#                parameters, sequence 2,048, bf16 autocast, AdamW, world size 1 (NCCL); plain vs
#                the default (checksums every 8 steps per layer) vs full checksums, the ratios
#                with 95 % intervals, the ms added a step, and the host synchronisations and
#                launches a step from the profiler (benchmarks/cuda_llama.py; within 8 minutes);
#   syncs        host synchronisations a guarded step adds, counted with the profiler
#                (benchmarks/cuda_syncs.py, world size 1, NCCL);
#   launches     where a guarded step's host time goes: step times, kernel launches and each
#                detection function's host and device time (benchmarks/cuda_launches.py);
#   overhead-1   guarded / plain DDP step time, world size 1 (NCCL), both models;
#   fingerprint  the weight fingerprint and the per-step statistics pass against torch.sum, on
#                the GPU, every fingerprint checked against the CPU's (benchmarks/fingerprint.py);
#   overhead-2   the same with two ranks sharing the GPU over gloo (the collectives stage
#                through the host, so it says what the guard adds when every all-gather is
#                slow, not what NCCL on two GPUs costs).
#
# Usage: benchmarks/cuda.sh [OUTDIR]. Each part writes OUTDIR/<part>.txt and runs under its own
# time limit; a part that fails does not stop the next one, and the exit status says whether
# all of them passed. It needs the repository's root on PYTHONPATH (set here) and a torch with
# CUDA; nothing is installed.
set -u
out=${1:-bench-cuda}
py=${PYTHON:-python3}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# gradient audits switch deterministic kernels on; cuBLAS needs this before the process starts
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
failed=()

part() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s)"
    local started=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    cat "$out/$name.txt"
    echo "== $name: exit $rc after $((SECONDS - started)) s"
    [ "$rc" -eq 0 ] || failed+=("$name")
}

part env 60 "$py" -c '
import os, torch
print("torch", torch.__version__, "CUDA", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
print("host CPUs", os.cpu_count(), "load", os.getloadavg()[0])
'
# --noconftest: the suite's conftest reaches for the control plane (Prefect), which a GPU image
# need not have; these tests need only torch
part tests "${TESTS_LIMIT:-180}" "$py" -m pytest --noconftest -q -p no:cacheprovider -o addopts= \
    tests/detection/weights/test_device_graph.py
# its own wall-clock budget ends the timed rounds at 360 s, leaving the profiled steps and the
# close inside the part's limit
part llama "${LLAMA_LIMIT:-480}" "$py" benchmarks/cuda_llama.py --budget-s "${LLAMA_BUDGET:-360}"
part syncs "${SYNCS_LIMIT:-240}" "$py" benchmarks/cuda_syncs.py --steps 20
part launches "${LAUNCHES_LIMIT:-240}" "$py" benchmarks/cuda_launches.py --rounds 30 --steps 5
part overhead-1 "${OVERHEAD1_LIMIT:-300}" "$py" benchmarks/overhead.py --device cuda \
    --world-size 1 --rounds "${ROUNDS:-200}" --small-rounds "${SMALL_ROUNDS:-400}"
part fingerprint "${FINGERPRINT_LIMIT:-240}" "$py" benchmarks/fingerprint.py --device cuda
part overhead-2 "${OVERHEAD2_LIMIT:-300}" "$py" benchmarks/overhead.py --device cuda \
    --world-size 2 --rounds "${ROUNDS:-200}" --small-rounds "${SMALL_ROUNDS:-400}"

if [ "${#failed[@]}" -ne 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "all parts passed"
