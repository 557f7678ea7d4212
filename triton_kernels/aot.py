"""Compile the kernels for a GPU target on any machine, GPU or not, and read their resources.

Triton ships ptxas and cuobjdump, so TTIR -> TTGIR -> PTX -> cubin runs on a CPU-only machine.
Tests use this, in a subprocess without ``TRITON_INTERPRET``, to prove the kernels compile for
sm_80 and sm_90 (the interpreter never goes through the compiler), and
``profiles/compile_report.py`` prints registers, spills, shared memory and the matrix
instructions of each tile config.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction

from triton_kernels._common import FP_FUSION
from triton_kernels.attention import _merge_splits_kernel, _paged_attention_kernel, block_order_params, pick_config
from triton_kernels.input_ids import _gather_input_ids_kernel
from triton_kernels.kv_cache import _store_kv_kernel
from triton_kernels.layers import _rms_norm_kernel, _rotary_kernel, _silu_and_mul_kernel, norm_warps

TRITON_TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
}


def compile_for_target(fn, arg_types: dict[str, str], constexprs: dict[str, Any], arch: int, **options):
    """Compile a ``@triton.jit`` function for ``sm_<arch>``.

    ``arg_types`` maps each runtime argument to a Triton type ("*bf16", "i32", "fp32"); pointers
    and ``stride_*`` arguments get the 16-divisibility hint the launcher would find at run time.
    """
    if not isinstance(fn, JITFunction):
        raise RuntimeError(
            "compiling for a GPU target needs Triton's compiler: unset TRITON_INTERPRET (under the "
            "interpreter, @triton.jit builds interpreter shims, Triton's own tl.* helpers included)"
        )
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = arg_types[name]
        if arg_types[name].startswith("*") or name.startswith("stride_"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=FP_FUSION | options)


def _strides(fn) -> dict[str, str]:
    return {name: "i32" for name in fn.arg_names if name.startswith("stride_")}


def compile_attention(
    arch: int,
    dtype: torch.dtype,
    head_dim: int,
    group: int,
    page_size: int,
    num_splits: int,
    max_seqlen_q: int,
    num_kv_heads: int = 8,
    shared_memory: int = 1 << 30,
    config=None,
    same_kv_strides: bool = True,
    q_sign: int = 1,
    block_order: str = "heavy-first",
):
    """The attention kernel as the launcher configures it for this call shape (on a device that
    gives a program ``shared_memory`` bytes), or with the tile shapes ``config`` (an
    ``AttentionConfig``) instead; ``same_kv_strides`` and ``q_sign`` as the launcher sets them for
    K and V caches of other strides and for a negative (-1) or zero (0) softmax scale, ``block_order``
    as ``paged_attention``'s."""
    cfg = config or pick_config(max_seqlen_q, group, head_dim, dtype, interpret=False, shared_memory=shared_memory)
    elem = "*" + TRITON_TYPES[dtype]
    types = dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "out_ptr"), elem)
    types |= dict.fromkeys(("part_acc_ptr", "part_ml_ptr"), "*fp32")
    types |= dict.fromkeys(("block_tables_ptr", "seq_lens_ptr", "cu_seqlens_q_ptr"), "*i32")
    types |= dict(num_seqs="i32", num_tokens="i32", scale_log2e="fp32") | _strides(_paged_attention_kernel)
    constexprs = dict(
        NUM_Q_HEADS=num_kv_heads * group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        GROUP=group,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=cfg.tokens(group)[0],
        SMALL_M=cfg.small_m,
        SMALL_Q=cfg.tokens(group)[1],
        TILE_N=cfg.tile_n,
        PAGE_SIZE=page_size,
        NUM_SPLITS=num_splits,
        DOT_FP32=False,
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        SLOT_I64=False,
        SAME_KV_STRIDES=same_kv_strides,
        Q_SIGN=q_sign,
    )
    constexprs["HEAD_SHIFT"], constexprs["HEAVY_FIRST"] = block_order_params(block_order, num_kv_heads)
    compiled = compile_for_target(
        _paged_attention_kernel, types, constexprs, arch, num_warps=cfg.num_warps, num_stages=cfg.num_stages
    )
    return cfg, compiled


def compile_merge(arch: int, dtype: torch.dtype, head_dim: int, num_splits: int):
    types = dict(part_acc_ptr="*fp32", part_ml_ptr="*fp32", out_ptr="*" + TRITON_TYPES[dtype], num_tokens="i32")
    constexprs = dict(
        NUM_Q_HEADS=32, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), NUM_SPLITS=num_splits
    )
    return compile_for_target(
        _merge_splits_kernel, types | _strides(_merge_splits_kernel), constexprs, arch, num_warps=4
    )


def compile_store_kv(arch: int, dtype: torch.dtype, num_kv_heads: int, head_dim: int, page_size: int):
    elem = "*" + TRITON_TYPES[dtype]
    types = dict.fromkeys(("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr"), elem) | dict(slot_mapping_ptr="*i64")
    constexprs = dict(
        NUM_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=page_size,
    )
    return compile_for_target(_store_kv_kernel, types | _strides(_store_kv_kernel), constexprs, arch, num_warps=4)


