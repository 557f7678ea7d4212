"""Argument checks for the three kernel contracts, shared by every backend.

``check_*`` functions look only at shapes, dtypes, devices and host ints: no host sync, cheap
enough for every call. ``check_*_values`` read device data (a host sync) and run only in debug
mode (``MINENGINE_KERNEL_DEBUG=1``) or from tests. Both raise ``ValueError`` naming the bad
value and what is allowed.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The pure-torch references also take float64, to compute test references exactly.
REFERENCE_DTYPES = (*FLOAT_DTYPES, torch.float64)
ID_DTYPES = (torch.int32, torch.int64)
MIN_HEAD_DIM, MAX_HEAD_DIM = 32, 256


class AttentionDims(NamedTuple):
    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int
    num_seqs: int
    max_pages_per_seq: int


def head_dim_supported(d: int) -> bool:
    """Whether every attention backend takes head dim ``d`` (the models check it at load too)."""
    return MIN_HEAD_DIM <= d <= MAX_HEAD_DIM and d % 16 == 0


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _expect_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    _expect(t.dtype in allowed, f"{name}.dtype is {t.dtype}; allowed: {', '.join(map(str, allowed))}")


def _expect_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    _expect(tuple(t.shape) == shape, f"{name} has shape {tuple(t.shape)}; expected {shape}")


def _expect_device(**tensors: torch.Tensor) -> None:
    """One device for all: a mismatch names every tensor's device (the first may be the odd one)."""
    first = next(iter(tensors.values())).device
    if any(t.device != first for t in tensors.values()):  # (every kernel call: the message only then)
        where = ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
        raise ValueError(f"the tensors must be on one device; got {where}")


MAX_SPLITS = 16


def check_num_splits(num_splits: object) -> int | None:
    """None (chosen from the batch shape), or a power of two in [1, MAX_SPLITS], as a plain int."""
    if num_splits is None:
        return None
    good = isinstance(num_splits, numbers.Integral) and not isinstance(num_splits, bool)
    if not (good and 1 <= num_splits <= MAX_SPLITS and num_splits & (num_splits - 1) == 0):
        raise ValueError(f"num_splits is {num_splits!r}; allowed: a power of two from 1 to {MAX_SPLITS}")
    return int(num_splits)


# The order programs start in (the same output either way): "heavy-first", a sequence's query blocks
# last (most keys) first, several KV heads' blocks interleaved; "in-order", first block first, one
# KV head after another (the order before heavy-first, kept for benchmarks). A name's index is its
# code in the CUDA kernels' PagedAttentionArgs (csrc/kernels.h, BlockOrder).
BLOCK_ORDERS = ("heavy-first", "in-order")


def check_block_order(block_order: object) -> str:
    _expect(block_order in BLOCK_ORDERS, f"block_order is {block_order!r}; allowed: {', '.join(BLOCK_ORDERS)}")
    return block_order


# The kernels take |softmax_scale| * log2(e) as a float32: beyond this it is inf.
MAX_SOFTMAX_SCALE = float(torch.finfo(torch.float32).max) / math.log2(math.e)


def softmax_scale_or_default(softmax_scale: object, head_dim: int) -> float:
    """``softmax_scale`` as a float (None: head_dim ** -0.5); NaN or inf would make every output NaN."""
    if softmax_scale is None:
        return head_dim**-0.5
    good = isinstance(softmax_scale, numbers.Real) and not isinstance(softmax_scale, bool)
    _expect(
        good and math.isfinite(softmax_scale) and abs(softmax_scale) <= MAX_SOFTMAX_SCALE,
        f"softmax_scale is {softmax_scale!r}; allowed: a finite number of magnitude at most {MAX_SOFTMAX_SCALE:.4g}",
    )
    return float(softmax_scale)


