"""Paged attention for a mixed batch of prefill chunks and decodes, in one launch.

Contract::

    paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q,
                    softmax_scale=None, out=None, *, num_splits=None, config=None,
                    block_order="heavy-first") -> Tensor

    q             [num_tokens, Hq, D]           fp16 / bf16 / fp32; last dim contiguous
    k_cache       [num_pages, page_size, Hkv, D] same dtype as q; any strides (last dim 1), so
    v_cache       [num_pages, page_size, Hkv, D] kv[:, 0] / kv[:, 1] views of one tensor work
    block_tables  int32 [num_seqs, max_pages_per_seq]  page ids of each sequence, in order
    seq_lens      int32 [num_seqs]     KV length of each sequence, this step's tokens included
                                       (they are already in the cache)
    cu_seqlens_q  int32 [num_seqs + 1] query offsets; q_len_b = cu[b + 1] - cu[b] >= 0
    max_seqlen_q  host int >= max q_len (picks tile shapes: no host sync). A bound, not a hint:
                  the CUDA kernel launches its prefill tiles only when it exceeds one row group,
                  so a smaller value leaves rows unwritten there (MINENGINE_KERNEL_DEBUG=1 checks)
    softmax_scale defaults to D ** -0.5; any finite value with |softmax_scale| <= 2.359e38
    out           optional, like q; written and returned
    num_splits    optional override of the split-KV factor (None: chosen from the batch shape)
    config        optional AttentionConfig overriding the tile shapes (benchmarks, tuning; None:
                  pick_config's)
    block_order   the order programs start in ("heavy-first" or "in-order"; benchmarks): the same
                  output either way

Query j of sequence b sits at position seq_len_b - q_len_b + j and attends causally to KV
positions 0..that position. Decodes (q_len 1), chunks over a cached prefix (seq_len > q_len),
fresh prompts (seq_len == q_len) and empty entries (q_len 0) mix freely. Hq is any multiple of
Hkv, D any multiple of 16 in [32, 256], page_size any integer >= 1. Accumulation is fp32; the
output has q's dtype. Rows of ``out`` past cu_seqlens_q[-1] (padding tokens) are written as 0.

Never read: block-table entries past a sequence's last page, and cache slots at or past
seq_len. All cache offsets are 64-bit, so caches of more than 2**31 elements work.

Design: one program handles BLOCK_M rows = BLOCK_Q query tokens x the GROUP query heads that
share one KV head, so a decode still feeds the tensor cores (GQA packing). Query blocks of all
sequences are laid out on grid axis 0 without a host sync: sequence b owns the program ids
[cu[b] // BLOCK_Q + b, cu[b + 1] // BLOCK_Q + b + 1), found by binary search, and one extra
range covers padding tokens. A block of at most SMALL_Q tokens (a decode among prefill chunks)
runs SMALL_M rows instead of BLOCK_M, in the same launch. KV is read TILE_N tokens at a time;
each token's page comes from the block table (loaded a tile ahead), so any page size works.
Tiles every row of a block sees whole skip the causal and length masks. Row maxima are taken
on unscaled scores and the scale meets each score once, in the FMA feeding exp2 (the kernel's
scale is positive: q's sign flips for a negative softmax_scale, q is zeroed for 0). With split-KV
(flash-decoding), grid axis 2 splits each program's KV range; partial (acc, max, sum) go to an
fp32 workspace and one reduce launch merges them.

Programs start in the order of their linear id (axis 0 fastest), so the grid's order is the
order SMs get work in. With block_order "heavy-first" (the default), a sequence's query blocks
start last block first: the causal blocks that see the most keys go first and the lightest fill
the end of the launch, where an SM would otherwise wait on one long block (FlashAttention-2
reverses causal query blocks for this); and axis 0 interleaves the programs of 4 KV heads where
4 divide Hkv (else 2 where 2 do), so each block index is spread over several heads before the
next, lighter one, while programs reading one head's K/V still run close together in time (L2).
"in-order" is the order before it (first block first, one KV head after another), which
benchmarks time beside.
"""

