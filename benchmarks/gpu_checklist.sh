#!/usr/bin/env bash
# The checks that need a GPU, in stages that each fit one 10-minute command on a lent GPU machine
# (python3 with torch + CUDA, triton, pytest; no ipywidgets or nbval: those tests skip).
# Run from the repository root, one stage per call:
#
#   bash benchmarks/gpu_checklist.sh tests    # versions; kernel tests from a cold Triton cache
#                                             # (timed: the goal is < 2 min); unit tests with the
#                                             # CUDA-only ones (GPU spans vs torch.profiler); the
#                                             # worker modes on one GPU over NCCL
#   bash benchmarks/gpu_checklist.sh step     # benchmarks/bench_gpu_step.py (the GPU table, Dion eager and
#                                             # under its CudaGraphOptimizer, the first-step table)
#   bash benchmarks/gpu_checklist.sh triton   # benchmarks/bench_newton_schulz_triton.py
#
# Dion's rows need benchmarks/_peers/dion, which is gitignored and which the GPU machine cannot fetch
# (no mirror there): run `PYTHONPATH=. python benchmarks/bench_peers.py --fetch-only` here first, and
# name benchmarks/_peers in the device call's carry list; without it the rows are skipped with a line
# saying so.
#
# Logs and results go to $OUT (the device tool's folder that comes back; ./gpu_out elsewhere), a
# few files per stage. A stage goes on past a failing step, so one call shows everything.
set -uo pipefail
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONPATH=$PWD
PY=${PY:-python3}

timed() {  # timed NAME SECONDS CMD...: the command's output and its wall time in $out/NAME.log
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc, $((SECONDS - t0)) s: $*" | tee -a "$out/$name.log" >>"$out/summary.txt"
}

case ${1:-} in
tests)
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    } >"$out/summary.txt" 2>&1
    # kernels first, on a cold cache: their wall time is the cold-start figure
    rm -rf ~/.triton/cache
    timed kernels 300 $PY -m pytest -q -p no:cacheprovider -rs --durations=15 tests/kernels
    timed unit 240 $PY -m pytest -q -p no:cacheprovider -rs -s tests/unit
    timed workers 120 $PY -m pytest -q -p no:cacheprovider -rs tests/distributed/test_workers_cuda.py \
        tests/distributed/test_device.py
    ;;
step)
    timed step 570 $PY benchmarks/bench_gpu_step.py --repeats 8
    cp benchmarks/results/gpu_step.md "$out/"
    ;;
triton)
    timed triton 570 $PY benchmarks/bench_newton_schulz_triton.py
    cp benchmarks/results/newton_schulz_triton.md "$out/"
    ;;
*)
    echo "usage: bash benchmarks/gpu_checklist.sh tests|step|triton" >&2
    exit 2
    ;;
esac
cat "$out/summary.txt"
