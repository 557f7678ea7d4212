#!/usr/bin/env bash
# Everything that needs a GPU, in phases that each fit one 10-minute device call, results packed
# into one archive (the device tool returns at most 8 files):
#
#   bash benchmarks/gpu_session.sh tests      # build minengine._C, pytest -m gpu, memcheck
#   bash benchmarks/gpu_session.sh kernels    # bench_attention (core + full grid, auto's tuning table), ncu
#   bash benchmarks/gpu_session.sh engine     # bench_decode (roofline, idle), bench_offline
#   bash benchmarks/gpu_session.sh serving    # run_ablations.sh (chunk budget, delayer, overlap)
#   bash benchmarks/gpu_session.sh disagg     # bench_disagg.py (router, decode radix cache off/on)
#
# The GPU machine is offline: carry wheels in .whl/ (see the device README) for what its image
# lacks: pybind11 and ninja (to build _C), openai and httpx (server tests), nvidia-ml-py (clocks),
# and optionally flashinfer-python 0.5.3 + apache-tvm-ffi + nvidia-cudnn-frontend. The disagg phase
# needs nixl and nixl-cu13 (cp312, about 56 MB: carry them in a call of their own).
set -uo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:?phase: tests | kernels | engine | serving | disagg}
DEST=${OUT:-benchmarks/results}
WORK=$(mktemp -d)
mkdir -p "$DEST" "$WORK/results" "$WORK/logs"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,driver_version --format=csv > "$WORK/logs/gpu.csv"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$WORK/logs/gpu.csv"
python3 setup.py build_ext --inplace > "$WORK/logs/build.log" 2>&1 || echo "build of minengine._C failed (see build.log)"

case $PHASE in
  tests)
    python3 -m pytest -q -m gpu tests 2>&1 | tee "$WORK/logs/pytest_gpu.log" | tail -20
    python3 -m pytest -q tests/test_cuda_kernels.py 2>&1 | tee "$WORK/logs/pytest_cuda_kernels.log" | tail -5
    bash profiles/memcheck.sh > "$WORK/logs/memcheck.log" 2>&1; echo "memcheck exit $?"
    ;;
  kernels)
    python3 benchmarks/bench_attention.py --suite full --write-tuning --out "$WORK/results" 2>&1 | tail -40
    cp minengine/ops/tuning/*.json "$WORK/results/" 2>/dev/null  # commit it back to minengine/ops/tuning/
    bash profiles/ncu_kernels.sh > "$WORK/logs/ncu.log" 2>&1 && cp profiles/out/ncu_*.txt "$WORK/logs/"
    ;;
  engine)
    python3 benchmarks/bench_decode.py --out "$WORK/results" 2>&1 | tail -20
    python3 benchmarks/bench_offline.py --out "$WORK/results" 2>&1 | tail -12
    ;;
  serving)
    bash benchmarks/run_ablations.sh > "$WORK/logs/ablations.log" 2>&1
    cp benchmarks/results/serving_* "$WORK/results/" 2>/dev/null
    ;;
  disagg)
    python3 -m pytest -q -m gpu tests/test_disagg.py 2>&1 | tee "$WORK/logs/pytest_disagg.log" | tail -5
    python3 benchmarks/bench_disagg.py --out "$WORK/results" 2>&1 | tail -12
    ;;
  *) echo "unknown phase $PHASE"; exit 2 ;;
esac
tar czf "$DEST/gpu_${PHASE}.tgz" -C "$WORK" results logs
echo "packed $DEST/gpu_${PHASE}.tgz"
