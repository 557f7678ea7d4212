"""FlashInfer behind our ``paged_attention`` contract (GPU only, optional import): the engine's
``flashinfer`` backend and the benchmarks' comparison.

Our metadata (block_tables, seq_lens, cu_seqlens_q) becomes FlashInfer's CSR page layout
(indptr, indices, last_page_len) on the host, and a wrapper is planned with it: the decode wrapper
when every sequence has one query token, else the prefill (append) wrapper with a causal mask.
``run`` launches only the kernel, which is how FlashInfer is meant to be timed and used.

The engine backend (``FlashInferBackend``) keeps one workspace and one wrapper of each kind per
device and plans once per forward step, as vLLM and SGLang do: every layer of a step passes the
same metadata tensors, so the first layer's call plans and the others reuse the plan. Planning
reads the metadata back to the host (one device sync per step), so this backend gains nothing
from overlap scheduling, and it runs eagerly (no CUDA graphs: the engine captures only backends
without host work).
"""

from __future__ import annotations

import weakref

import torch

WORKSPACE_BYTES = 256 * 1024 * 1024  # FlashInfer's float workspace (split-KV partials), as in vLLM


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


def csr_pages(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's page layout of a batch, on the host: ``indptr`` [B + 1] (sequence b's pages are
    ``indices[indptr[b]:indptr[b + 1]]``), ``indices`` (the first ceil(seq_len / page_size) entries
    of each block-table row) and ``last_page_len`` [B] (keys in each sequence's last page; 0 for
    an empty sequence). All int32."""
    lens = seq_lens.cpu().to(torch.int64)
    tables = block_tables.cpu()
    pages = (lens + page_size - 1) // page_size
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int64)
    indptr[1:] = pages.cumsum(0)
    used = torch.arange(tables.shape[1]) < pages[:, None]
    indices = tables[used]  # row-major: sequence by sequence, pages in order
    last = torch.where(pages > 0, lens - (pages - 1) * page_size, 0)
    return indptr.to(torch.int32), indices.to(torch.int32), last.to(torch.int32)


class FlashInferBackend:
    """``paged_attention`` through FlashInfer for one device: one workspace, a decode and a prefill
    wrapper made on first use, and a plan made once per distinct batch (the same metadata tensor
    objects, unmodified since, reuse it)."""

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES):
        self.workspace_bytes = workspace_bytes
        self.workspace: torch.Tensor | None = None
        self.wrappers: dict[object, object] = {}  # "prefill", ("decode", tensor cores)
        self.plans = 0  # plans made (the engine makes one per forward step)
        self._key: tuple | None = None  # what the current plan was made for
        self._metadata: tuple = ()  # weak references to its metadata tensors, with their versions
        self._wrapper = None
        self._rows = 0  # query rows the plan covers (cu_seqlens_q[-1]); rows past it are padding

    def _wrapper_for(self, kind: str, group: int, device: torch.device):
        """The decode wrapper (on tensor cores for GQA groups above 4, as vLLM does: FlashInfer's
        CUDA-core decode takes only groups 1, 2, 3, 4, 6 and 8) or the prefill wrapper."""
        import flashinfer

        if self.workspace is None or self.workspace.device != device:
            # FlashInfer wants its float workspace zeroed before first use
            self.workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
            self.wrappers = {}
        if kind == "decode":
            key = ("decode", group > 4)
            if key not in self.wrappers:
                self.wrappers[key] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_tensor_cores=group > 4
                )
            return self.wrappers[key]
        if "prefill" not in self.wrappers:
            self.wrappers["prefill"] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        return self.wrappers["prefill"]

    def _planned_for(self, key: tuple, metadata: tuple[torch.Tensor, ...]) -> bool:
        """Whether the current plan is for these metadata tensor objects, unchanged since (by their
        version counters: writes through raw pointers, outside torch, are not seen)."""
        if key != self._key or len(metadata) != len(self._metadata):
            return False
        return all(ref() is t and t._version == v for t, (ref, v) in zip(metadata, self._metadata, strict=True))

    def plan(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        softmax_scale: float | None = None,
    ) -> None:
        """Plan for this batch unless the current plan is for it already (a device sync when it plans)."""
        _, page_size, hkv, d = k_cache.shape
        hq = q.shape[1]
        scale = softmax_scale if softmax_scale is not None else d**-0.5
        key = (q.device, q.dtype, k_cache.dtype, page_size, hkv, d, hq, scale)
        metadata = (block_tables, seq_lens, cu_seqlens_q)
        if self._planned_for(key, metadata):
            return
        cu = cu_seqlens_q.cpu()
        indptr, indices, last = csr_pages(block_tables, seq_lens, page_size)  # host: plan reads them there
        decode_only = bool(((cu[1:] - cu[:-1]) == 1).all())
        wrapper = self._wrapper_for("decode" if decode_only else "prefill", hq // hkv, q.device)
        common = dict(sm_scale=scale, q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        if decode_only:
            wrapper.plan(indptr, indices, last, hq, hkv, d, page_size, **common)
        else:
            wrapper.plan(cu.to(torch.int32), indptr, indices, last, hq, hkv, d, page_size, causal=True, **common)
        self._wrapper, self._rows = wrapper, int(cu[-1])
        # tensors made in inference mode keep no version counter: plan again on every call for them
        cacheable = not any(t.is_inference() for t in metadata)
        self._metadata = tuple((weakref.ref(t), t._version) for t in metadata) if cacheable else ()
        self._key = key if cacheable else None
        self.plans += 1

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """The planned batch's attention; rows past the plan's tokens (padding) are zeros."""
        if q.shape[0] == self._rows:
            return self._wrapper.run(q, (k_cache, v_cache))
        result = torch.zeros_like(q)
        result[: self._rows] = self._wrapper.run(q[: self._rows], (k_cache, v_cache))
        return result

    def __call__(
        self,
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
        """Our ``paged_attention`` contract."""
        from triton_kernels.contract import check_paged_attention

        check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, out)
        self.plan(q, k_cache, block_tables, seq_lens, cu_seqlens_q, softmax_scale)
        result = self.run(q, k_cache, v_cache)
        if out is None:
            return result
        out.copy_(result)
        return out


class FlashInferPagedAttention:
    """One batch, planned at construction (a host sync), then ``run()`` as often as needed: for
    benchmarks and tests."""

    def __init__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        softmax_scale: float | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
    ):
        self.backend = FlashInferBackend(workspace_bytes)
        self.backend.plan(q, k_cache, block_tables, seq_lens, cu_seqlens_q, softmax_scale)
        self.q, self.k_cache, self.v_cache = q, k_cache, v_cache

    def run(self) -> torch.Tensor:
        return self.backend.run(self.q, self.k_cache, self.v_cache)
