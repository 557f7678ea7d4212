#!/usr/bin/env bash
# Everything that needs a GPU, in phases that each fit one 10-minute device call, results packed
# into one archive (the device tool returns at most 8 files):
#
#   bash benchmarks/gpu_session.sh tests      # build minengine._C, kernel tests (triton + cuda), pytest -m gpu, memcheck
#   bash benchmarks/gpu_session.sh kernels    # bench_attention's cases a-e (with --triton-variants), ncu
#   bash benchmarks/gpu_session.sh grid       # bench_attention's backend x shape grid, auto's tuning table
#   bash benchmarks/gpu_session.sh engine     # bench_decode (roofline, idle), bench_offline, bench_host_step, bench_sampler, bench_structured, bench_frontend
#   bash benchmarks/gpu_session.sh serving GROUP...    # run_ablations.sh groups: backends | overlap chunk | delayer
#   bash benchmarks/gpu_session.sh disagg     # bench_disagg.py (router, decode radix cache off/on)
#
# Each phase runs its steps in order of importance within GPU_PHASE_SECONDS (default 520: the device
# tool stops a call at 600 s, or sooner when less device time is left, so set it from `status`).
# A step gets what is left of that budget and is stopped (with its child processes) when it runs
# out; a step that would start with under 30 s left is skipped. The archive is rewritten after every
# step, so a phase cut short still returns what it finished, and logs/steps.txt says what ran, for
# how long, and what was stopped or skipped.
#
# A session gets about 30 minutes of device time, start-up included: three phases at most. The
# first (an H100, 2026-11-23) ran tests (311 s), kernels (237 s, cut short by a bug since fixed) and
# engine (541 s); a fresh machine started in under 30 s. Next: kernels (--triton-variants times
# each of our backends in both block orders, heavy-first against in-order, then stop 41's tile
# parameters beside stop 42's unmeasured ones on cases a-d, after all the cases' own rows, so the
# time limit cuts those first; the cuda columns and ncu time stop 43's CUDA tile
# changes, and their fp64 error columns are the first check of them on a GPU), then within the
# machine's 30 s idle window `serving backends` (FlashInfer's JIT cache is still there), `serving
# overlap chunk` (about 450 s: a server start is about 45 s, and chunk's 100 prompts, 20 of them
# 8k tokens long, arrive over 50 s), `serving delayer`, grid (the tuning table), the rest of
# engine, disagg; tests again when a session has the time (the CUDA kernels changed since they
# passed). A group's run cut off by the budget is lost whole (bench_serving writes at its end).
# Our kernels' first GPU runs go through benchmarks/canary.py first (bench_attention, ncu_kernels.sh,
# run_ablations.sh's servers, and pytest's conftest): one that faults, hangs or is wrong is left
# out with the reason, instead of a sticky CUDA error or a hang taking the rest of the phase with it.
# Carry the `base` wheels for tests (it deselects FlashInfer's tests: their JIT compiles would take
# minutes of the phase) and the `flashinfer` ones for kernels and serving. GPU_SKIP="NAME ..."
# skips steps already measured (the rest of engine: GPU_SKIP=bench_decode).
#
# The GPU machine is offline: `bash benchmarks/gpu_wheels.sh [base|flashinfer|disagg]` puts the
# wheels its image lacks in .whl/ (the server stack, pyzmq, openai; FlashInfer; NIXL for disagg),
# and each device call names .whl in `carry`. Its image has pybind11, ninja, nvidia-ml-py. For the
# kernels, grid and serving phases, `python3 benchmarks/flashinfer_aot.py` (after the `flashinfer`
# wheels) compiles FlashInfer's modules for the bench's baselines here into .flashinfer_aot/; carry
# it too, and the warm-ups load them instead of spending minutes of device time compiling.
set -uo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:?phase: tests | kernels | grid | engine | serving | disagg}
shift
case $PHASE in
  tests | kernels | grid | engine | serving | disagg) ;;
  *) echo "unknown phase $PHASE; allowed: tests kernels grid engine serving disagg"; exit 2 ;;
