#!/usr/bin/env bash
# compute-sanitizer memcheck over the kernel tests and a small mixed batch, both backends.
# Any out-of-bounds or misaligned access fails the run.   bash profiles/memcheck.sh
set -euo pipefail
cd "$(dirname "$0")/.."
for backend in triton cuda; do
  compute-sanitizer --tool memcheck --error-exitcode 1 python profiles/mixed_batch.py --backend $backend --small
done
compute-sanitizer --tool memcheck --error-exitcode 1 \
  python -m pytest -q -x tests/test_paged_attention.py tests/test_store_kv.py tests/test_gather_input_ids.py -k "cuda or triton"