def compile_gather(arch: int, id_dtype: torch.dtype, index_dtype: torch.dtype):
    ids = "*" + TRITON_TYPES[id_dtype]
    types = dict(prefill_ptr=ids, buffer_ptr=ids, out_ptr=ids, indices_ptr="*" + TRITON_TYPES[index_dtype])
    types |= dict(num_prefill="i32", total="i32") | _strides(_gather_input_ids_kernel)
    return compile_for_target(_gather_input_ids_kernel, types, dict(BLOCK=1024), arch, num_warps=4)


def compile_rms_norm(arch: int, dtype: torch.dtype, width: int, residual: bool):
    elem = "*" + TRITON_TYPES[dtype]
    types = dict.fromkeys(("x_ptr", "res_ptr", "w_ptr", "out_ptr"), elem) | dict(n="i32", eps="fp32")
    block = triton.next_power_of_2(width)
    constexprs = dict(HAS_RESIDUAL=residual, BLOCK=block)
    return compile_for_target(
        _rms_norm_kernel, types | _strides(_rms_norm_kernel), constexprs, arch, num_warps=norm_warps(block)
    )


def compile_rotary(
    arch: int, dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, norm: bool = False
):
    elem = "*" + TRITON_TYPES[dtype]
    types = dict(pos_ptr="*i64", q_ptr=elem, k_ptr=elem, cos_ptr="*fp32", sin_ptr="*fp32", qw_ptr=elem, kw_ptr=elem)
    half = head_dim // 2
    constexprs = dict(
        HQ=num_q_heads,
        HK=num_kv_heads,
        HALF=half,
        BLOCK_H=triton.next_power_of_2(max(num_q_heads, num_kv_heads)),
        BLOCK_HALF=triton.next_power_of_2(half),
        HAS_NORM=norm,
    )
    types["eps"] = "fp32"
    return compile_for_target(_rotary_kernel, types | _strides(_rotary_kernel), constexprs, arch, num_warps=4)


def compile_silu_and_mul(arch: int, dtype: torch.dtype):
    elem = "*" + TRITON_TYPES[dtype]
    types = dict.fromkeys(("gate_ptr", "up_ptr", "out_ptr"), elem) | dict(n="i32")
    return compile_for_target(
        _silu_and_mul_kernel, types | _strides(_silu_and_mul_kernel), dict(BLOCK=1024), arch, num_warps=4
    )


def cuobjdump() -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def async_waits(compiled) -> list[str]:
    """The pending-copy counts of the kernel's ``async_wait`` ops, in order (TTGIR).

    Inside a pipelined loop, N > 0 means the wait leaves N copy groups in flight (loads for later
    tiles); 0 means it waits for every copy issued so far.
    """
    return re.findall(r"ttg\.async_wait .*?\{num = (\d+) : i32\}", compiled.asm["ttgir"])


# Per SM: registers, warps, resident blocks and shared memory (bytes), for the targets compiled here
SM_LIMITS = {80: (65536, 64, 32, 167936), 90: (65536, 64, 32, 233472)}


def programs_per_sm(arch: int, regs: int, num_warps: int, shared_bytes: int) -> int | None:
    """How many programs (thread blocks) of a kernel fit on one SM at once: the tightest of
    registers, warps, blocks and shared memory, as CUDA's occupancy calculator (cuda_occupancy.h)
    counts them. Registers come in 256-register pieces per warp, and a warp takes them from one of
    the SM's 4 quarters (16384 each); a block's shared memory, plus 1 KB the system reserves for
    it, is allocated in 128-byte pieces. None for a target not in SM_LIMITS or no register count."""
    if arch not in SM_LIMITS or regs < 0:
        return None
    sm_regs, sm_warps, sm_blocks, sm_shared = SM_LIMITS[arch]
    warp_regs = -(-regs * 32 // 256) * 256
    warps = 4 * (sm_regs // 4 // warp_regs) if regs else sm_warps
    block_shared = -(-(shared_bytes + 1024) // 128) * 128
    return min(min(warps, sm_warps) // num_warps, sm_blocks, sm_shared // block_shared)


def resources(compiled) -> dict[str, Any]:
    """Registers per thread, spilled bytes, shared memory, programs per SM (``programs_per_sm``)
    and the matrix instructions in SASS."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([cuobjdump(), "--dump-resource-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump(), "-sass", path], capture_output=True, text=True).stdout

    def field(key: str) -> int:
        m = re.search(rf"\b{key}:(\d+)", usage)
        return int(m.group(1)) if m else -1

    mma = "HGMMA" if "HGMMA" in sass else "HMMA" if "HMMA" in sass else "none"
    # spilled registers show up as a stack frame (and local memory)
    meta = compiled.metadata
    regs = field("REG")
    return dict(
        regs=regs,
        spill_bytes=field("STACK") + field("LOCAL"),
        shared_bytes=meta.shared,
        per_sm=programs_per_sm(meta.target.arch, regs, meta.num_warps, meta.shared),
        mma=mma,
        mma_loops=mma_loops(sass),
    )


def mma_loops(sass: str) -> list[int]:
    """Instructions per trip of each loop in ``cuobjdump -sass`` text that issues matrix
    instructions, in address order: for the attention kernel, a KV tile's cost per thread."""
    code = [(int(m[1], 16), m[2]) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    sizes = []
    for end, text in code:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target is None or int(target[1], 16) >= end:
            continue  # a loop closes with a branch back
        body = [t for addr, t in code if int(target[1], 16) <= addr <= end]
        if any("MMA" in t for t in body):
            sizes.append(len(body))
    return sizes
