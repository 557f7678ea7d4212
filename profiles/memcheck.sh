#!/usr/bin/env bash
# compute-sanitizer over the kernel tests and a small mixed batch, both backends: memcheck (any
# out-of-bounds or misaligned access fails the run), then racecheck and synccheck on the CUDA
# kernels (shared-memory hazards and barrier misuse, which the CPU emulator finds only in part).
#   bash profiles/memcheck.sh
set -euo pipefail
cd "$(dirname "$0")/.."
backends="triton cuda"
if python -c "import sys, torch; sys.exit(torch.cuda.get_device_capability() != (9, 0))"; then
  backends="$backends cuda-wgmma"  # the prefill tiles on wgmma
fi
for backend in $backends; do
  compute-sanitizer --tool memcheck --error-exitcode 1 python profiles/mixed_batch.py --backend $backend --small
done
compute-sanitizer --tool memcheck --error-exitcode 1 \
  python -m pytest -q -x tests/test_paged_attention.py tests/test_store_kv.py tests/test_gather_input_ids.py \
  tests/test_cuda_kernels.py -k "cuda or triton"
for tool in racecheck synccheck; do
  for backend in $backends; do
    [ "$backend" = triton ] && continue
    compute-sanitizer --tool $tool --error-exitcode 1 python profiles/mixed_batch.py --backend $backend --small
  done
done
