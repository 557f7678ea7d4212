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
Decode steps also run under CUDA graphs, as in vLLM and SGLang: each captured batch-size bucket has
its own decode wrapper in FlashInfer's CUDA-graph mode (fixed batch size, page layout in fixed
device buffers shared by the buckets), and ``graph_bucket`` plans it outside the graph before the
capture and before every replay; the graph replays only the kernels, which read the plan from
those buffers and the wrapper's workspace. Padding sequences of a bucket are planned as one key in
page 0, as SGLang pads (page 0 always exists and holds finite values; an empty sequence could give
NaN rows), and the graph runner discards their rows. Graph mode sizes FlashInfer's split-KV
partials for the whole bucket, so the float workspace grows for the largest bucket where the
default is too small (tensor-core decode of wide GQA groups at large buckets).

FlashInfer's plan writes its schedule into one pinned host buffer per wrapper and copies it to
the device asynchronously; a plan made while the previous plan's copy is still queued (overlap
scheduling: step N + 1 is planned while step N runs) would overwrite it before it is read. Each
plan therefore waits for the previous plan's copies (an event recorded after them), which the
device has almost always executed by then.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import weakref
from collections.abc import Iterator

import torch

from minengine.memory.kv_pool import to_device_packed
from minengine.ops import HostMetadata
from triton_kernels.contract import softmax_scale_or_default

logger = logging.getLogger(__name__)
WORKSPACE_BYTES = 256 * 1024 * 1024  # FlashInfer's float workspace (split-KV partials), as in vLLM
# Fixed buffers of FlashInfer's prefill wrapper on its fa3 path (sm_90), filled without bounds
# checks: one int32 per key of the batch, one per sequence.
PREFILL_MAX_KV_TOKENS = 16 * 1024 * 1024
PREFILL_MAX_SEQS = 32768
WRAPPER_INT_WORKSPACE_BYTES = 8 * 1024 * 1024  # what each FlashInfer wrapper allocates for its plan
MAX_BLOCKS_PER_SM = 32  # resident thread blocks per SM (sm_80 and sm_90): bounds a decode grid


