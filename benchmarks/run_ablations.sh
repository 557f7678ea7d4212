#!/usr/bin/env bash
# Serving ablations (issue: the engine at hardware speed) and our kernels against FlashInfer inside
# the engine (issue: csrc), each on a fresh server with one flag changed, measured by
# bench_serving.py on the same workload. GPU machine; results land in $RESULTS_DIR (default
# benchmarks/results/) as serving_<dataset>_<tag>.{json,md,png}.
#
#   bash benchmarks/run_ablations.sh [GROUP...]     groups, run in the order given (default: all four):
#     backends  --attention-backend triton / cuda / flashinfer as they serve: decode steps under
#               CUDA graphs, overlap scheduling on (the flashinfer backend plans on the host once per
#               step from the runner's host copy of the metadata, outside the graph, as vLLM and
#               SGLang run it)
#     backends-eager  the same three with --disable-cuda-graph: the attention kernels (and
#               FlashInfer's planning) without graphs (not in the default list)
#     overlap   overlap scheduling on / off
#     chunk     chunked-prefill budget 512 / 2048 / 16384 (off-equivalent) on a mix of 8k and short prompts
#     delayer   prefill delayer off / on, dp-size 1, bursty arrivals (gamma gaps, shape 0.2)
#     admission --kv-admission preempt / reserve with the KV pool cut to 64k tokens, long outputs:
#               more requests at once and recomputation vs fewer and none (not in the default list)
#   MODEL=<checkpoint dir, or tiny> bash benchmarks/run_ablations.sh ...   (default: a Llama-3-8B-shaped dummy)
#
# A server that fails to start (e.g. flashinfer not importable) is logged and its run skipped; the
# other runs go on. The script exits non-zero when any run failed.
#
# Before a server starts, our attention kernels that its --attention-backend runs (triton, cuda, or
# what `auto`'s tuning table picks for the model's calls; none for flashinfer) go through
# benchmarks/canary.py once, on small batches at the model's head counts, head dim and dtype
# (results kept in $CANARY_DIR, a fresh directory unless given): a run whose kernels fault, hang or
# are wrong is skipped with the reason, instead of a hung server taking the rest of the group's
# time. (Our store, gather and layer kernels, which every backend's server runs, are not checked.)
# A benchmark that runs past RUN_SECONDS (default 420) is stopped, its run counted as failed and its
# server's processes killed, so a server that hangs on a batch the canary did not cover costs
# RUN_SECONDS instead of whatever time limit the caller has left.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS_DIR=${RESULTS_DIR:-benchmarks/results}
PORT=${PORT:-30077}
MODEL=${MODEL:-}
LOAD=""
if [ -z "$MODEL" ]; then  # a config-only directory: random bf16 weights (--load-format dummy)
  MODEL=$(python3 - <<'PY'
import pathlib, sys, tempfile
sys.path.insert(0, "benchmarks")
from bench_offline import model_dir
print(model_dir("llama3-8b", pathlib.Path(tempfile.mkdtemp()))[0])
PY
) || exit 1
  LOAD="--load-format dummy"
fi
SERVE="python3 -m minengine.serve --model $MODEL $LOAD --port $PORT --log-level warning --context-length 16384"
BENCH="python3 benchmarks/bench_serving.py --base-url http://127.0.0.1:$PORT --tokenizer $MODEL --plot --no-progress"
BENCH="$BENCH --out $RESULTS_DIR"
FAILED=0
CANARY_DIR=${CANARY_DIR:-$(mktemp -d)}
RUN_SECONDS=${RUN_SECONDS:-420}
if ! [[ $RUN_SECONDS =~ ^[1-9][0-9]*$ ]]; then
  echo "RUN_SECONDS=$RUN_SECONDS: expected a whole number of seconds, at least 1" >&2
  exit 2
fi
mkdir -p "$CANARY_DIR"

healthy() { python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; }

descendants() {  # descendants PID: its child processes' ids, and theirs, deepest first
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
    descendants "$child"
    echo "$child"
  done
}

stop() {  # stop PID: SIGTERM, then SIGKILL after 30 s to it and what it started (a scheduler stuck in
  # a CUDA call runs no signal handler: left alone, it would keep the GPU's memory from the next server)
  local tree
  tree="$(descendants "$1") $1"
  kill -TERM "$1" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
  # shellcheck disable=SC2086
  kill -KILL $tree 2>/dev/null
  wait "$1" 2>/dev/null
}

flag_value() {  # flag_value NAME "FLAGS" DEFAULT: the value of --NAME in FLAGS (the last, as argparse takes it)
  local value=$3 previous="" word
  for word in $2; do
    case $word in "--$1="*) value=${word#*=} ;; esac
    [ "$previous" = "--$1" ] && value=$word
    previous=$word
  done
  echo "$value"
}

