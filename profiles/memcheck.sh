#!/usr/bin/env bash
# compute-sanitizer over the attention kernels, cheapest and most telling first (a time-limited
# caller keeps what finished): racecheck and synccheck on the CUDA kernels (shared-memory hazards
# and barrier misuse, which the CPU emulator finds only in part) and memcheck on both backends, on
# a small mixed batch; then memcheck over the CUDA kernel tests and the contract tests (any
# out-of-bounds or misaligned access fails the run). A run that fails does not stop the later ones
# (a hazard racecheck finds would otherwise cost every memcheck run); the exit code is 1 if any failed.
# Each run on the small batch is bounded (MEMCHECK_RUN_SECONDS, default 120): a kernel that hangs
# costs that, not the caller's budget. (Unlike the benchmarks, nothing is left out after a failed
# canary run: the sanitizer's report is what says where a faulting kernel goes wrong.)
#   bash profiles/memcheck.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=profiles/bounded.sh
source profiles/bounded.sh
# every tensor its own cudaMalloc: with torch's caching allocator, an access past a tensor's end
# usually lands in the same cached block, where memcheck sees nothing wrong
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
# the tests' canary guard (tests/conftest.py) off: a kernel that failed it must run here, under
# the sanitizer, not fail at set-up (and -x would stop there)
export MINENGINE_TEST_CANARY=0
backends="triton cuda"
if python3 -c "import sys, torch; sys.exit(torch.cuda.get_device_capability() != (9, 0))"; then
  backends="$backends cuda-wgmma cuda-wgmma-tma cuda-wgmma-pipe cuda-wgmma-2wg"  # cp.async, TMA, pipelined, two warpgroups
fi
rc=0
sanitize() {  # sanitize SECONDS --tool T CMD...: one compute-sanitizer run (0 s: no limit); a failure is noted, not fatal
  local limit=$1
  shift
  echo "== compute-sanitizer $*"
  bounded "$limit" compute-sanitizer --error-exitcode 1 "$@" || { echo "== FAILED: compute-sanitizer $*"; rc=1; }
}
run_limit=${MEMCHECK_RUN_SECONDS:-120}
for tool in racecheck synccheck; do
  for backend in $backends; do
    [ "$backend" = triton ] && continue
    sanitize "$run_limit" --tool $tool python3 profiles/mixed_batch.py --backend $backend --small
  done
done
for backend in $backends; do
  sanitize "$run_limit" --tool memcheck python3 profiles/mixed_batch.py --backend $backend --small
done
sanitize 0 --tool memcheck python3 -m pytest -q -x tests/test_cuda_kernels.py
# the contract tests' triton and cuda params (cuda-emu skips on a GPU), less the slot-major 64-bit
# offset cases: under memcheck on an H100 one of their 9.2 GB allocations failed (the test then
# skips, and the failed cudaMalloc counts as the run's error); they run unsanitized in
# gpu_session.sh tests, and the head-major ones (12.9 GB) ran clean under memcheck
sanitize 0 --tool memcheck \
  python3 -m pytest -q -x tests/test_paged_attention.py tests/test_store_kv.py tests/test_gather_input_ids.py \
  -k "(triton or cuda) and not (past_2_pow_31 and slot)"
exit $rc
