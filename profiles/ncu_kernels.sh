#!/usr/bin/env bash
# Nsight Compute on each kernel for a representative mixed batch (one 2048-token chunk over an 8k
# prefix + 63 decodes at 4k, bf16, 32/8/128, page 16), Triton and CUDA backends: DRAM throughput,
# achieved occupancy, tensor-pipe utilization, top warp-stall reasons. Clocks left as they are.
# On an sm_90 GPU also cuda-wgmma (the CUDA kernel's prefill tiles on wgmma), cuda-wgmma-tma
# (those tiles loading K/V by TMA), cuda-wgmma-pipe (the TMA tiles pipelined) and cuda-wgmma-2wg
# (those with two warpgroups a block: 128-row tiles).
#   bash profiles/ncu_kernels.sh          -> profiles/out/ncu_<backend>.txt, and a row per kernel of
#                                            each in profiles/out/ncu_summary.md (profiles/ncu_summary.py)
# (NCU_OUT=DIR: those files in DIR instead of profiles/out)
# A backend whose run fails does not stop the others; the exit code is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=profiles/bounded.sh
source profiles/bounded.sh
OUT_DIR=${NCU_OUT:-profiles/out}
mkdir -p "$OUT_DIR"
rm -f "$OUT_DIR"/ncu_*.txt "$OUT_DIR/ncu_summary.md" "$OUT_DIR/canary.json"  # (an earlier run's must not pass for this one's)
rc=0
# most telling first, in case the phase's time runs out: the two-warpgroup tile (does it halve
# the L2-to-SM traffic?), then the one-warpgroup forms, then sm_80's mma.sync tiles
backends="triton"
if python3 -c "import sys, torch; sys.exit(torch.cuda.get_device_capability() != (9, 0))"; then
  backends="$backends cuda-wgmma-2wg cuda-wgmma-pipe cuda-wgmma-tma cuda-wgmma"
fi
backends="$backends cuda"
# each once in a child process first (benchmarks/canary.py): one that faults, hangs or is wrong is
# left out here (under ncu, a hung kernel would hold the rest of the phase). NCU_SKIP="NAME ..."
# (set, even empty: gpu_session.sh passes what bench_attention's canary found) instead of a canary
# run of its own; if the canary script itself fails, every backend is profiled.
if [ -n "${NCU_SKIP+set}" ]; then
  passed=$(for backend in $backends; do case " $NCU_SKIP " in *" $backend "*) ;; *) printf '%s ' "$backend" ;; esac; done)
# (shorter limits than the bench's: this step has about 150 s; Triton's compile is cached by then)
elif ! passed=$(python3 benchmarks/canary.py --passed --seconds 20 --startup-seconds 90 --backends $backends \
    2> "$OUT_DIR/canary.json"); then
  echo "the canary script failed ($OUT_DIR/canary.json); profiling every backend"
  passed=$backends
fi
for backend in $backends; do
  case " $passed " in *" $backend "*) ;; *) echo "ncu on $backend SKIPPED: did not pass its canary run"; rc=1 ;; esac
done
backends=$passed
# a section's table alone leaves out its breakdowns (the warp-stall reasons of WarpStateStats, the
# pipe utilization of ComputeWorkloadAnalysis): print the sections' bodies too where ncu can
details=""
if ncu --help 2>/dev/null | grep -- "--print-details" > /dev/null; then  # no -q: an early exit would SIGPIPE ncu (pipefail)
  details="--print-details all"
fi
for backend in $backends; do
  # a backend's profile is bounded (NCU_BACKEND_SECONDS, default 150): a hang costs that, not the phase
  # shellcheck disable=SC2086
  bounded "${NCU_BACKEND_SECONDS:-150}" ncu --clock-control none --target-processes all $details \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
      --section ComputeWorkloadAnalysis \
      --kernel-name regex:'attention|merge_splits|store_kv|gather' --launch-skip 2 --launch-count 6 \
      python3 profiles/mixed_batch.py --backend $backend > "$OUT_DIR/ncu_$backend.txt" \
    && echo "wrote $OUT_DIR/ncu_$backend.txt" || { echo "ncu on $backend FAILED"; rc=1; }
done
reports=""
for backend in $backends; do [ -s "$OUT_DIR/ncu_$backend.txt" ] && reports="$reports $OUT_DIR/ncu_$backend.txt"; done
# shellcheck disable=SC2086
[ -n "$reports" ] && python3 profiles/ncu_summary.py $reports > "$OUT_DIR/ncu_summary.md" \
  && echo "wrote $OUT_DIR/ncu_summary.md" || rc=1
exit $rc
