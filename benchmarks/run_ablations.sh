#!/usr/bin/env bash
# Serving ablations (issue: the engine at hardware speed), each on a fresh server with one flag
# changed, measured by bench_serving.py on the same model. GPU machine; results land in
# benchmarks/results/serving_<dataset>_<tag>.{json,md,png}.
#
#   bash benchmarks/run_ablations.sh [MODEL_DIR_OR_SHAPE]     (default: a Llama-3-8B-shaped dummy)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-}
PORT=30077
if [ -z "$MODEL" ]; then  # a config-only directory: random bf16 weights (--load-format dummy)
  MODEL=$(python - <<'PY'
import json, tempfile, pathlib, sys
sys.path.insert(0, "benchmarks")
from bench_offline import model_dir
print(model_dir("llama3-8b", pathlib.Path(tempfile.mkdtemp()))[0])
PY
)
  LOAD="--load-format dummy"
else
  LOAD=""
fi
SERVE="python -m minengine.serve --model $MODEL $LOAD --port $PORT --log-level warning --context-length 16384"
BENCH="python benchmarks/bench_serving.py --base-url http://127.0.0.1:$PORT --tokenizer $MODEL --plot --no-progress"

run() {  # run TAG "SERVER FLAGS" "BENCH FLAGS"
  $SERVE $2 & local pid=$!
  until curl -sf 127.0.0.1:$PORT/health >/dev/null; do sleep 1; kill -0 $pid; done
  $BENCH --tag "$1" $3
  kill -TERM $pid; wait $pid || true
}

# chunked prefill budget on a mix of long (8k) and short prompts: ITL p99, TTFT, throughput
MIX="--dataset random --num-prompts 200 --random-input-len 8192 --random-range-ratio 0.02 --random-output-len 256 --request-rate 4"
for budget in 512 2048 16384; do run "chunk$budget" "--chunked-prefill-size $budget" "$MIX"; done
# prefill delayer on vs off, dp-size 1, bursty arrivals
BURST="--dataset random --num-prompts 512 --random-input-len 1024 --random-output-len 512 --random-range-ratio 0.5"
run "delayer-off" "" "$BURST"
run "delayer-on" "--enable-prefill-delayer" "$BURST"
# overlap on vs off
STEADY="--dataset random --num-prompts 512 --random-input-len 512 --random-output-len 512 --random-range-ratio 0.5"
run "overlap-on" "" "$STEADY"
run "overlap-off" "--disable-overlap-schedule" "$STEADY"
