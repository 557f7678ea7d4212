"""Build paged-attention inputs for tests and benchmarks.

``make_paged_batch`` lays a batch of sequences out in a paged KV cache the way an engine does:
pages scattered at random, K and V as views of one ``[num_pages, 2, page_size, Hkv, D]`` tensor
(or two separate tensors), and, with ``poison=True``, every cache slot a kernel must never read
(unused pages, the tail of each sequence's last page) set to NaN and every unused block-table
entry set to a page id past the end of the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Block-table filler for entries past a sequence's last page: far outside any cache.
OUT_OF_RANGE_PAGE = 2**30


@dataclass
class PagedBatch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    q_lens: list[int]
    seq_lens_host: list[int]

    def args(self) -> tuple:
        """Positional arguments of ``paged_attention`` for this batch."""
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.cu_seqlens_q,
            self.max_seqlen_q,
        )

    def to_float64(self) -> tuple:
        """The same arguments with q and the caches upcast to float64 (for references)."""
        return (self.q.double(), self.k_cache.double(), self.v_cache.double(), *self.args()[3:])


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
    kv_views: bool = True,
    spare_pages: int = 3,
    extra_table_cols: int = 2,
    poison: bool = True,
    first_page: int = 0,
    num_tokens: int | None = None,
    generator: torch.Generator | None = None,
) -> PagedBatch:
    """A batch where sequence b has ``q_lens[b]`` new tokens and ``seq_lens[b]`` KV tokens.

    ``first_page`` places every used page at or after that page id (to reach large offsets);
    ``num_tokens`` > sum(q_lens) adds padding query rows past the last sequence.
    """
    if len(q_lens) != len(seq_lens):
        raise ValueError(f"{len(q_lens)} q_lens but {len(seq_lens)} seq_lens")
    for q_len, seq_len in zip(q_lens, seq_lens, strict=True):
        if not 0 <= q_len <= seq_len:
            raise ValueError(f"q_len {q_len} must be in [0, seq_len {seq_len}]")
    device = torch.device(device)
    pages_per_seq = [-(-s // page_size) for s in seq_lens]
    used = sum(pages_per_seq)
    num_pages = first_page + used + spare_pages
    shape = (num_pages, page_size, num_kv_heads, head_dim)

    def randn(*size: int) -> torch.Tensor:
        # drawn on the device itself unless a (CPU) generator is given: a benchmark's batch of 128
        # sequences x 2k tokens is a second or two of CPU time, per batch, on the host
        where = "cpu" if generator is not None else device
        return torch.randn(*size, generator=generator, dtype=torch.float32, device=where).to(device=device, dtype=dtype)

    if kv_views:
        kv = torch.empty((num_pages, 2, *shape[1:]), dtype=dtype, device=device)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    else:
        k_cache = torch.empty(shape, dtype=dtype, device=device)
        v_cache = torch.empty(shape, dtype=dtype, device=device)
    fill = float("nan") if poison else 0.0
    k_cache.fill_(fill)
    v_cache.fill_(fill)

    order = torch.randperm(used + spare_pages, generator=generator)[:used] + first_page
    max_pages = max(pages_per_seq, default=0) + extra_table_cols
    block_tables = torch.full((len(seq_lens), max_pages), OUT_OF_RANGE_PAGE, dtype=torch.int32)
    start = 0
    for b, (n, seq_len) in enumerate(zip(pages_per_seq, seq_lens, strict=True)):
        pages = order[start : start + n]
        start += n
        block_tables[b, :n] = pages.to(torch.int32)
        pages = pages.to(device)
        # write seq_len tokens; the tail of the last page keeps its poison
        k_flat = randn(n * page_size, num_kv_heads, head_dim)
        v_flat = randn(n * page_size, num_kv_heads, head_dim)
        k_flat[seq_len:] = fill
        v_flat[seq_len:] = fill
        k_cache[pages] = k_flat.view(n, page_size, num_kv_heads, head_dim)
        v_cache[pages] = v_flat.view(n, page_size, num_kv_heads, head_dim)

    total_q = sum(q_lens)
    num_tokens = total_q if num_tokens is None else num_tokens
    if num_tokens < total_q:
        raise ValueError(f"num_tokens {num_tokens} < sum(q_lens) {total_q}")
    cu = [0]
    for q_len in q_lens:
        cu.append(cu[-1] + q_len)
    return PagedBatch(
        q=randn(num_tokens, num_q_heads, head_dim),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        max_seqlen_q=max(q_lens, default=0),
        q_lens=list(q_lens),
        seq_lens_host=list(seq_lens),
    )


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN if out holds any NaN)."""
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def aligned_rows(t: torch.Tensor, width: int | None = None, align: int = 128) -> torch.Tensor:
    """``t``'s values in a view whose base is ``align``-byte aligned and whose last dim sits in rows
    of ``width`` elements (default: its own size), the padding NaN: what the CUDA kernels' TMA loads
    take (128-byte aligned bases and strides; CPU tensors are only 64-byte aligned)."""
    width = t.shape[-1] if width is None else width
    shape = (*t.shape[:-1], width)
    count, pad = t.numel() // t.shape[-1] * width, align // t.element_size()
    flat = torch.full((count + pad,), float("nan"), dtype=t.dtype, device=t.device)
    skip = (-flat.data_ptr() % align) // t.element_size()
    wide = flat[skip : skip + count].view(shape)
    wide[..., : t.shape[-1]] = t
    return wide[..., : t.shape[-1]]
