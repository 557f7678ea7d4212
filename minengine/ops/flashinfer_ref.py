"""FlashInfer behind our ``paged_attention`` contract, for comparison (GPU only, optional).

Converts block_tables / seq_lens / cu_seqlens_q to FlashInfer's CSR page layout (indptr,
indices, last_page_len), plans once on the host, then ``run`` launches only the kernel, which
is how FlashInfer is meant to be timed. Decode-only batches use its decode wrapper, everything
else its prefill (append) wrapper with a causal mask. A later issue turns this into the
``flashinfer`` backend of ``minengine.ops``.
"""

from __future__ import annotations

import torch


def available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def version() -> str | None:
    try:
        import flashinfer

        return getattr(flashinfer, "__version__", "unknown")
    except Exception:
        return None


class FlashInferPagedAttention:
    """Plan for one batch (host sync here), then ``run()`` as often as needed."""

    def __init__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        softmax_scale: float | None = None,
        workspace_bytes: int = 256 * 1024 * 1024,
    ):
        import flashinfer

        device = q.device
        _, page_size, hkv, d = k_cache.shape
        hq = q.shape[1]
        lens = seq_lens.tolist()
        cu = cu_seqlens_q.tolist()
        pages = [-(-n // page_size) for n in lens]
        indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
        tables = block_tables.cpu()
        indices = torch.cat([tables[b, :n] for b, n in enumerate(pages)]).to(torch.int32)
        last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lens, pages, strict=True)], dtype=torch.int32)
        self.q, self.kv = q, (k_cache, v_cache)
        self.decode_only = all(cu[b + 1] - cu[b] == 1 for b in range(len(lens)))
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        scale = softmax_scale if softmax_scale is not None else d**-0.5
        if self.decode_only:
            self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
            self.wrapper.plan(
                indptr.to(device),
                indices.to(device),
                last.to(device),
                hq,
                hkv,
                d,
                page_size,
                sm_scale=scale,
                q_data_type=q.dtype,
                kv_data_type=k_cache.dtype,
            )
        else:
            self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            self.wrapper.plan(
                cu_seqlens_q.to(device),
                indptr.to(device),
                indices.to(device),
                last.to(device),
                hq,
                hkv,
                d,
                page_size,
                causal=True,
                sm_scale=scale,
                q_data_type=q.dtype,
                kv_data_type=k_cache.dtype,
            )

    def run(self) -> torch.Tensor:
        return self.wrapper.run(self.q, self.kv)


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
    **_: object,
) -> torch.Tensor:
    """Our contract through FlashInfer, planned on every call (a host sync): for comparisons."""
    from triton_kernels.contract import check_paged_attention

    check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, out)
    result = FlashInferPagedAttention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, softmax_scale).run()
    if out is None:
        return result
    out.copy_(result)
    return out
