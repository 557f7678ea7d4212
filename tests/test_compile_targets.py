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
    import json, re, torch
    from triton_kernels import aot
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    out = {}

    def resources(compiled):
        # fp32 arithmetic with explicit rounding: emitted only where FMA fusion is off
        unfused = len(re.findall(r"\\b(?:mul|add|sub)\\.rn\\.f32\\b", compiled.asm["ptx"]))
        return aot.resources(compiled) | {"unfused": unfused}

    for name, args in {
        "sm90_prefill": (90, bf16, 128, 4, 16, 1, 2048),
        "sm90_decode": (90, bf16, 128, 4, 16, 1, 1),
        "sm90_split": (90, bf16, 128, 4, 16, 4, 1),
        "sm80_prefill": (80, bf16, 128, 4, 16, 1, 2048),
        "sm90_fp32_d80_g5_p5": (90, fp32, 80, 5, 5, 2, 7),
        "sm90_fp16_d256_g16_p1": (90, fp16, 256, 16, 1, 2, 7),
        # V strided apart from K, a negative and a zero softmax scale (the engine's are positive)
        "sm90_kv_strides_neg_scale": (90, bf16, 128, 4, 16, 1, 2048, 8, 1 << 30, None, False, -1),
        "sm80_zero_scale_split": (80, fp16, 64, 2, 16, 4, 1, 8, 1 << 30, None, True, 0),
        "sm90_prefill_d256": (90, bf16, 256, 4, 16, 1, 2048),
        "sm80_prefill_d256_99k": (80, bf16, 256, 4, 16, 1, 2048, 8, 101376),  # sm_86 / sm_89's limit
        "sm80_prefill_d128_99k": (80, bf16, 128, 4, 16, 1, 2048, 8, 101376),
    }.items():
        compiled = aot.compile_attention(*args)[1]
        out[name] = resources(compiled) | {"waits": aot.async_waits(compiled)}
    from triton_kernels.attention import pick_config, tile_variants
    rows64 = tile_variants(pick_config(2048, 4, 128, bf16, False))["64-rows-2-programs"]
    compiled = aot.compile_attention(90, bf16, 128, 4, 16, 1, 2048, config=rows64)[1]
    out["sm90_prefill_64_rows"] = resources(compiled) | {"waits": aot.async_waits(compiled)}
    out["merge"] = resources(aot.compile_merge(90, bf16, 128, 8))
    out["store_kv"] = resources(aot.compile_store_kv(90, bf16, 8, 128, 16))
    out["store_kv_odd"] = resources(aot.compile_store_kv(80, fp32, 3, 80, 5))
    out["gather"] = resources(aot.compile_gather(90, torch.int64, torch.int32))
    out["rms_norm_4096"] = resources(aot.compile_rms_norm(90, bf16, 4096, True))
    out["rms_norm_8192"] = resources(aot.compile_rms_norm(80, bf16, 8192, True))
    out["rotary"] = resources(aot.compile_rotary(90, bf16, 64, 8, 128))
    out["rotary_odd"] = resources(aot.compile_rotary(80, fp32, 5, 1, 80))
    out["rotary_qk_norm"] = resources(aot.compile_rotary(90, bf16, 64, 8, 128, norm=True))
    out["rotary_qk_norm_sm80"] = resources(aot.compile_rotary(80, fp16, 16, 8, 128, norm=True))
    out["silu_and_mul"] = resources(aot.compile_silu_and_mul(90, bf16))
    print(json.dumps(out))
    """
)


def test_kernels_compile_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"  # (Triton 3.10's default: the kernels ask for fusion themselves)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    layers = ("rms_norm_4096", "rms_norm_8192", "rotary", "rotary_qk_norm", "rotary_qk_norm_sm80", "silu_and_mul")
    prefill = ("sm90_prefill", "sm90_prefill_d256", "sm80_prefill", "sm90_prefill_64_rows")
    main = (*prefill, "sm90_decode", "sm90_split", "sm90_kv_strides_neg_scale")
    for name in (*main, "merge", "store_kv", "gather", *layers):
        assert res[name]["spill_bytes"] == 0, (name, res[name])
    assert {name: r["unfused"] for name, r in res.items() if r["unfused"]} == {}  # every kernel may fuse
    assert res["sm90_prefill"]["mma"] == "HGMMA"  # Hopper wgmma for prefill tiles
    for name in prefill:  # each KV loop's wait leaves the next tile's K and V copies in flight
        assert res[name]["waits"] == ["2", "0"] * 4, (name, res[name]["waits"])
    for name in ("sm80_prefill_d256_99k", "sm80_prefill_d128_99k"):  # fits a 99 KB device, no spill
        assert res[name]["shared_bytes"] <= 101376 and res[name]["spill_bytes"] == 0, (name, res[name])
    for name in ("sm90_decode", "sm90_split", "sm80_prefill"):
        assert res[name]["mma"] == "HMMA", (name, res[name])
    # SASS instructions per KV tile in the unmasked loops (the prefill's big block; the decode's),
    # sm_90, bf16 D 128, 16-token pages: 502 / 492 with Triton 3.6 and 519 / 492 with 3.9 before
    # slot offsets left the loop, V reused K's offsets and maxima were taken on unscaled scores;
    # 400 / 353 and 427 / 358 after.
    assert res["sm90_prefill"]["mma_loops"][2] <= 450, res["sm90_prefill"]
    assert res["sm90_decode"]["mma_loops"][0] <= 400, res["sm90_decode"]
    # the variant's point: two programs an SM, where the pick's 128-row block fills one
    assert res["sm90_prefill_64_rows"]["per_sm"] == 2 and res["sm90_prefill_64_rows"]["mma"] == "HGMMA"


def test_every_launch_asks_for_fp_fusion(monkeypatch, device):
    """Each launcher asks Triton for FMA fusion (Triton 3.10 turns its default off; the kernels
    were designed and measured with it), whatever the machine's default: launches recorded here,
    compiled PTX in the test above."""
    import torch

    from triton_kernels import attention, input_ids, kv_cache, layers

    launched = {}
    kernels = {
        "attention": attention._paged_attention_kernel,
        "merge": attention._merge_splits_kernel,
        "gather": input_ids._gather_input_ids_kernel,
        "store_kv": kv_cache._store_kv_kernel,
        "rms_norm": layers._rms_norm_kernel,
        "rotary": layers._rotary_kernel,
        "silu_and_mul": layers._silu_and_mul_kernel,
    }
    for name, kernel in kernels.items():
        real = kernel.run

        def run(*args, _name=name, _real=real, **kwargs):
            launched[_name] = kwargs.get("enable_fp_fusion")
            return _real(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", run)
    f32 = dict(dtype=torch.float32, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    q, cache = torch.randn(2, 2, 32, **f32), torch.randn(4, 4, 1, 32, **f32)
    table, lens, cu = torch.tensor([[0, 1], [2, 3]], **i32), torch.tensor([5, 6], **i32), torch.tensor([0, 1, 2], **i32)
    attention.paged_attention(q, cache, cache, table, lens, cu, 1, num_splits=2)
    input_ids.gather_input_ids(torch.arange(3, device=device), torch.arange(8, device=device), torch.tensor([1], **i32))
    kv_cache.store_kv(q[:, :1], q[:, :1], cache, cache, torch.tensor([0, 5], dtype=torch.int64, device=device))
    x = torch.randn(2, 32, **f32)
    layers.rms_norm(x, torch.ones(32, **f32), 1e-6)
    layers.silu_and_mul(x, x)
    table = torch.randn(8, 32, **f32)
    layers.rotary(torch.tensor([0, 1], dtype=torch.int64, device=device), q, q[:, :1].clone(), table, table)
    assert launched == dict.fromkeys(kernels, True)


def test_programs_per_sm():
    """The occupancy rule behind the per_sm column: H100 and A100 limits, cases worked by hand."""
    from triton_kernels.aot import programs_per_sm

    assert programs_per_sm(90, 166, 8, 131072) == 1  # the bf16 D 128 prefill pick: registers and shared memory
    assert programs_per_sm(90, 114, 4, 38912) == 4  # its decode tile: 4 warps of 3840 registers a quarter
    assert programs_per_sm(90, 143, 4, 38912) == 3  # 4608 registers a warp: 3 warps a quarter
    assert programs_per_sm(90, 204, 4, 114688) == 2  # 64-row blocks: registers and shared memory both allow 2
    assert programs_per_sm(90, 204, 4, 115712) == 2 and programs_per_sm(90, 204, 4, 115713) == 1
    assert programs_per_sm(80, 204, 4, 114688) == 1  # an A100 has 164 KB
    assert programs_per_sm(90, 32, 4, 0) == 16 and programs_per_sm(90, 16, 1, 0) == 32  # warps, then blocks
    assert programs_per_sm(90, 143, 2, 0) == 6  # 3 warps a quarter: 12, where 65536 / 4608 would allow 14
    assert programs_per_sm(90, 32, 4, 45600) == 4  # 46624 bytes a block, allocated as 46720
    assert programs_per_sm(75, 32, 4, 0) is None and programs_per_sm(90, -1, 4, 0) is None


def test_compile_report_lists_each_tile_variant():
    """``profiles/compile_report.py --variants``: a row per variant that compiles (the configs
    ``bench_attention.py --triton-variants`` times), after the launcher's own."""
    import torch

    from triton_kernels.attention import pick_config, tile_variants

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "profiles/compile_report.py", "--arch", "90", "--dtypes", "fp16", "--head-dims", "64"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([*cmd, "--variants"], capture_output=True, text=True, env=env, timeout=900, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    prefill = [r for r in rows if r[4] == "prefill"]
    picked = pick_config(2048, 4, 64, torch.float16, interpret=False)
    assert [r[15] if len(r) > 15 else "" for r in prefill] == ["", *tile_variants(picked)], proc.stdout
    assert all(int(r[9]) > 0 and int(r[12]) >= 1 for r in rows)  # (registers and programs an SM read for each)
    # KV loops per pick: a prefill tile's small and big blocks, each unmasked and masked; a decode's
    assert [len(r[14].split("/")) for r in rows if len(r) == 15] == [2, 2, 4], proc.stdout