def graph_workspace_bytes(bucket: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, num_sms: int) -> int:
    """The float workspace a graph-mode decode plan of ``bucket`` sequences takes at most (its split-KV
    partials, float32 values and sums), as FlashInfer 0.5's schedulers size it. Graph mode sizes them
    for the bucket, not the batch: on tensor cores (groups above 4: the prefill scheduler, split-KV
    always on) a 16-row tile per CTA over ceil(bucket * group / 16) + bucket - 1 tiles, or two CTAs per
    SM per KV head if more; on CUDA cores one row per CTA of the largest grid (at most one per
    resident block slot, per KV head) or the bucket."""
    group = num_qo_heads // num_kv_heads
    if group > 4:
        tile = 128 if group > 64 and head_dim < 256 else 64 if group > 16 else 16  # FA2DetermineCtaTileQ
        rows = max(2 * num_sms // num_kv_heads, -(-bucket * group // tile) + bucket - 1) * tile
    else:
        rows = max(bucket, MAX_BLOCKS_PER_SM * num_sms // num_kv_heads)
    return 4 * num_qo_heads * rows * (head_dim + 1) + 1024  # + the 16-byte alignment of each part


def device_bytes(
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_sms: int,
    graph_buckets: list[int],
    max_pages_per_request: int,
) -> int:
    """Device memory the backend allocates besides the KV cache, for the engine's budget: the float
    workspace (grown for the largest graph bucket where it needs more), the eager wrappers' plan
    workspaces and the prefill wrapper's fixed buffers, and per graph bucket a plan workspace, plus
    the page-layout buffers the buckets share (indptr, last_page_len, and indices for every page of
    the largest bucket)."""
    largest = max(graph_buckets, default=0)
    workspace = WORKSPACE_BYTES
    if largest:
        workspace = max(workspace, graph_workspace_bytes(largest, num_qo_heads, num_kv_heads, head_dim, num_sms))
    eager = 2 * WRAPPER_INT_WORKSPACE_BYTES + 4 * (PREFILL_MAX_KV_TOKENS + 2 * PREFILL_MAX_SEQS)
    graphs = len(graph_buckets) * WRAPPER_INT_WORKSPACE_BYTES
    if largest:
        graphs += 4 * (2 * largest + 1 + largest * max_pages_per_request)
    return workspace + eager + graphs


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
        # CUDA graphs: a decode wrapper per bucket, the page-layout buffers they share, each bucket's
        # plan key, and while inside graph_bucket: (bucket, metadata or None) and whether it is planned
        self._graph_wrappers: dict[int, object] = {}
        self._graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._graph_keys: dict[int, tuple] = {}
        self._graph: tuple[int, tuple | None] | None = None
        self._graph_planned = False
        self.graph_plans = 0  # plans of CUDA-graph buckets

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
        if kind == "graph":  # one per bucket, in CUDA-graph mode: its batch size is that of its buffers
            bucket = self._graph[0]
            if bucket not in self._graph_wrappers:
                indptr, indices, last = self._graph_buffers
                self._graph_wrappers[bucket] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace,
                    "NHD",
                    use_cuda_graph=True,
                    use_tensor_cores=group > 4,
                    paged_kv_indptr_buffer=indptr[: bucket + 1],
                    paged_kv_indices_buffer=indices,
                    paged_kv_last_page_len_buffer=last[:bucket],
                )
            return self._graph_wrappers[bucket]
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

    @staticmethod
    def _plan_key(q: torch.Tensor, k_cache: torch.Tensor, softmax_scale: float | None) -> tuple:
        """What a plan depends on besides the batch: (device, q dtype, kv dtype, page size, kv heads,
        head dim, q heads, scale)."""
        _, page_size, hkv, d = k_cache.shape
        scale = softmax_scale_or_default(softmax_scale, d)  # (checked as our kernels check it)
        return (q.device, q.dtype, k_cache.dtype, page_size, hkv, d, q.shape[1], scale)

    def _staged_for(self, metadata: tuple[torch.Tensor, ...]) -> HostMetadata | None:
        if self._staged is not None and self._same(metadata, self._staged[0]):
            return self._staged[1]
        return None

    def _planning(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Around a plan on a GPU: wait for the last plan's copies (they read pinned buffers this plan
        rewrites), and record when this plan's copies are done."""
        if device.type != "cuda":
            return contextlib.nullcontext()
        if self._planned is None:
            self._planned = torch.cuda.Event()
        self._planned.synchronize()

        @contextlib.contextmanager
        def record() -> Iterator[None]:
            yield
            self._planned.record(torch.cuda.current_stream(device))

        return record()

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
        key = self._plan_key(q, k_cache, softmax_scale)
        _, _, _, page_size, hkv, d, hq, scale = key
        metadata = (block_tables, seq_lens, cu_seqlens_q)
        if key == self._key and self._same(metadata, self._metadata):
            return
        pin = q.device.type == "cuda"
        host = self._staged_for(metadata)
        if host is not None:
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
        with self._planning(q.device):
            if decode_only:
                wrapper.plan(indptr, indices, last, hq, hkv, d, page_size, **common)
            else:  # seq_lens pinned: its copy inside plan is asynchronous too
                qo, kv_lens = _host_int32(cu, pin), _host_int32(lens, pin)
                wrapper.plan(qo, indptr, indices, last, hq, hkv, d, page_size, causal=True, seq_lens=kv_lens, **common)
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
        # The engine's q is a view of its merged q/k/v projection (rows strided). FlashInfer's FA2
        # kernels read q's strides, but not every path behind its wrappers does: one small copy.
        q = q.contiguous()
        if self._graph is not None:
            result = self._graph_run(q, k_cache, v_cache, softmax_scale)
        else:
            self.plan(q, k_cache, block_tables, seq_lens, cu_seqlens_q, softmax_scale)
            result = self.run(q, k_cache, v_cache)
        if out is None:
            return result
        out.copy_(result)
        return out

    # --- CUDA graphs ------------------------------------------------------------------------

    @contextlib.contextmanager
    def graph_bucket(
        self, bucket: int, block_tables: torch.Tensor, metadata: tuple[torch.Tensor, ...] | None
    ) -> Iterator[None]:
        """Inside, every call runs the CUDA-graph decode wrapper of ``bucket`` (a decode batch padded to
        ``bucket`` rows) with no plan of its own. ``block_tables`` is the graph runner's static table
        (rows: the largest bucket; columns: pages per request), which sizes the shared buffers;
        ``metadata`` (block_tables, seq_lens, cu_seqlens_q) is the real decode batch, its first rows
        (None: a capture, every row padding). The plan is made on entry when the bucket was planned
        before, else at the first call (a capture's warm-up run, outside the graph). A graph replays
        the plan its bucket has at that moment: enter this before each replay."""
        if self._graph is not None:
            raise RuntimeError("flashinfer: graph_bucket entered twice")
        rows, max_pages = block_tables.shape
        if not 1 <= bucket <= rows:
            raise ValueError(f"flashinfer: bucket {bucket}; allowed: 1..{rows} (rows of the graph runner's table)")
        if self._graph_buffers is None:
            device = block_tables.device
            self._graph_buffers = (
                torch.zeros(rows + 1, dtype=torch.int32, device=device),
                torch.zeros(rows * max_pages, dtype=torch.int32, device=device),
                torch.zeros(rows, dtype=torch.int32, device=device),
            )
        elif self._graph_buffers[1].numel() != rows * max_pages or self._graph_buffers[2].numel() != rows:
            raise RuntimeError(f"flashinfer: graph buckets of a {rows} x {max_pages} table after another's")
        self._graph, self._graph_planned = (bucket, metadata), False
        try:
            if bucket in self._graph_keys:
                self._plan_graph(self._graph_keys[bucket])
            yield
        finally:
            self._graph = None

    def _fit_workspace(self, bucket: int, hq: int, hkv: int, d: int, device: torch.device) -> None:
        """Grow the float workspace to what a graph plan of ``bucket`` takes, before any graph wrapper
        holds it (buckets are planned largest first; a grown workspace also replaces the eager
        wrappers, which are made again on their next plan)."""
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        needed = graph_workspace_bytes(bucket, hq, hkv, d, num_sms)
        if needed <= self.workspace_bytes:
            return
        if self._graph_wrappers:
            raise RuntimeError(
                f"flashinfer: graph bucket {bucket} needs a {needed} byte workspace after graph buckets were made "
                f"with {self.workspace_bytes} bytes; plan the largest bucket first"
            )
        self.workspace_bytes, self.workspace, self.wrappers, self._key = needed, None, {}, None

    def _graph_run(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, softmax_scale: float | None
    ) -> torch.Tensor:
        bucket = self._graph[0]
        key = self._plan_key(q, k_cache, softmax_scale)
        if q.shape[0] != bucket:
            raise ValueError(f"flashinfer: {q.shape[0]} query rows in graph bucket {bucket}; allowed: {bucket}")
        if not self._graph_planned:
            if q.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"flashinfer: graph bucket {bucket} captured before a warm-up run planned it")
            self._plan_graph(key)
        elif key != self._graph_keys[bucket]:
            raise ValueError(f"flashinfer: graph bucket {bucket} was planned for {self._graph_keys[bucket]}, not {key}")
        return self._graph_wrappers[bucket].run(q, (k_cache, v_cache))

    def _plan_graph(self, key: tuple) -> None:
        """Plan the current bucket's wrapper: the real sequences of the metadata (from its staged host
        copy, else read back), then padding sequences of one key in page 0 up to the bucket."""
        device, q_dtype, kv_dtype, page_size, hkv, d, hq, scale = key
        bucket, metadata = self._graph
        if bucket not in self._graph_wrappers:  # its first plan: the workspace it will hold must fit
            self._fit_workspace(bucket, hq, hkv, d, device)
        lens, cu = [], [0]
        if metadata is not None:
            host = self._staged_for(metadata)
            if host is not None:
                lens, cu = host.seq_lens, host.cu_seqlens_q
                self.host_plans += 1
            else:  # not staged: read the metadata back (a sync)
                lens, cu = metadata[1].tolist(), metadata[2].tolist()
            if cu != list(range(len(lens) + 1)) or len(lens) > bucket:
                q_lens = [b - a for a, b in itertools.pairwise(cu)]
                raise ValueError(
                    f"flashinfer: graph bucket {bucket} got query lengths {q_lens}; "
                    f"allowed: at most {bucket} sequences of one query token"
                )
        indptr, indices, last = [0], None, []
        if lens:
            indptr, indices, last = csr_from_host(HostMetadata(lens, cu), metadata[0], page_size)
        pad = bucket - len(lens)
        indptr = indptr + [indptr[-1] + i for i in range(1, pad + 1)]
        last = last + [1] * pad
        zeros = torch.zeros(pad, dtype=torch.int32, device=device)
        indices = zeros if indices is None else torch.cat([indices, zeros])
        wrapper = self._wrapper_for("graph", hq // hkv, device)
        pin = device.type == "cuda"
        with self._planning(device):
            wrapper.plan(
                _host_int32(indptr, pin), indices, _host_int32(last, pin), hq, hkv, d, page_size,
                sm_scale=scale, q_data_type=q_dtype, kv_data_type=kv_dtype,
            )  # fmt: skip
        self._graph_keys[bucket], self._graph_planned = key, True
        self.plans += 1
        self.graph_plans += 1


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


class FlashInferPOD:
    """One mixed batch through FlashInfer's POD-Attention (``BatchPODWithPagedKVCacheWrapper``: the
    prefill chunks and the decodes of a batch in one launch, sharing the SMs), planned at construction
    (a host sync), then ``run()``: the benchmarks' other FlashInfer baseline for mixed batches, where
    it applies (at least one chunk of several tokens and one decode). Sequences with more than one
    query token go to its prefill half (causal, bottom-right aligned as in our contract), those with
    one to its decode half; their query rows are views when the chunks come first (the engine's order),
    else gathered here once. ``run`` returns FlashInfer's two outputs as they come, ``output`` ours in
    our row order (rows past the batch's tokens zero)."""

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
        import flashinfer

        _, page_size, hkv, d = k_cache.shape
        cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
        q_lens = [b - a for a, b in itertools.pairwise(cu)]
        parts = [[i for i, n in enumerate(q_lens) if n > 1], [i for i, n in enumerate(q_lens) if n == 1]]
        if not all(parts):
            raise ValueError(f"POD needs a chunk of several tokens and a decode; query lengths {q_lens}")
        layouts, rows = [], []
        for seqs in parts:
            index = torch.tensor(seqs, dtype=torch.int64)
            sub_lens = torch.tensor([lens[i] for i in seqs], dtype=torch.int32)
            indptr, indices, last = csr_pages(block_tables.cpu()[index], sub_lens, page_size)
            qo = torch.tensor([0, *itertools.accumulate(q_lens[i] for i in seqs)], dtype=torch.int32)
            layouts.append((qo, indptr.to(q.device), indices.to(q.device), last))
            rows.append(torch.cat([torch.arange(cu[i], cu[i + 1]) for i in seqs]))
        self.rows_p, self.rows_d = (r.to(q.device) for r in rows)
        contiguous = torch.equal(torch.cat(rows), torch.arange(cu[-1]))
        n_p = len(rows[0])
        self.q_p, self.q_d = (q[:n_p], q[n_p : cu[-1]]) if contiguous else (q[self.rows_p], q[self.rows_d])
        self.kv = (k_cache, v_cache)
        self.q = q
        workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=q.device)
        self.wrapper = flashinfer.BatchPODWithPagedKVCacheWrapper(workspace, "NHD")
        self.wrapper.plan(
            *layouts[0], *layouts[1], q.shape[1], hkv, d, page_size,
            q_data_type=q.dtype, kv_data_type=k_cache.dtype,
            sm_scale=softmax_scale if softmax_scale is not None else d**-0.5,
        )  # fmt: skip

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(prefill output, decode output), as FlashInfer returns them."""
        return self.wrapper.run(self.q_p, self.kv, self.q_d, self.kv, causal_p=True)

    def output(self) -> torch.Tensor:
        out_p, out_d = self.run()
        out = torch.zeros_like(self.q)
        out[self.rows_p] = out_p
        out[self.rows_d] = out_d
        return out
