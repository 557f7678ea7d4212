"""Store this step's keys and values into the paged KV cache.

Contract::

    store_kv(k, v, k_cache, v_cache, slot_mapping) -> None

    k, v          [num_tokens, Hkv, D]            same dtype as the caches; last dim contiguous
    k_cache       [num_pages, page_size, Hkv, D]  any strides (last dim 1); views of one tensor work
    v_cache       [num_pages, page_size, Hkv, D]
    slot_mapping  int64 [num_tokens], contiguous; token i goes to page s // page_size, offset s % page_size,
                  where s = slot_mapping[i]; s < 0 marks padding and is skipped

Nothing else in either cache changes. Offsets are 64-bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels._common import FP_FUSION, check_runnable, debug_checks, interpreting
from triton_kernels.contract import check_store_kv, check_store_kv_values


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcp,
    stride_kcs,
    stride_kch,
    stride_vcp,
    stride_vcs,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H).to(tl.int64)  # head strides of head-major caches pass 2**31
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    kc = k_cache_ptr + page * stride_kcp + offset * stride_kcs
    vc = v_cache_ptr + page * stride_vcp + offset * stride_vcs
    tl.store(kc + offs_h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
    tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :], v, mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    check_store_kv(k, v, k_cache, v_cache, slot_mapping)
    check_runnable(k, k_cache)
    if debug_checks():
        check_store_kv_values(k_cache, slot_mapping)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=block_d,
        PAGE_SIZE=k_cache.shape[1],
        num_warps=1 if interpreting() else 4,
        **FP_FUSION,
    )