def check_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    out: torch.Tensor | None,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
) -> AttentionDims:
    _expect(q.dim() == 3, f"q must be [num_tokens, Hq, D]; got shape {tuple(q.shape)}")
    _expect(k_cache.dim() == 4, f"k_cache must be [num_pages, page_size, Hkv, D]; got shape {tuple(k_cache.shape)}")
    _expect_shape("v_cache", v_cache, tuple(k_cache.shape))
    _expect_dtype("q", q, dtypes)
    _expect(
        k_cache.dtype == q.dtype and v_cache.dtype == q.dtype,
        f"k_cache/v_cache dtypes ({k_cache.dtype}, {v_cache.dtype}) must equal q.dtype ({q.dtype})",
    )
    num_tokens, hq, d = q.shape
    num_pages, page_size, hkv, dk = k_cache.shape
    _expect(dk == d, f"cache head dim {dk} != q head dim {d}")
    _expect(
        head_dim_supported(d),
        f"head dim {d} is not supported; allowed: multiples of 16 from {MIN_HEAD_DIM} to {MAX_HEAD_DIM}",
    )
    _expect(hkv >= 1 and hq >= hkv and hq % hkv == 0, f"Hq={hq} must be a positive multiple of Hkv={hkv}")
    _expect(page_size >= 1, f"page_size is {page_size}; allowed: any integer >= 1")
    _expect(
        block_tables.dim() == 2, f"block_tables must be [num_seqs, max_pages_per_seq]; got {tuple(block_tables.shape)}"
    )
    _expect_dtype("block_tables", block_tables, (torch.int32,))
    num_seqs, max_pages = block_tables.shape
    _expect_dtype("seq_lens", seq_lens, (torch.int32,))
    _expect_shape("seq_lens", seq_lens, (num_seqs,))
    _expect_dtype("cu_seqlens_q", cu_seqlens_q, (torch.int32,))
    _expect_shape("cu_seqlens_q", cu_seqlens_q, (num_seqs + 1,))
    _expect(
        isinstance(max_seqlen_q, int) and not isinstance(max_seqlen_q, bool) and max_seqlen_q >= 0,
        f"max_seqlen_q must be a host int >= 0; got {max_seqlen_q!r}",
    )
    _expect(q.stride(-1) == 1, f"q's last dim must be contiguous; strides are {q.stride()}")
    _expect(
        k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1,
        f"caches' last dim must be contiguous; strides are {k_cache.stride()} and {v_cache.stride()}",
    )
    _expect(
        block_tables.stride(-1) == 1, f"block_tables' last dim must be contiguous; strides are {block_tables.stride()}"
    )
    _expect(
        seq_lens.is_contiguous() and cu_seqlens_q.is_contiguous(),
        "seq_lens and cu_seqlens_q must be contiguous",
    )
    tensors = dict(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q
    )
    if out is not None:
        _expect_shape("out", out, tuple(q.shape))
        _expect(out.dtype == q.dtype, f"out.dtype is {out.dtype}; expected q.dtype {q.dtype}")
        _expect(out.stride(-1) == 1, f"out's last dim must be contiguous; strides are {out.stride()}")
        tensors["out"] = out
    _expect_device(**tensors)
    return AttentionDims(num_tokens, hq, hkv, d, num_pages, page_size, num_seqs, max_pages)