canary_failures() {  # canary_failures ATTENTION_BACKEND DTYPE: a line "kernel: why" for each of its kernels that failed
  local name="$1-$2" verdict
  if [ -e "$CANARY_DIR/$name.txt" ]; then
    cat "$CANARY_DIR/$name.txt"
    return
  fi
  if verdict=$(python3 benchmarks/canary.py --served "$1" --model "$MODEL" --dtype "$2" --failed \
      --seconds 20 --startup-seconds 180 2> "$CANARY_DIR/$name.json"); then
    echo "$verdict" > "$CANARY_DIR/$name.txt"  # (kept only when the script ran: a failed one is tried again)
    echo "$verdict"
  else
    echo "== the canary script failed for --attention-backend $1 ($(tail -n 1 "$CANARY_DIR/$name.json")); the run goes ahead" >&2
  fi
}

run() {  # run TAG "SERVER FLAGS" "BENCH FLAGS"
  echo "== $1: server flags [$2]" >&2
  local failures
  failures=$(canary_failures "$(flag_value attention-backend "$2" auto)" "$(flag_value dtype "$2" auto)")
  if [ -n "$failures" ]; then
    echo "== $1: run skipped: its kernels did not pass their canary run (benchmarks/canary.py):" >&2
    echo "$failures" | sed 's/^/     /' >&2
    FAILED=1
    return
  fi
  $SERVE $2 &
  local pid=$! waited=0
  until healthy; do
    if ! kill -0 $pid 2>/dev/null || [ $waited -ge 600 ]; then
      echo "== $1: the server did not come up (exited or 600 s); run skipped" >&2
      stop $pid
      FAILED=1
      return
    fi
    sleep 1; waited=$((waited + 1))
  done
  echo "== $1: server up after ${waited} s" >&2
  local begin=$SECONDS rc
  # (--foreground: in the caller's process group, so a time limit around this script stops it too)
  timeout --foreground -k 20 "$RUN_SECONDS" $BENCH --tag "$1" $3
  rc=$?
  if { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && [ $((SECONDS - begin)) -ge "$RUN_SECONDS" ]; then
    echo "== $1: the benchmark ran past RUN_SECONDS=$RUN_SECONDS ($((SECONDS - begin)) s) and was stopped (a hung server?); no results" >&2
  fi
  [ $rc -eq 0 ] || FAILED=1
  stop $pid
}

# Poisson arrivals of 512-2048-token prompts: prefill chunks and decodes share steps (mixed batches)
MIXED="--dataset random --num-prompts 200 --random-input-len 2048 --random-output-len 256 --random-range-ratio 0.25 --request-rate 8"
# long and short: 20 of 100 prompts are 8192 tokens, the others 256-512, outputs 128-256 tokens, 2
# requests/s: while a long prompt is prefilled in chunks, the short ones decode in the same steps
# (chunk budget vs their ITL p99, TTFT, throughput)
LONG_SHORT="--dataset random --num-prompts 100 --random-input-len 512 --random-range-ratio 0.5 --random-output-len 256"
LONG_SHORT="$LONG_SHORT --random-long-fraction 0.2 --random-long-input-len 8192 --request-rate 2"
# bursts: 384 requests at 12/s on average, gaps gamma-distributed with shape 0.2 (clumps of arrivals
# with pauses between them), so new prefills keep arriving while a large decode batch runs
BURST="--dataset random --num-prompts 384 --random-input-len 1024 --random-output-len 512 --random-range-ratio 0.5"
BURST="$BURST --request-rate 12 --burstiness 0.2"
# throughput: all 256 requests at once (overlap on / off)
ALL_AT_ONCE="--dataset random --num-prompts 256 --random-input-len 512 --random-output-len 512 --random-range-ratio 0.5"
# up to 2k tokens a request in a 64k-token pool: reserve runs 32-64 at a time, preempt more
KV_BOUND="--dataset random --num-prompts 256 --random-input-len 1024 --random-output-len 1024 --random-range-ratio 0.5"

groups=("$@")
[ ${#groups[@]} -eq 0 ] && groups=(backends overlap chunk delayer)
for group in "${groups[@]}"; do
  case $group in
    backends)
      for backend in triton cuda flashinfer; do run "backend-$backend" "--attention-backend $backend" "$MIXED"; done ;;
    backends-eager)
      for backend in triton cuda flashinfer; do
        run "backend-$backend-eager" "--attention-backend $backend --disable-cuda-graph" "$MIXED"
      done ;;
    overlap)
      run "overlap-on" "" "$ALL_AT_ONCE"
      run "overlap-off" "--disable-overlap-schedule" "$ALL_AT_ONCE" ;;
    chunk)
      for budget in 512 2048 16384; do run "chunk$budget" "--chunked-prefill-size $budget" "$LONG_SHORT"; done ;;
    delayer)
      run "delayer-off" "" "$BURST"
      run "delayer-on" "--enable-prefill-delayer" "$BURST" ;;
    admission)
      for mode in preempt reserve; do run "admission-$mode" "--kv-admission $mode --max-total-tokens 65536" "$KV_BOUND"; done ;;
    *) echo "unknown group $group; allowed: backends backends-eager overlap chunk delayer admission" >&2; exit 2 ;;
  esac
done
exit $FAILED
