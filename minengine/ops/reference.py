"""Pure-torch implementations of the kernel contracts (see ``triton_kernels``).

They are the ``torch`` backend (CPU engine runs) and the references tests compare against:
pass float64 inputs to compute in float64. They take the same arguments and run the same
argument checks as the kernels; unlike the kernels they read ``seq_lens`` and
``cu_seqlens_q`` on the host.
"""

from __future__ import annotations

import torch

from triton_kernels.contract import (
    REFERENCE_DTYPES,
    check_gather_input_ids,
    check_paged_attention,
    check_store_kv,
    softmax_scale_or_default,
)

# Query rows per matmul: bounds the [Hq, rows, seq_len] score tensor for long sequences.
_Q_CHUNK = 1024


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``num_splits`` is accepted for signature parity with the kernels and has no effect."""
    dims = check_paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, out, REFERENCE_DTYPES
    )
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = softmax_scale_or_default(softmax_scale, dims.head_dim)
    group = dims.num_q_heads // dims.num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    out[cu[-1] :] = 0  # padding tokens past the last sequence
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = cu[b], cu[b + 1]
        if q_end == q_start:
            continue
        n_pages = -(-seq_len // dims.page_size)
        pages = block_tables[b, :n_pages].long()
        # [Hkv, seq_len, D]; slicing to seq_len drops the unused tail of the last page
        k = k_cache[pages].flatten(0, 1)[:seq_len].to(compute).transpose(0, 1)
        v = v_cache[pages].flatten(0, 1)[:seq_len].to(compute).transpose(0, 1)
        first_pos = seq_len - (q_end - q_start)
        for c0 in range(q_start, q_end, _Q_CHUNK):
            c1 = min(c0 + _Q_CHUNK, q_end)
            qc = q[c0:c1].to(compute).view(c1 - c0, dims.num_kv_heads, group, dims.head_dim)
            qc = qc.permute(1, 2, 0, 3).flatten(1, 2)  # [Hkv, group * rows, D]
            scores = (qc @ k.transpose(1, 2)).view(dims.num_kv_heads, group, c1 - c0, seq_len) * scale
            pos = torch.arange(first_pos + c0 - q_start, first_pos + c1 - q_start, device=q.device)
            visible = torch.arange(seq_len, device=q.device)[None, :] <= pos[:, None]
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            o = probs.flatten(1, 2) @ v  # [Hkv, group * rows, D]
            o = o.view(dims.num_kv_heads, group, c1 - c0, dims.head_dim).permute(2, 0, 1, 3)
            out[c0:c1] = o.reshape(c1 - c0, dims.num_q_heads, dims.head_dim).to(out.dtype)
    return out


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    check_store_kv(k, v, k_cache, v_cache, slot_mapping, REFERENCE_DTYPES)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    page_size = k_cache.shape[1]
    pages, offsets = slots // page_size, slots % page_size
    k_cache[pages, offsets] = k[keep]
    v_cache[pages, offsets] = v[keep]


def gather_input_ids(
    prefill_ids: torch.Tensor,
    token_buffer: torch.Tensor,
    decode_indices: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    total = check_gather_input_ids(prefill_ids, token_buffer, decode_indices, out)
    if out is None:
        out = torch.empty(total, dtype=prefill_ids.dtype, device=prefill_ids.device)
    num_prefill = prefill_ids.numel()
    out[:num_prefill] = prefill_ids
    out[num_prefill:] = token_buffer[decode_indices.long()]
    return out
