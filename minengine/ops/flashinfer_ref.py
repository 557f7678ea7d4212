"""FlashInfer behind our ``paged_attention`` contract (GPU only, optional import): the engine's
``flashinfer`` backend and the benchmarks' comparison.

Our metadata (block_tables, seq_lens, cu_seqlens_q) becomes FlashInfer's CSR page layout
(indptr, indices, last_page_len) on the host, and a wrapper is planned with it: the decode wrapper
when every sequence has one query token, else the prefill (append) wrapper with a causal mask.
``run`` launches only the kernel, which is how FlashInfer is meant to be timed and used.

The engine backend (``FlashInferBackend``) keeps one workspace and one wrapper of each kind per
device and plans once per forward step, as vLLM and SGLang do: every layer of a step passes the
same metadata tensors, so the first layer's call plans and the others reuse the plan. The runner
stages the host lists it built ``seq_lens`` and ``cu_seqlens_q`` from (``stage``): the plan reads
those, and the page indices are gathered from ``block_tables`` on the device (their count is known
on the host), so nothing is read back, no per-page work is done in Python, and the step stays
asynchronous (overlap scheduling works). Metadata nobody staged is copied back instead (a sync).
It runs eagerly: the engine captures CUDA graphs only for backends without host work.

FlashInfer's plan writes its schedule into one pinned host buffer per wrapper and copies it to
the device asynchronously; a plan made while the previous plan's copy is still queued (overlap
scheduling: step N + 1 is planned while step N runs) would overwrite it before it is read. Each
plan therefore waits for the previous plan's copies (an event recorded after them), which the
device has almost always executed by then.
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref

import torch

from minengine.memory.kv_pool import to_device_packed
from minengine.ops import HostMetadata

logger = logging.getLogger(__name__)
WORKSPACE_BYTES = 256 * 1024 * 1024  # FlashInfer's float workspace (split-KV partials), as in vLLM
# Fixed buffers of FlashInfer's prefill wrapper on its fa3 path (sm_90), filled without bounds
# checks: one int32 per key of the batch, one per sequence.
PREFILL_MAX_KV_TOKENS = 16 * 1024 * 1024
PREFILL_MAX_SEQS = 32768


@functools.cache
def available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception as e:
        if not (isinstance(e, ModuleNotFoundError) and e.name == "flashinfer"):  # installed but broken: say why
            logger.warning("flashinfer is installed but does not import: %r", e)
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


def csr_from_host(
    host: HostMetadata, block_tables: torch.Tensor, page_size: int
) -> tuple[list[int], torch.Tensor, list[int]]:
    """``csr_pages`` from staged host metadata without reading the device: ``indptr`` and
    ``last_page_len`` as host lists, ``indices`` gathered from ``block_tables`` where it lives (its
    size is known on the host, so nothing waits for the device)."""
    counts = [-(-length // page_size) for length in host.seq_lens]
    if counts and max(counts) > block_tables.shape[1]:
        b = counts.index(max(counts))
        raise ValueError(
            f"sequence {b}: seq_len {host.seq_lens[b]} needs {counts[b]} pages at page_size {page_size}; "
            f"block_tables has {block_tables.shape[1]} columns"
        )
    indptr = [0, *itertools.accumulate(counts)]
    last = [length - (n - 1) * page_size if n else 0 for n, length in zip(counts, host.seq_lens, strict=True)]
    device = block_tables.device
    counts_t, starts_t = to_device_packed([counts, indptr[:-1]], torch.int64, device)
    seq = torch.repeat_interleave(torch.arange(len(counts), device=device), counts_t, output_size=indptr[-1])
    column = torch.arange(indptr[-1], device=device) - starts_t[seq]
    return indptr, block_tables[seq, column].to(torch.int32), last


def _host_int32(values, pin: bool) -> torch.Tensor:
    """An int32 host tensor, pinned for a GPU plan: FlashInfer's non-blocking copies of it are then
    truly asynchronous, and torch keeps the pinned block until they have run."""
    t = values.to(torch.int32) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int32)
    return t.pin_memory() if pin else t


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
        self._staged: tuple[tuple, HostMetadata] | None = None  # (metadata refs, their host copy)
        self._planned = None  # CUDA event recorded after the last plan's host-to-device copies
        self.host_plans = 0  # plans made from staged host metadata (no device read)
        self._warned = False

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

    @staticmethod
    def _refs(metadata: tuple[torch.Tensor, ...]) -> tuple:
        """Weak references to metadata tensors with their versions; () for tensors made in inference
        mode, which keep no version counter (nothing made from them can be reused)."""
        if any(t.is_inference() for t in metadata):
            return ()
        return tuple((weakref.ref(t), t._version) for t in metadata)

    @staticmethod
    def _same(metadata: tuple[torch.Tensor, ...], refs: tuple) -> bool:
        """Whether ``refs`` are of these tensor objects, unchanged since (by their version counters:
        writes through raw pointers, outside torch, are not seen)."""
        if len(metadata) != len(refs):
            return False
        return all(ref() is t and t._version == v for t, (ref, v) in zip(metadata, refs, strict=True))

    def stage(
        self, block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, host: HostMetadata
    ) -> None:
        """The host lists these metadata tensors were made from: the plan for them reads these."""
        refs = self._refs((block_tables, seq_lens, cu_seqlens_q))
        if not refs and not self._warned:
            logger.warning("flashinfer: metadata made in inference mode cannot be staged; every call will sync")
            self._warned = True
        self._staged = (refs, host) if refs else None

    def plan(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        softmax_scale: float | None = None,
    ) -> None:
        """Plan for this batch unless the current plan is for it already: from the staged host
        metadata when it is for these tensors, else from the tensors read back (a device sync)."""
        _, page_size, hkv, d = k_cache.shape
        hq = q.shape[1]
        scale = softmax_scale if softmax_scale is not None else d**-0.5
        key = (q.device, q.dtype, k_cache.dtype, page_size, hkv, d, hq, scale)
        metadata = (block_tables, seq_lens, cu_seqlens_q)
        if key == self._key and self._same(metadata, self._metadata):
            return
        pin = q.device.type == "cuda"
        if self._staged is not None and self._same(metadata, self._staged[0]):
            host = self._staged[1]
            cu, lens = host.cu_seqlens_q, host.seq_lens
            indptr, indices, last = csr_from_host(host, block_tables, page_size)  # indices: on the device
            indptr, last = _host_int32(indptr, pin), _host_int32(last, pin)
            self.host_plans += 1
        else:  # not staged: read the metadata back (a sync)
            cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
            indptr, indices, last = (_host_int32(x, pin) for x in csr_pages(block_tables, seq_lens, page_size))
        decode_only = all(hi - lo == 1 for lo, hi in zip(cu, cu[1:], strict=False))
        if not decode_only and (sum(lens) > PREFILL_MAX_KV_TOKENS or len(lens) >= PREFILL_MAX_SEQS):
            raise ValueError(
                f"flashinfer: this prefill batch has {len(lens)} sequences and {sum(lens)} keys in all; "
                f"allowed: fewer than {PREFILL_MAX_SEQS} sequences and at most {PREFILL_MAX_KV_TOKENS} keys "
                "(FlashInfer's fixed prefill buffers)"
            )
        wrapper = self._wrapper_for("decode" if decode_only else "prefill", hq // hkv, q.device)
        common = dict(sm_scale=scale, q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        if pin:
            if self._planned is None:
                self._planned = torch.cuda.Event()
            self._planned.synchronize()  # the last plan's copies have read its pinned buffers
        if decode_only:
            wrapper.plan(indptr, indices, last, hq, hkv, d, page_size, **common)
        else:  # seq_lens pinned: its copy inside plan is asynchronous too
            qo, kv_lens = _host_int32(cu, pin), _host_int32(lens, pin)
            wrapper.plan(qo, indptr, indices, last, hq, hkv, d, page_size, causal=True, seq_lens=kv_lens, **common)
        if pin:
            self._planned.record(torch.cuda.current_stream(q.device))
        self._wrapper, self._rows = wrapper, cu[-1]
        self._metadata = self._refs(metadata)
        self._key = key if self._metadata else None
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
