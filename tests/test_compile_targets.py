"""The kernels compile for real GPUs (sm_80, sm_90) on this machine, without a GPU.

The interpreter runs kernels as Python and never goes through Triton's compiler, so a kernel can
pass every CPU test and still fail to compile for a device. These tests build cubins with the
ptxas Triton ships, in a subprocess without TRITON_INTERPRET, and check that the main configs
neither spill nor miss the tensor cores (odd shapes only have to compile).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, torch
    from triton_kernels import aot
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    out = {}
    for name, args in {
        "sm90_prefill": (90, bf16, 128, 4, 16, 1, 2048),
        "sm90_decode": (90, bf16, 128, 4, 16, 1, 1),
        "sm90_split": (90, bf16, 128, 4, 16, 4, 1),
        "sm80_prefill": (80, bf16, 128, 4, 16, 1, 2048),
        "sm90_fp32_d80_g5_p5": (90, fp32, 80, 5, 5, 2, 7),
        "sm90_fp16_d256_g16_p1": (90, fp16, 256, 16, 1, 2, 7),
        "sm90_prefill_d256": (90, bf16, 256, 4, 16, 1, 2048),
        "sm80_prefill_d256_99k": (80, bf16, 256, 4, 16, 1, 2048, 8, 101376),  # sm_86 / sm_89's limit
        "sm80_prefill_d128_99k": (80, bf16, 128, 4, 16, 1, 2048, 8, 101376),
    }.items():
        compiled = aot.compile_attention(*args)[1]
        out[name] = aot.resources(compiled) | {"waits": aot.async_waits(compiled)}
    out["merge"] = aot.resources(aot.compile_merge(90, bf16, 128, 8))
    out["store_kv"] = aot.resources(aot.compile_store_kv(90, bf16, 8, 128, 16))
    out["store_kv_odd"] = aot.resources(aot.compile_store_kv(80, fp32, 3, 80, 5))
    out["gather"] = aot.resources(aot.compile_gather(90, torch.int64, torch.int32))
    out["rms_norm_4096"] = aot.resources(aot.compile_rms_norm(90, bf16, 4096, True))
    out["rms_norm_8192"] = aot.resources(aot.compile_rms_norm(80, bf16, 8192, True))
    out["rotary"] = aot.resources(aot.compile_rotary(90, bf16, 64, 8, 128))
    out["rotary_odd"] = aot.resources(aot.compile_rotary(80, fp32, 5, 1, 80))
    out["rotary_qk_norm"] = aot.resources(aot.compile_rotary(90, bf16, 64, 8, 128, norm=True))
    out["rotary_qk_norm_sm80"] = aot.resources(aot.compile_rotary(80, fp16, 16, 8, 128, norm=True))
    out["silu_and_mul"] = aot.resources(aot.compile_silu_and_mul(90, bf16))
    print(json.dumps(out))
    """
)


def test_kernels_compile_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    layers = ("rms_norm_4096", "rms_norm_8192", "rotary", "rotary_qk_norm", "rotary_qk_norm_sm80", "silu_and_mul")
    prefill = ("sm90_prefill", "sm90_prefill_d256", "sm80_prefill")
    for name in (*prefill, "sm90_decode", "sm90_split", "merge", "store_kv", "gather", *layers):
        assert res[name]["spill_bytes"] == 0, (name, res[name])
    assert res["sm90_prefill"]["mma"] == "HGMMA"  # Hopper wgmma for prefill tiles
    for name in prefill:  # each KV loop's wait leaves the next tile's K and V copies in flight
        assert res[name]["waits"] == ["2", "0"] * 4, (name, res[name]["waits"])
    for name in ("sm80_prefill_d256_99k", "sm80_prefill_d128_99k"):  # fits a 99 KB device, no spill
        assert res[name]["shared_bytes"] <= 101376 and res[name]["spill_bytes"] == 0, (name, res[name])
    for name in ("sm90_decode", "sm90_split", "sm80_prefill"):
        assert res[name]["mma"] == "HMMA", (name, res[name])