esac
if [ "$PHASE" = serving ] && [ $# -eq 0 ]; then  # (before any install or build: a typo costs nothing)
  echo "serving needs its groups, about what fits one call: 'backends' (FlashInfer's JIT warm-up, then"
  echo "3 servers, ~400 s), 'overlap chunk' (5 servers, ~450 s), 'delayer' (2 servers, ~150 s); each"
  echo "group also runs our kernels' canary for its servers' backends first (a child process each, unmeasured)"
  exit 2
fi
DEST=${OUT:-benchmarks/results}
BUDGET=${GPU_PHASE_SECONDS:-520}
START=$SECONDS
WORK=$(mktemp -d)
mkdir -p "$DEST" "$WORK/results" "$WORK/logs"

left() { echo $((BUDGET - (SECONDS - START))); }
# written aside, then renamed: a stop during tar leaves the last complete archive, not a torn one
pack() { tar czf "$DEST/.gpu_${PHASE}.tgz.part" -C "$WORK" results logs && mv -f "$DEST/.gpu_${PHASE}.tgz.part" "$DEST/gpu_${PHASE}.tgz"; }

# step NAME CMD...: CMD with the rest of the budget, output to logs/NAME.log (its tail echoed).
step() {
  local name=$1 budget begin rc
  shift
  case " ${GPU_SKIP:-} " in  # steps already measured: GPU_SKIP="bench_decode ..."
    *" $name "*) echo "$name: skipped (GPU_SKIP)" | tee -a "$WORK/logs/steps.txt"; return 0 ;;
  esac
  budget=$(left)
  if [ "$budget" -lt 30 ]; then
    echo "$name: skipped, ${budget} s of the phase budget left" | tee -a "$WORK/logs/steps.txt"
    return 0
  fi
  echo "== $name (at most ${budget} s): $*"
  begin=$SECONDS
  # SIGTERM to the step's whole process group at the budget, SIGKILL 20 s later
  timeout -k 20 "$budget" "$@" > "$WORK/logs/$name.log" 2>&1
  rc=$?
  local verdict="exit $rc"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="STOPPED by its time limit"
  echo "$name: $verdict after $((SECONDS - begin)) s" | tee -a "$WORK/logs/steps.txt"
  tail -n 15 "$WORK/logs/$name.log"
  pack
  return 0
}

