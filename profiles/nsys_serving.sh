#!/usr/bin/env bash
# Nsight Systems timeline of a serving run: the server under nsys, a short bench_serving load,
# NVTX ranges from the engine (schedule, h2d, forward, sampling, process_results).
#   bash profiles/nsys_serving.sh [extra server flags...]      -> profiles/out/serving.nsys-rep
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nsys >/dev/null || { echo "nsys not found: use profiles/torch_trace.py instead"; exit 1; }
mkdir -p profiles/out
PORT=30099
nsys profile --trace=cuda,nvtx,osrt --sample=none --force-overwrite=true -o profiles/out/serving \
  python3 -m minengine.serve --port $PORT --log-level warning "$@" & pid=$!
until python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; do sleep 1; kill -0 $pid; done
python3 benchmarks/bench_serving.py --base-url http://127.0.0.1:$PORT --dataset random --num-prompts 64 \
  --random-input-len 512 --random-output-len 64 --no-progress --out profiles/out
# SIGINT, as Ctrl-C: nsys ends the collection, sends the server its --kill signal (SIGTERM, which
# the server drains on) and writes the report; a SIGTERM to nsys itself is not documented to do so
kill -INT $pid; wait $pid || true
nsys stats --report cuda_gpu_kern_sum,nvtx_sum profiles/out/serving.nsys-rep | head -60