from __future__ import annotations

import numbers
import struct
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from triton_kernels._common import (
    FP_FUSION,
    check_runnable,
    debug_checks,
    interpreter_problem,
    interpreting,
    max_shared_memory,
    num_sms,
)
from triton_kernels.contract import (
    MAX_SPLITS,
    check_block_order,
    check_num_splits,
    check_paged_attention,
    check_paged_attention_values,
    softmax_scale_or_default,
)

LOG2E = 1.4426950408889634


@triton.jit
def _kv_tiles(
    acc,
    m_i,
    l_i,
    q,
    pos,
    bt_row,
    k_head,
    v_head,
    kv_end,
    tile_lo,
    tile_hi,
    stride_kp,
    stride_ks,
    stride_vp,
    stride_vs,
    scale_log2e,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    SLOT_I64: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Online softmax over KV tiles [tile_lo, tile_hi). MASKED=False is for tiles every row sees
    whole (below the diagonal, inside kv_end): no causal or length masks there.

    Each tile's page ids are loaded one tile ahead, so the K/V loads of a tile depend on a value
    carried from the previous iteration and Triton's pipeliner can keep the next tiles' K/V copies
    in flight across the wait (with num_stages 3, ``async_wait`` keeps 2 copy groups pending; a
    page-id load in the same iteration made it wait for all of them).
    """
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    if TILE_N % PAGE_SIZE == 0:
        # A tile covers whole pages, so each row keeps its slot from tile to tile: the slot
        # offsets leave the loop. With V reusing K's offsets (below), the prefill tile's loop went
        # from 502 to 430 SASS instructions a tile (sm_90, bf16 D 128, 16-token pages, Triton 3.6).
        row_slot = offs_n % PAGE_SIZE
        if SLOT_I64:  # (PAGE_SIZE - 1) * stride_ks passes 2**31 (an unusual layout): 64-bit products
            row_slot = row_slot.to(tl.int64)
        k_row = row_slot * stride_ks
        v_row = row_slot * stride_vs  # (unused where V reuses K's offsets)
    next_pos = tile_lo * TILE_N + offs_n
    # With whole pages, first is next_pos // PAGE_SIZE in another form, for which ptxas gives the
    # bf16 D 128 decode tile on 16-token pages 114 registers on sm_90 with Triton 3.6 (128 with
    # 3.9): 4 programs an SM, where next_pos // PAGE_SIZE takes 143 (3 programs; 105 with 3.9).
    first = tile_lo * (TILE_N // PAGE_SIZE) + offs_n // PAGE_SIZE if TILE_N % PAGE_SIZE == 0 else next_pos // PAGE_SIZE
    next_page = tl.load(bt_row + first, mask=next_pos < kv_end, other=0)
    for tile in range(tile_lo, tile_hi):
        kv_pos = tile * TILE_N + offs_n
        page = next_page.to(tl.int64)
        next_pos = kv_pos + TILE_N
        next_page = tl.load(bt_row + next_pos // PAGE_SIZE, mask=next_pos < kv_end, other=0)
        if TILE_N % PAGE_SIZE != 0:
            slot = kv_pos % PAGE_SIZE
            if SLOT_I64:
                slot = slot.to(tl.int64)
            k_row = slot * stride_ks
            v_row = slot * stride_vs
        k_offs = (page * stride_kp + k_row)[:, None] + offs_d[None, :]
        # the usual cache layout: V's copies reuse K's offsets
        v_offs = k_offs if SAME_KV_STRIDES else (page * stride_vp + v_row)[:, None] + offs_d[None, :]
        if MASKED:
            kv_valid = kv_pos < kv_end
            kv_mask = kv_valid[:, None] & d_mask[None, :]
            k = tl.load(k_head + k_offs, mask=kv_mask, other=0.0)
            v = tl.load(v_head + v_offs, mask=kv_mask, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            k = tl.load(k_head + k_offs, mask=d_mask[None, :], other=0.0)
            v = tl.load(v_head + v_offs, mask=d_mask[None, :], other=0.0)
        else:
            k = tl.load(k_head + k_offs)
            v = tl.load(v_head + v_offs)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        # Raw scores: the row max is taken before scaling (scale_log2e > 0), so the scale meets
        # each score once, in the FMA that feeds exp2; a multiply of every score for the max cost
        # the prefill tile 30 of its 430 instructions a tile. m_i holds raw maxima.
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASKED:
            causal = (kv_pos[None, :] <= pos[:, None]) & kv_valid[None, :]
            s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_scaled = tl.where(m_new == float("-inf"), 0.0, m_new) * scale_log2e
        p = tl.math.exp2(s * scale_log2e - m_scaled[:, None])
        alpha = tl.math.exp2(m_i * scale_log2e - m_scaled)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend_block(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    block_tables_ptr,
    seq,
    tok0,
    q_end,
    seq_len,
    kv_head,
    split,
    num_tokens,
    scale_log2e,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    SLOT_I64: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    Q_SIGN: tl.constexpr,
):
    """Query tokens [tok0, min(tok0 + BLOCK_Q, q_end)) of one sequence, the GROUP query heads of
    kv_head: BLOCK_M rows, against this split's share of the KV range."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    row_tok = offs_m // GROUP
    q_head = kv_head * GROUP + offs_m % GROUP
    token = tok0 + row_tok
    row_valid = (row_tok < BLOCK_Q) & (token < q_end)
    # Causal position of each row; padding rows get seq_len 0 and so see no key.
    pos = seq_len - q_end + token

    q_offs = token.to(tl.int64)[:, None] * stride_qt + q_head.to(tl.int64)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    # Q_SIGN is the sign of softmax_scale (0 for a scale that is 0 in float32; exact in q's
    # dtype), so that scale_log2e > 0 and raw score maxima stay maxima once scaled.
    if Q_SIGN != 1:  # (through float32: the interpreter's bfloat16 product was NaN)
        q = (q.to(tl.float32) * Q_SIGN).to(q.dtype)
    if DOT_FP32:
        q = q.to(tl.float32)

    # KV range of this program: keys 0..(position of its last row), split NUM_SPLITS ways.
    kv_end = tl.maximum(seq_len - q_end + tl.minimum(tok0 + BLOCK_Q, q_end), 0)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    # Tiles [0, full) lie at or below the first row's position, so every row sees them whole.
    full = tl.maximum(seq_len - q_end + tok0 + 1, 0) // TILE_N
    tile_mid = tl.maximum(tl.minimum(full, tile_hi), tile_lo)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
    acc, m_i, l_i = _kv_tiles(
        acc, m_i, l_i, q, pos, bt_row, k_head, v_head, kv_end, tile_lo, tile_mid,
        stride_kp, stride_ks, stride_vp, stride_vs, scale_log2e,
        HEAD_DIM, BLOCK_D, TILE_N, PAGE_SIZE, DOT_FP32, PRECISION, SLOT_I64, SAME_KV_STRIDES, MASKED=False,
    )  # fmt: skip
    acc, m_i, l_i = _kv_tiles(
        acc, m_i, l_i, q, pos, bt_row, k_head, v_head, kv_end, tile_mid, tile_hi,
        stride_kp, stride_ks, stride_vp, stride_vs, scale_log2e,
        HEAD_DIM, BLOCK_D, TILE_N, PAGE_SIZE, DOT_FP32, PRECISION, SLOT_I64, SAME_KV_STRIDES, MASKED=True,
    )  # fmt: skip

    out_mask = row_valid[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = token.to(tl.int64)[:, None] * stride_ot + q_head.to(tl.int64)[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # workspace: acc [NUM_SPLITS, num_tokens, Hq, HEAD_DIM], (max, sum) [NUM_SPLITS, num_tokens, Hq, 2]
        row = (split * num_tokens + token.to(tl.int64)) * NUM_Q_HEADS + q_head
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + row * 2, m_i * scale_log2e, mask=row_valid)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_valid)


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    num_seqs,
    num_tokens,
    scale_log2e,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    SMALL_M: tl.constexpr,
    SMALL_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    SLOT_I64: tl.constexpr,
    SAME_KV_STRIDES: tl.constexpr,
    Q_SIGN: tl.constexpr,
    HEAD_SHIFT: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
):
    # Axis 0 interleaves the programs of 2**HEAD_SHIFT KV heads (block_order_params).
    pid = tl.program_id(0) >> HEAD_SHIFT
    kv_head = (tl.program_id(1) << HEAD_SHIFT) | (tl.program_id(0) & ((1 << HEAD_SHIFT) - 1))
    split = tl.program_id(2)

    # Which sequence owns this query block: the last b with cu[b] // BLOCK_Q + b <= pid.
    # b == num_seqs is the padding range past cu[num_seqs].
    lo = num_seqs * 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    is_seq = seq < num_seqs
    q_end = tl.load(cu_seqlens_q_ptr + seq + 1, mask=is_seq, other=num_tokens)
    seq_len = tl.load(seq_lens_ptr + seq, mask=is_seq, other=0)
    if HEAVY_FIRST:  # the range's last program takes its first block (the padding range's too)
        tok0 = q_start + (q_end // BLOCK_Q + seq - pid) * BLOCK_Q
    else:
        tok0 = q_start + (pid - q_start // BLOCK_Q - seq) * BLOCK_Q
    if tok0 >= q_end:
        return

    # A block of at most SMALL_Q tokens (a decode in a mixed launch, a chunk's short tail) runs
    # SMALL_M rows instead of BLOCK_M: its KV reads stay the same, its matmuls shrink.
    if SMALL_M < BLOCK_M:  # noqa: SIM102 (a constexpr: decode-only launches compile one block)
        if q_end - tok0 <= SMALL_Q:
            _attend_block(
                q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr, block_tables_ptr,
                seq, tok0, q_end, seq_len, kv_head, split, num_tokens, scale_log2e,
                stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                stride_ot, stride_oh, stride_bt,
                NUM_Q_HEADS, HEAD_DIM, BLOCK_D, GROUP, SMALL_M, SMALL_Q, TILE_N, PAGE_SIZE, NUM_SPLITS,
                DOT_FP32, PRECISION, SLOT_I64, SAME_KV_STRIDES, Q_SIGN,
            )  # fmt: skip
            return
    _attend_block(
        q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr, block_tables_ptr,
        seq, tok0, q_end, seq_len, kv_head, split, num_tokens, scale_log2e,
        stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        stride_ot, stride_oh, stride_bt,
        NUM_Q_HEADS, HEAD_DIM, BLOCK_D, GROUP, BLOCK_M, BLOCK_Q, TILE_N, PAGE_SIZE, NUM_SPLITS,
        DOT_FP32, PRECISION, SLOT_I64, SAME_KV_STRIDES, Q_SIGN,
    )  # fmt: skip


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    num_tokens,
    stride_ot,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    row = (offs_s * num_tokens + token) * NUM_Q_HEADS + head
    m = tl.load(part_ml_ptr + row * 2)
    l_s = tl.load(part_ml_ptr + row * 2 + 1)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=d_mask[None, :], other=0.0)
    l_sum = tl.sum(w * l_s, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(l_sum == 0.0, 1.0, l_sum)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


class AttentionConfig(NamedTuple):
    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    small_m: int  # rows of blocks with few query tokens (a mixed launch's decodes); <= block_m

    def tokens(self, group: int) -> tuple[int, int]:
        """Query tokens per big and per small block (BLOCK_Q, SMALL_Q): each token takes group rows."""
        return max(1, self.block_m // group), max(1, self.small_m // group)


def pick_config(
    max_seqlen_q: int, group: int, head_dim: int, dtype: torch.dtype, interpret: bool, shared_memory: int = 1 << 30
) -> AttentionConfig:
    """Tile shapes per call shape; shared_memory is what one program may use on the device (bytes).

    Chosen by compiling for sm_90 and sm_80 on a CPU machine (spills, shared memory, the matrix
    instructions used: profiles/compile_report.py), then measured once on an H100, not tuned there
    (benchmarks/results/attention_NVIDIA_H100_80GB_HBM3.md, bf16 32/8/128): the decode rows reach
    94% of copy bandwidth (128 decodes at 2k) and 86% (8 at 32k, split-KV); the prefill row 37% of
    matmul peak on a 2048-token chunk, where FlashInfer reaches 75%: 166 registers x 8 warps leave
    one program per SM (ncu: 12.5% occupancy, tensor pipe 25% of cycles, the largest stall
    long-scoreboard waits on global loads, which suggests the paged K/V). In one mixed launch the
    decode rows run in this prefill tile too: the 63 decodes of case d added about 0.59 ms there
    (d - c: 1.80 - 1.21) against 0.38 ms as a launch of their own (e - c), so two launches were
    faster (1.59 ms).

    Changed after that run, not yet measured (``bench_attention.py --triton-variants`` times stop
    41's tile parameters beside these, both on the current kernel body):
    the TTGIR of that prefill loop showed its block-table load in the same iteration as the K/V
    copies it addresses, so each tile waited for every copy (``async_wait {num = 0}``), the global
    latency exposed once per tile. Page ids now come a tile ahead and prefill tiles run 3 stages:
    the wait leaves the next tile's K and V in flight (``num = 2``; tests/test_compile_targets.py
    checks it for sm_90 and sm_80). Tiles below the diagonal skip the masks, and blocks of at most
    small_m // group tokens (a mixed launch's decodes) run small_m rows in the same launch. Later
    (also unmeasured), the SASS per KV tile: slot offsets out of the loop where tiles cover whole
    pages, V's offsets K's when the caches' strides match, maxima of unscaled scores; for bf16 D
    128 on 16-token pages, sm_90, Triton 3.6: the prefill tile's loop 502 -> 400 instructions, the
    decode tile's 492 -> 353 (``profiles/compile_report.py``'s loops column).
    """
    group_rows = max(16, triton.next_power_of_2(group))
    if interpret:
        return AttentionConfig(block_m=group_rows, tile_n=16, num_warps=1, num_stages=1, small_m=group_rows)
    if dtype == torch.float32:  # exact fp32 dots run on FMA units: 8 warps keep sm_90 from spilling
        return AttentionConfig(group_rows, tile_n=32, num_warps=8, num_stages=2, small_m=group_rows)
    wide = head_dim > 128
    if max_seqlen_q * group <= group_rows:  # decode-only (or tiny chunks): one token per row group
        # 2 stages: with 3, Triton 3.6 spills the split-KV variant on sm_90 (8 B at 128 registers)
        return AttentionConfig(group_rows, tile_n=32 if wide else 64, num_warps=4, num_stages=2, small_m=group_rows)
    # 3 stages: with page ids loaded a tile ahead, the pipeliner keeps the next tile's K/V copies in
    # flight across the wait (with 2, each tile waited for every copy). 8 warps: at 4, wide heads
    # spill on sm_90 with 3 stages (Triton 3.6: 16 B at D 256, 24 B at D 192; 3.9: 32 B at D 256).
    # On sm_8x, 3 stages take 96 KB (D <= 128) or 100 KB (wider), 2 take 64 or 68 KB: a device
    # with less (sm_86 / sm_89: 99 KB, sm_75: 64 KB) gets 2 (sm_90 takes 128 KB, and has 227).
    stages = 3 if shared_memory >= (100 if wide else 96) * 1024 else 2
    block_m = max(group_rows, 64 if wide else 128)
    return AttentionConfig(block_m, tile_n=32 if wide else 64, num_warps=8, num_stages=stages, small_m=group_rows)


def tile_variants(picked: AttentionConfig) -> dict[str, AttentionConfig]:
    """Tile configs to time beside ``picked`` (``bench_attention.py --triton-variants``) or to
    compile (``profiles/compile_report.py --variants``), named by how they differ; those equal to
    the pick or to an earlier one are left out: stop 41's prefill tile parameters (2 stages,
    decodes in the prefill tile, 4 warps for 64-row blocks) and each half of that change,
    deeper-pipelined decode tiles, 128-key prefill tiles, and 64-row prefill blocks two to an SM.
    All run the current kernel body (page ids a tile ahead, unmasked tiles below the diagonal),
    which has no switch back: stop 41's own kernel is in its committed results."""
    candidates = {
        "2-stages": picked._replace(num_stages=2),
        "one-tile": picked._replace(small_m=picked.block_m),
        "stop41-tiles": picked._replace(
            num_stages=2, small_m=picked.block_m, num_warps=8 if picked.block_m >= 128 else 4
        ),
        "3-stages": picked._replace(num_stages=3),
        "8-warps-3-stages": picked._replace(num_warps=8, num_stages=3),
        "tile-32-3-stages": picked._replace(tile_n=32, num_stages=3),
        # half the prefill loop's trips, each wait covering twice the math (FlashInfer's and FA3's
        # Hopper tiles are 128 keys wide): at bf16 D 128, 255 registers, 224 KB of shared memory and
        # no spill on sm_90 with Triton 3.6 (3.9 spills 16 B)
        "tile-128-3-stages": picked._replace(tile_n=128, num_stages=3),
    }
    if picked.block_m == 128 and picked.small_m <= 64:  # (a group of 128 heads fills 128 rows alone)
        # 64-row blocks of one warpgroup, two programs an SM (sm_90, bf16 D 128, Triton 3.6: 204
        # registers, 112 KB of shared memory each; the pick's 128-row block takes the whole SM):
        # their warpgroups meet at no common barrier, so one's wgmmas can run while the other takes
        # its softmax (what FA3 arranges with its ping-pong schedule). Each key is read by twice as
        # many programs, from L2.
        candidates["64-rows-2-programs"] = picked._replace(block_m=64, num_warps=4, num_stages=3)
    variants: dict[str, AttentionConfig] = {}
    for name, cfg in candidates.items():
        if cfg != picked and cfg not in variants.values():
            variants[name] = cfg
    return variants


def check_config(cfg: AttentionConfig, group: int) -> AttentionConfig:
    """A caller's tile shapes, as plain ints, or a ValueError naming the field, its value and what
    is allowed."""
    rows = max(16, triton.next_power_of_2(group))  # a block's rows hold whole groups of query heads
    for field in AttentionConfig._fields:
        value = getattr(cfg, field)
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise ValueError(f"config.{field} is {value!r}; allowed: an integer")
    cfg = AttentionConfig(*(int(v) for v in cfg))
    rules = (
        ("block_m", _pow2(cfg.block_m) and rows <= cfg.block_m <= 256, f"a power of two in [{rows}, 256]"),
        ("small_m", _pow2(cfg.small_m) and rows <= cfg.small_m <= cfg.block_m,
         f"a power of two in [{rows}, block_m {cfg.block_m}]"),
        ("tile_n", _pow2(cfg.tile_n) and 16 <= cfg.tile_n <= 256, "a power of two in [16, 256]"),
        ("num_warps", cfg.num_warps in (1, 2, 4, 8, 16), "1, 2, 4, 8 or 16"),
        ("num_stages", 1 <= cfg.num_stages <= 8, "an integer in [1, 8]"),
    )  # fmt: skip
    for field, good, allowed in rules:
        if not good:
            raise ValueError(f"config.{field} is {getattr(cfg, field)}; allowed: {allowed} (group {group})")
    return cfg


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def block_order_params(block_order: str, num_kv_heads: int) -> tuple[int, bool]:
    """(HEAD_SHIFT, HEAVY_FIRST) of a block order: log2 of the KV heads axis 0 interleaves, and
    whether a sequence's blocks start last first. The CUDA kernel (paged_attention.cu) does the same."""
    if check_block_order(block_order) == "in-order":
        return 0, False
    return (2 if num_kv_heads % 4 == 0 else 1 if num_kv_heads % 2 == 0 else 0), True


def pick_num_splits(num_tokens: int, num_seqs: int, block_q: int, num_kv_heads: int, device: torch.device) -> int:
    """Split-KV factor from the batch shape alone (no host sync).

    Split only when the grid is too small to fill the device (few, long decodes): aim at about
    two programs per SM. Sequences shorter than a split's share just leave some splits empty.
    """
    programs = (num_tokens // block_q + num_seqs) * num_kv_heads
    target = 2 * num_sms(device)
    if programs == 0 or programs >= target:
        return 1
    return min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(target, programs)))


def kernel_scale(scale: float) -> tuple[float, int]:
    """(scale_log2e, Q_SIGN) for softmax_scale: the kernel takes row maxima of unscaled scores,
    so its scale must be positive, and q's sign carries softmax_scale's. A scale whose float32
    |scale| * log2(e) is 0 (0, or below 2**-149) weighs every visible key the same: q zeroed."""
    scale_log2e = struct.unpack("f", struct.pack("f", abs(scale) * LOG2E))[0]
    if scale_log2e == 0.0:
        return 1.0, 0
    return scale_log2e, 1 if scale > 0 else -1


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
    config: AttentionConfig | None = None,
    block_order: str = "heavy-first",
) -> torch.Tensor:
    dims = check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, out)
    check_runnable(q, k_cache)
    check_block_order(block_order)
    if debug_checks():
        check_paged_attention_values(dims, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q)
    if out is None:
        out = torch.empty_like(q)
    if dims.num_tokens == 0:
        return out
    group = dims.num_q_heads // dims.num_kv_heads
    interpret = interpreting()
    if interpret and interpreter_problem():
        raise RuntimeError(interpreter_problem())
    if config is None:
        cfg = pick_config(max_seqlen_q, group, dims.head_dim, q.dtype, interpret, max_shared_memory(q.device))
    else:
        cfg = check_config(config, group)
    block_q, small_q = cfg.tokens(group)
    num_splits = check_num_splits(num_splits)
    scale = softmax_scale_or_default(softmax_scale, dims.head_dim)
    if num_splits is None:
        num_splits = pick_num_splits(dims.num_tokens, dims.num_seqs, block_q, dims.num_kv_heads, q.device)
    block_d = triton.next_power_of_2(dims.head_dim)
    scale_log2e, q_sign = kernel_scale(scale)

    if num_splits > 1:
        part_acc = torch.empty(
            (num_splits, dims.num_tokens, dims.num_q_heads, dims.head_dim), dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty((num_splits, dims.num_tokens, dims.num_q_heads, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused

    head_shift, heavy_first = block_order_params(block_order, dims.num_kv_heads)
    grid = ((dims.num_tokens // block_q + dims.num_seqs + 1) << head_shift, dims.num_kv_heads >> head_shift, num_splits)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        part_acc,
        part_ml,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        dims.num_seqs,
        dims.num_tokens,
        scale_log2e,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        NUM_Q_HEADS=dims.num_q_heads,
        HEAD_DIM=dims.head_dim,
        BLOCK_D=block_d,
        GROUP=group,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=block_q,
        SMALL_M=cfg.small_m,
        SMALL_Q=small_q,
        TILE_N=cfg.tile_n,
        PAGE_SIZE=dims.page_size,
        NUM_SPLITS=num_splits,
        DOT_FP32=interpret and q.dtype == torch.bfloat16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SLOT_I64=(dims.page_size - 1) * max(k_cache.stride(1), v_cache.stride(1)) >= 2**31,
        SAME_KV_STRIDES=k_cache.stride() == v_cache.stride(),
        Q_SIGN=q_sign,
        HEAD_SHIFT=head_shift,
        HEAVY_FIRST=heavy_first,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **FP_FUSION,
    )
    if num_splits > 1:
        _merge_splits_kernel[(dims.num_tokens, dims.num_q_heads)](
            part_acc,
            part_ml,
            out,
            dims.num_tokens,
            out.stride(0),
            out.stride(1),
            NUM_Q_HEADS=dims.num_q_heads,
            HEAD_DIM=dims.head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            num_warps=4 if not interpret else 1,
            **FP_FUSION,
        )
    return out