if ls .whl/*.whl >/dev/null 2>&1; then
  rm -rf /tmp/site  # (a warm machine keeps an earlier call's wheels there: this call gets exactly its own)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
# FlashInfer's modules compiled ahead on the CPU machine (benchmarks/flashinfer_aot.py), when carried:
# the warm-ups load them instead of compiling (installed only where versions and target match)
if [ -e .flashinfer_aot/manifest.json ]; then
  timeout -k 10 120 python3 benchmarks/flashinfer_aot.py --install .flashinfer_aot 2>&1 | tee -a "$WORK/logs/steps.txt"
fi
# a hung test fails alone instead of eating the phase (pytest-timeout is in the box's image; without
# it, an unknown ini key is only a warning)
PYTEST_TIMEOUT="-o timeout=240"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,driver_version --format=csv > "$WORK/logs/gpu.csv"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$WORK/logs/gpu.csv"
# why an installed FlashInfer would not import (a missing dependency), in the log, not as silently skipped rows
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" >> "$WORK/logs/gpu.csv" 2>&1
# the box is Hopper: only the 9.0a target (about half the nvcc time of the default 8.0;9.0a); no nvcc: an error
step build env MINENGINE_BUILD_CUDA=1 MINENGINE_CUDA_ARCHS=9.0a python3 setup.py build_ext --inplace
python3 -c "import minengine._C" 2>&1 | tee -a "$WORK/logs/steps.txt" && echo "minengine._C imports" | tee -a "$WORK/logs/steps.txt"

case $PHASE in
  tests)
    KERNEL_TESTS="tests/test_paged_attention.py tests/test_store_kv.py tests/test_gather_input_ids.py"
    KERNEL_TESTS="$KERNEL_TESTS tests/test_cuda_kernels.py tests/test_backend_logits.py"
    # every param of the kernel tests (triton and the real cuda kernels), then the other GPU tests;
    # a module that cannot be collected (a missing wheel) is reported, not fatal
    # shellcheck disable=SC2086
    # FlashInfer's tests are deselected (the serving phase runs them: their JIT compiles would take
    # minutes of this one, if its wheels are there)
    step pytest_kernels python3 -m pytest -q $PYTEST_TIMEOUT -k "not flashinfer" $KERNEL_TESTS
    ignore=$(for f in $KERNEL_TESTS; do printf -- "--ignore=%s " "$f"; done)
    # shellcheck disable=SC2086
    step pytest_gpu python3 -m pytest -q $PYTEST_TIMEOUT -m gpu -k "not flashinfer" \
      --continue-on-collection-errors tests $ignore
    step memcheck bash profiles/memcheck.sh
    ;;
  kernels)
    # FlashInfer's JIT modules for the cases first, compiled together (at most 240 s: baselines not
    # built by then are left out); the cases start nothing in the phase's last 150 s (ncu's), and
    # SIGTERM ends the one running, so the report holds what it measured
    cases_budget=$(($(left) - 150))
    [ "$cases_budget" -lt 30 ] && cases_budget=30  # (timeout 0 would mean no limit)
    step bench_attention timeout -s TERM $cases_budget python3 benchmarks/bench_attention.py \
      --triton-variants --flashinfer-warmup 240 --out "$WORK/results"
    # the backends bench_attention's canary runs left out (none: an empty list), for ncu to skip;
    # no report with a canary (the step stopped before it): ncu's script runs the canary itself
    unset NCU_SKIP  # (not the caller's)
    if skip=$(python3 -c "import json, sys; r = json.load(open(sys.argv[1])); c = r['canary']
print(' '.join(b for b, why in c.items() if why != 'ok'))" "$WORK"/results/attention_*.json 2>/dev/null); then
      export NCU_SKIP=$skip
    fi
    step ncu bash profiles/ncu_kernels.sh
    cp profiles/out/ncu_*.txt profiles/out/ncu_summary.md profiles/out/canary.json "$WORK/logs/" 2>/dev/null
    ;;
  grid)
    # the 96 configs (4 shapes x pages 16, 64, 1 x bf16, fp16 x 4 kinds) with triton and the cuda
    # kernels, FlashInfer on the targets' configs only (its JIT compiles, cached on disk, are few):
    # a call of its own, since in the kernels phase the grid got the 100-150 s its cases and
    # FlashInfer's warm-up left. Page 16 first, every tuning key before qwen3-0.6b repeats D 128's
    step bench_grid python3 benchmarks/bench_attention.py --suite full --cases "" --write-tuning \
      --flashinfer-grid target --flashinfer-warmup 200 --time-budget $(($(left) - 30)) --out "$WORK/results"
    # moved, not copied: left in the tree, it would turn `auto` into its per-shape mix in every later
    # phase on this machine (bench_decode, the ablations' servers), unlike the runs it is compared with
    mv minengine/ops/tuning/*.json "$WORK/results/" 2>/dev/null
    pack
    ;;
  engine)
    # the issue's decode targets first (roofline, idle time); offline throughput last, against
    # transformers on qwen3-0.6b only: on the first H100 run that baseline took 217 s, and the
    # llama3-8b one did not finish in the 128 s the phase had left (run it in a call of its own:
    # python3 benchmarks/bench_offline.py --model llama3-8b)
    step bench_decode python3 benchmarks/bench_decode.py --out "$WORK/results"
    step bench_host_step python3 benchmarks/bench_host_step.py --repeats 3 --out "$WORK/results"
    step bench_sampler python3 benchmarks/bench_sampler.py --out "$WORK/results"
    step bench_structured python3 benchmarks/bench_structured.py --out "$WORK/results"
    step bench_frontend python3 benchmarks/bench_frontend.py --out "$WORK/results"
    step bench_offline python3 benchmarks/bench_offline.py --hf-model qwen3-0.6b --out "$WORK/results"
    ;;
  serving)
    fi_tests=0
    case " $* " in
      *" backends "* | *" backends-eager "*)
        # its JIT modules for the served model's shape (bf16, 32/8/128; decode and prefill wrappers,
        # cases a-c), compiled together, so that its server does not compile them one after another
        step flashinfer_jit python3 benchmarks/bench_attention.py --warmup-only --cases abc \
          --flashinfer-warmup 300 --out "$WORK/logs"
        fi_tests=1 ;;
    esac
    # the canary's verdicts (run_ablations.sh checks a server's kernels before starting it) kept for
    # the call's later groups, and packed with the logs; a benchmark stopped after 240 s (the
    # workloads' arrivals take 25-50 s), so a hung server leaves the group's later runs some time
    for group in "$@"; do
      step "ablations_$group" env RESULTS_DIR="$WORK/results" CANARY_DIR="$WORK/logs/canary" RUN_SECONDS=240 \
        bash benchmarks/run_ablations.sh "$group"
    done
    # FlashInfer inside the engine (the tests phase skips it), after the measurements: its tests use
    # other shapes (fp16, head dim 64) whose JIT modules, unless carried in .flashinfer_aot/, compile
    # one after another, minutes that would otherwise come out of the ablations' budget
    if [ $fi_tests -eq 1 ]; then
      # shellcheck disable=SC2086
      step pytest_flashinfer python3 -m pytest -q $PYTEST_TIMEOUT -m gpu -k flashinfer \
        tests/test_gpu_kernels.py tests/test_backend_logits.py tests/test_cuda_graph.py
    fi
    ;;
  disagg)
    step pytest_disagg python3 -m pytest -q $PYTEST_TIMEOUT -m gpu --continue-on-collection-errors tests/test_disagg.py
    step bench_disagg python3 benchmarks/bench_disagg.py --out "$WORK/results"
    ;;
esac
pack
echo "packed $DEST/gpu_${PHASE}.tgz ($(($SECONDS - START)) s)"
