#!/usr/bin/env bash
# Everything that needs a GPU, in one call of about 8 minutes on a lent GPU machine (python3 with
# torch + CUDA, triton, pytest, pytest-xdist; no Jupyter packages). From the repository root:
#
#   bash benchmarks/gpu_checklist.sh            # all stages below, in order
#   bash benchmarks/gpu_checklist.sh STAGE...   # only those (a rerun of what failed)
#
# Stages:
#   tests      the CUDA tests (kernels from a cold Triton cache, unit tests with the CUDA-only ones:
#              whole-step graph, host synchronisation, variants, offload; worker modes over NCCL), on
#              4 xdist workers; beside them, on the CPU cores, the notebooks under nbval (lax) when
#              the wheels of nbval, ipykernel and ipywidgets were carried in .whl/ (see below;
#              checked here with python3.11 wheels in a venv holding only the GPU image's packages:
#              they install with pip --target, nbval is found on PYTHONPATH and starts its kernels)
#   spans      GPU spans against torch.profiler (alone: other processes' kernels would inflate them)
#   step       benchmarks/bench_gpu_step.py per set: the step table (defaults, device decision,
#              whole step captured, plain/gram x torch/Triton, torch.optim.Muon, Dion eager and under
#              its CudaGraphOptimizer, peak memory) and the first step
#   host       benchmarks/bench_host_work.py --device cuda: Python calls and aten ops per step
#   plan       benchmarks/bench_plan_vs_run.py --device cuda: the cost model against the step's spans
#
# The device call carries benchmarks/_peers (Dion, gitignored; `bench_peers.py --fetch-only` here
# first), data/cache (the notebooks' corpus) and .whl (the notebooks' packages for python3.12:
# README "On a GPU" says how they are downloaded). Missing ones skip their rows with a line saying so.
#
# Everything comes back in two files under $OUT (./gpu_out elsewhere): summary.txt (versions, each
# stage's rc and seconds, the result tables) and logs.tar.gz (every log and report).
set -uo pipefail
out=${OUT:-gpu_out}
work=$(mktemp -d)
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1
PY=${PY:-python3}
summary=$out/summary.txt

timed() {  # timed NAME SECONDS CMD...: the command's output in $work/NAME.log, its rc and wall time in the summary
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$work/$name.log" 2>&1
    local rc=$?
    { echo "== $name: rc $rc, $((SECONDS - t0)) s: $*"; tail -n 4 "$work/$name.log" | sed 's/^/   | /'; } >>"$summary"
    # the archive after every stage: a call stopped at its limit still brings back what ran
    tar -czf "$out/logs.tar.gz" -C "$work" --exclude=site . 2>/dev/null
}

stage_tests() {
    local nb_pid=""
    if ls .whl/*.whl >/dev/null 2>&1; then
        if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" \
            .whl/*.whl >"$work/wheels.log" 2>&1; then
            export PYTHONPATH=$PYTHONPATH:$work/site  # the unit tests of the panels take ipywidgets from there too
            # the notebooks beside the CUDA tests, --nbval-lax: every cell must run, and the cells marked
            # NBVAL_CHECK_OUTPUT are compared (the stored outputs of the others were made on a CPU: device
            # names and Triton's availability differ on a GPU)
            CI=1 OMP_NUM_THREADS=2 timed notebooks 180 $PY -m pytest -q -p no:cacheprovider -n 6 --dist loadscope \
                --nbval-lax --nbval-kernel-startup-timeout 150 --nbval-sanitize-with notebooks/nbval_sanitize.cfg notebooks &
            nb_pid=$!
        else
            echo "== notebooks: the wheels in .whl/ did not install (wheels.log): not run" >>"$summary"
        fi
    else
        echo "== notebooks: no .whl/ carried (nbval, ipykernel, ipywidgets): not run" >>"$summary"
    fi
    rm -rf ~/.triton/cache
    timed cuda_tests 180 $PY -m pytest -q -p no:cacheprovider -n 4 -rs --durations=15 \
        tests/kernels tests/unit tests/distributed/test_workers_cuda.py tests/distributed/test_device.py \
        --ignore=tests/unit/test_gpu_spans.py
    [ -n "$nb_pid" ] && wait "$nb_pid"
}

stage_spans() {
    timed spans 45 $PY -m pytest -q -p no:cacheprovider -rs tests/unit/test_gpu_spans.py
}

stage_step() {
    timed step_gpt2 90 $PY benchmarks/bench_gpu_step.py --sets gpt2 --first-step-sets gpt2 --repeats 10 \
        --out "$work/gpu_step_gpt2.md"
    timed step_1b 120 $PY benchmarks/bench_gpu_step.py --sets 1b --first-step-sets 1b --repeats 6 \
        --out "$work/gpu_step_1b.md"
}

stage_host() {
    timed host 40 $PY benchmarks/bench_host_work.py --device cuda --world 1 --out "$work/host_work_cuda.md"
}

stage_plan() {
    if [ -f benchmarks/bench_plan_vs_run.py ]; then
        timed plan 60 $PY benchmarks/bench_plan_vs_run.py --device cuda --out "$work/plan_vs_run_cuda.md"
    else
        echo "== plan: benchmarks/bench_plan_vs_run.py is not in this tree: not run" >>"$summary"
    fi
}

{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nproc; } >"$summary" 2>&1
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests spans step host plan)
for s in "${stages[@]}"; do
    case $s in
    tests | spans | step | host | plan) "stage_$s" ;;
    *) echo "unknown stage '$s' (tests, spans, step, host, plan)" >&2; exit 2 ;;
    esac
done
# the result tables into the summary, everything into one archive
for f in "$work"/*.md; do [ -f "$f" ] && { echo; echo "### $(basename "$f")"; sed -n '/^|/p' "$f"; } >>"$summary"; done
tar -czf "$out/logs.tar.gz" -C "$work" --exclude=site .
cat "$summary"
