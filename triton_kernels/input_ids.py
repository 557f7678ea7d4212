"""Mixed-batch input_ids gather for overlap scheduling, in one launch.

Contract::

    gather_input_ids(prefill_ids, token_buffer, decode_indices, out=None) -> Tensor

    prefill_ids     [P]  int32 or int64: this step's prefill-chunk tokens, on the device
    token_buffer    [R]  same dtype: last sampled token of each request slot (the future map)
    decode_indices  [N]  int32 or int64: the slot of each decode in token_buffer
    out             optional [P + N], prefill_ids' dtype

    out[:P] = prefill_ids;  out[P:] = token_buffer[decode_indices]

P or N may be 0. The batch layout (prefill chunks first, then decodes) is the engine's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels._common import FP_FUSION, check_runnable, debug_checks, interpreting
from triton_kernels.contract import check_gather_input_ids, check_gather_input_ids_values

BLOCK = 1024


@triton.jit
def _gather_input_ids_kernel(
    prefill_ptr,
    buffer_ptr,
    indices_ptr,
    out_ptr,
    num_prefill,
    total,
    stride_p,
    stride_b,
    stride_i,
    stride_o,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    is_prefill = offs < num_prefill
    is_decode = (offs >= num_prefill) & (offs < total)
    pre = tl.load(prefill_ptr + offs * stride_p, mask=is_prefill, other=0)
    slot = tl.load(indices_ptr + (offs - num_prefill) * stride_i, mask=is_decode, other=0).to(tl.int64)
    dec = tl.load(buffer_ptr + slot * stride_b, mask=is_decode, other=0)
    tl.store(out_ptr + offs * stride_o, tl.where(is_prefill, pre, dec), mask=offs < total)


def gather_input_ids(
    prefill_ids: torch.Tensor,
    token_buffer: torch.Tensor,
    decode_indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    total = check_gather_input_ids(prefill_ids, token_buffer, decode_indices, out)
    check_runnable(prefill_ids, token_buffer, decode_indices)
    if debug_checks():
        check_gather_input_ids_values(token_buffer, decode_indices)
    if out is None:
        out = torch.empty(total, dtype=prefill_ids.dtype, device=prefill_ids.device)
    if total == 0:
        return out
    block = 128 if interpreting() else BLOCK
    _gather_input_ids_kernel[(triton.cdiv(total, block),)](
        prefill_ids,
        token_buffer,
        decode_indices,
        out,
        prefill_ids.numel(),
        total,
        prefill_ids.stride(0),
        token_buffer.stride(0),
        decode_indices.stride(0),
        out.stride(0),
        BLOCK=block,
        num_warps=1 if interpreting() else 4,
        **FP_FUSION,
    )
    return out