def check_paged_attention_values(
    dims: AttentionDims,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
) -> None:
    """The value rules of the contract (host sync): run in debug mode and in tests."""
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    _expect(cu[0] == 0, f"cu_seqlens_q[0] is {cu[0]}; expected 0")
    _expect(cu[-1] <= dims.num_tokens, f"cu_seqlens_q[-1] is {cu[-1]}; allowed: <= num_tokens {dims.num_tokens}")
    for b, seq_len in enumerate(lens):
        q_len = cu[b + 1] - cu[b]
        _expect(q_len >= 0, f"cu_seqlens_q must be non-decreasing; q_len of sequence {b} is {q_len}")
        _expect(q_len <= max_seqlen_q, f"q_len {q_len} of sequence {b} exceeds max_seqlen_q {max_seqlen_q}")
        cap = dims.max_pages_per_seq * dims.page_size
        _expect(
            q_len <= seq_len <= cap,
            f"seq_lens[{b}] is {seq_len}; allowed: q_len {q_len} to max_pages_per_seq * page_size {cap}",
        )
        n_pages = -(-seq_len // dims.page_size)
        pages = block_tables[b, :n_pages]
        if n_pages:
            lo, hi = int(pages.min()), int(pages.max())
            _expect(
                lo >= 0 and hi < dims.num_pages,
                f"block_tables[{b}] uses page ids {lo}..{hi}; allowed: 0..{dims.num_pages - 1}",
            )


def check_store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
) -> None:
    _expect(k.dim() == 3, f"k must be [num_tokens, Hkv, D]; got shape {tuple(k.shape)}")
    _expect_shape("v", v, tuple(k.shape))
    _expect(k_cache.dim() == 4, f"k_cache must be [num_pages, page_size, Hkv, D]; got shape {tuple(k_cache.shape)}")
    _expect_shape("v_cache", v_cache, tuple(k_cache.shape))
    _expect(
        tuple(k.shape[1:]) == tuple(k_cache.shape[2:]),
        f"k's [Hkv, D] {tuple(k.shape[1:])} must match the cache's {tuple(k_cache.shape[2:])}",
    )
    _expect_dtype("k_cache", k_cache, dtypes)
    for name, t in (("k", k), ("v", v), ("v_cache", v_cache)):
        _expect(t.dtype == k_cache.dtype, f"{name}.dtype is {t.dtype}; expected the cache dtype {k_cache.dtype}")
    _expect(k_cache.shape[1] >= 1, f"page_size is {k_cache.shape[1]}; allowed: any integer >= 1")
    _expect(min(k.shape[1:]) >= 1, f"k's [Hkv, D] is {tuple(k.shape[1:])}; allowed: each >= 1")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        _expect(t.stride(-1) == 1, f"{name}'s last dim must be contiguous; strides are {t.stride()}")
    _expect_dtype("slot_mapping", slot_mapping, (torch.int64,))
    _expect_shape("slot_mapping", slot_mapping, (k.shape[0],))
    _expect(slot_mapping.is_contiguous(), f"slot_mapping must be contiguous; its stride is {slot_mapping.stride(0)}")
    _expect_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)


def check_store_kv_values(k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    capacity = k_cache.shape[0] * k_cache.shape[1]
    if slot_mapping.numel():
        hi = int(slot_mapping.max())
        _expect(
            hi < capacity,
            f"slot_mapping holds slot {hi}; allowed: < num_pages * page_size = {capacity} (or < 0 to skip)",
        )
    used = slot_mapping[slot_mapping >= 0]
    _expect(used.unique().numel() == used.numel(), "slot_mapping writes one slot twice")


def check_gather_input_ids(
    prefill_ids: torch.Tensor,
    token_buffer: torch.Tensor,
    decode_indices: torch.Tensor,
    out: torch.Tensor | None,
    host_prefill_ok: bool = False,
) -> int:
    """``host_prefill_ok``: the backend can read ``prefill_ids`` from pinned host memory."""
    for name, t in (("prefill_ids", prefill_ids), ("token_buffer", token_buffer), ("decode_indices", decode_indices)):
        _expect(t.dim() == 1, f"{name} must be 1-D; got shape {tuple(t.shape)}")
    _expect_dtype("prefill_ids", prefill_ids, ID_DTYPES)
    _expect(
        token_buffer.dtype == prefill_ids.dtype,
        f"token_buffer.dtype {token_buffer.dtype} must equal prefill_ids.dtype {prefill_ids.dtype}",
    )
    _expect_dtype("decode_indices", decode_indices, ID_DTYPES)
    total = prefill_ids.numel() + decode_indices.numel()
    tensors = dict(token_buffer=token_buffer, decode_indices=decode_indices)
    if out is not None:
        _expect_shape("out", out, (total,))
        _expect(out.dtype == prefill_ids.dtype, f"out.dtype is {out.dtype}; expected {prefill_ids.dtype}")
        tensors["out"] = out
    if host_prefill_ok and prefill_ids.device.type == "cpu" and token_buffer.device.type != "cpu":
        _expect(prefill_ids.is_pinned(), "prefill_ids on the host must be in pinned memory (tensor.pin_memory())")
    else:
        tensors["prefill_ids"] = prefill_ids
    _expect_device(**tensors)
    return total


def check_gather_input_ids_values(token_buffer: torch.Tensor, decode_indices: torch.Tensor) -> None:
    if decode_indices.numel():
        lo, hi = int(decode_indices.min()), int(decode_indices.max())
        _expect(
            lo >= 0 and hi < token_buffer.numel(),
            f"decode_indices span {lo}..{hi}; allowed: 0..{token_buffer.numel() - 1}",
        )
