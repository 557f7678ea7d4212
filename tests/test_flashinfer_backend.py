"""The ``flashinfer`` backend's own logic on CPU, with FlashInfer replaced by a stand-in that has the
wrappers' plan/run signatures and computes what FlashInfer computes from the CSR page layout
(float64 torch): our metadata -> (indptr, indices, last_page_len), decode vs prefill wrapper,
one plan per forward step, planning from the runner's staged host metadata, padding rows, and
CUDA-graph decode buckets (FlashInfer's graph mode: fixed batch size, the plan in fixed buffers
that the kernels read at replay) with capture and replay emulated: a replay re-runs the model with
every plan forbidden, as a real replay runs only the kernels. The real FlashInfer runs in the GPU
tests (``test_gpu_kernels.py::test_agrees_with_flashinfer``,
``test_backend_logits.py::test_backend_logits_gpu``, ``test_cuda_graph.py``).
"""

from __future__ import annotations

import contextlib
import random
import sys
import types

import pytest
import torch

from minengine import LLM, SamplingParams
from minengine.cuda_graph import DecodeGraphs
from minengine.ops import HostMetadata, flashinfer_ref, reference
from minengine.ops.testing import make_paged_batch, relative_error


def _attend(q, k, v, visible):
    """q [n, hq, d], k / v [L, hkv, d] (float64), query i sees keys [0, visible(i))."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for i in range(q.shape[0]):
        n = visible(i)
        if n <= 0:
            continue
        kk, vv = k[:n].repeat_interleave(group, 1), v[:n].repeat_interleave(group, 1)  # [n, hq, d]
        s = torch.einsum("hd,khd->hk", q[i], kk) * _Wrapper.scale
        out[i] = torch.einsum("hk,khd->hd", s.softmax(-1), vv)
    return out


class _Wrapper:
    """FlashInfer's paged wrappers as far as the backend uses them, computed in float64."""

    scale = 1.0
    plans: list[str] = []
    runs = 0
    frozen = False  # inside an emulated capture or replay: no plan may be made

    def __init__(self, workspace, layout, use_tensor_cores=False, use_cuda_graph=False, **buffers):
        assert workspace.dtype == torch.uint8 and layout == "NHD" and not workspace.any()  # zeroed
        self.tensor_cores, self.graph = use_tensor_cores, use_cuda_graph
        if use_cuda_graph:  # FlashInfer's checks: the buffers fix the batch size
            self.buffers = [buffers[f"paged_kv_{n}_buffer"] for n in ("indptr", "indices", "last_page_len")]
            assert all(isinstance(t, torch.Tensor) and t.dtype == torch.int32 for t in self.buffers)
            assert len(self.buffers[0]) == len(self.buffers[2]) + 1
        else:
            assert not buffers

    def _plan(self, qo_indptr, indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size, sm_scale):
        assert not _Wrapper.frozen, "a plan inside a CUDA-graph capture or replay"
        for t in (qo_indptr, indptr, last):
            assert t.dtype == torch.int32 and t.device.type == "cpu"  # host: plan reads them there
        assert indices.dtype == torch.int32  # may live on the GPU: plan only moves it there
        if isinstance(self, BatchDecodeWithPagedKVCacheWrapper) and not self.tensor_cores:
            assert num_qo_heads // num_kv_heads in (1, 2, 3, 4, 6, 8), "FlashInfer's CUDA-core decode"
        if self.graph:  # the plan goes into the fixed buffers, which the kernels read when they run
            assert len(last) == len(self.buffers[2]), "FlashInfer: the batch size is fixed in cudagraph mode"
            assert len(indices) <= len(self.buffers[1])
            self.buffers[0].copy_(indptr)
            self.buffers[2].copy_(last)
            self.buffers[1][: len(indices)].copy_(indices)
        else:
            self.indptr, self.indices, self.last = indptr.tolist(), indices.tolist(), last
        self.qo = qo_indptr.tolist()
        self.heads, self.page_size = (num_qo_heads, num_kv_heads, head_dim), page_size
        _Wrapper.scale = sm_scale
        _Wrapper.plans.append(type(self).__name__ + (" (graph)" if self.graph else ""))

    def run(self, q, paged_kv_cache):
        _Wrapper.runs += 1
        k_cache, v_cache = paged_kv_cache
        assert q.shape[0] == self.qo[-1] and tuple(q.shape[1:]) == (self.heads[0], self.heads[2])
        if self.graph:
            indptr, indices, last = (t.tolist() for t in self.buffers)
        else:
            indptr, indices, last = self.indptr, self.indices, self.last
        out = torch.empty(q.shape, dtype=torch.float64)
        for b in range(len(self.qo) - 1):
            pages = indices[indptr[b] : indptr[b + 1]]
            length = (len(pages) - 1) * self.page_size + int(last[b]) if pages else 0
            k = k_cache[pages].flatten(0, 1)[:length].double()
            v = v_cache[pages].flatten(0, 1)[:length].double()
            lo, hi = self.qo[b], self.qo[b + 1]
            n = hi - lo
            out[lo:hi] = _attend(q[lo:hi].double(), k, v, lambda i, n=n, length=length: length - n + i + 1)
        return out.to(q.dtype)


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kw):
        batch = torch.arange(len(last_page_len) + 1, dtype=torch.int32)  # one query row per sequence
        self._plan(batch, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kw_of(kw))


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def plan(
        self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
        head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False, **kw,
    ):  # fmt: skip
        assert causal, "our contract is causal"
        if kw.get("seq_lens") is not None:  # must agree with the page layout
            counts = (paged_kv_indptr[1:] - paged_kv_indptr[:-1]).tolist()
            last = paged_kv_last_page_len.tolist()
            want = [(n - 1) * page_size + x if n else 0 for n, x in zip(counts, last, strict=True)]
            assert kw["seq_lens"].dtype == torch.int32 and kw["seq_lens"].tolist() == want
        args = qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len
        self._plan(*args, num_qo_heads, num_kv_heads, head_dim_qk, page_size, **kw_of(kw))


class BatchPODWithPagedKVCacheWrapper:
    """FlashInfer's POD wrapper: a paged prefill batch (causal when asked) and a paged decode batch,
    planned together, run together, two outputs."""

    def __init__(self, workspace, layout):
        self.halves = [BatchPrefillWithPagedKVCacheWrapper(workspace, layout) for _ in range(2)]

    def plan(self, qo_p, kv_indptr_p, kv_indices_p, last_p, qo_d, kv_indptr_d, kv_indices_d, last_d,
             num_qo_heads, num_kv_heads, head_dim, page_size, **kw):  # fmt: skip
        common = (num_qo_heads, num_kv_heads, head_dim, page_size)
        assert (qo_d[1:] - qo_d[:-1]).eq(1).all(), "one query token per decode"
        self.halves[0].plan(qo_p, kv_indptr_p, kv_indices_p, last_p, *common, causal=True, **kw)
        self.halves[1].plan(qo_d, kv_indptr_d, kv_indices_d, last_d, *common, causal=True, **kw)

    def run(self, q_p, paged_kv_cache_p, q_d, paged_kv_cache_d, causal_p=False):
        assert causal_p, "our contract is causal"
        return self.halves[0].run(q_p, paged_kv_cache_p), self.halves[1].run(q_d, paged_kv_cache_d)


def kw_of(kw):
    assert kw["q_data_type"] in (torch.float16, torch.bfloat16, torch.float32), kw
    return {"sm_scale": kw["sm_scale"]}


@pytest.fixture
def fake_flashinfer(monkeypatch):
    return install_stand_in(monkeypatch)


def install_stand_in(monkeypatch) -> types.ModuleType:
    """The FlashInfer stand-in as ``flashinfer`` (and ``available()`` true) for this test."""
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    module.BatchPODWithPagedKVCacheWrapper = BatchPODWithPagedKVCacheWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(flashinfer_ref, "available", lambda: True)
    _Wrapper.plans, _Wrapper.runs, _Wrapper.frozen = [], 0, False
    return module


def test_csr_pages_layout():
    tables = torch.tensor([[7, 3, 9], [4, 0, 0], [5, 6, 0], [1, 2, 8]], dtype=torch.int32)
    indptr, indices, last = flashinfer_ref.csr_pages(tables, torch.tensor([9, 0, 8, 1], dtype=torch.int32), 4)
    assert indptr.tolist() == [0, 3, 3, 5, 6]
    assert indices.tolist() == [7, 3, 9, 5, 6, 1]
    assert last.tolist() == [1, 0, 4, 1]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32


def host_metadata(batch) -> HostMetadata:
    """The host lists a runner would stage for ``batch``."""
    return HostMetadata(list(batch.seq_lens_host), batch.cu_seqlens_q.tolist())


def test_csr_from_host_matches_csr_pages():
    rng = random.Random()
    for _ in range(20):
        n, page = rng.randint(1, 6), rng.choice([1, 3, 4, 16])
        q_lens = [rng.randint(0, 5) for _ in range(n)]
        kv_lens = [q + rng.choice([0, rng.randint(0, 40)]) for q in q_lens]
        batch = make_paged_batch(q_lens, kv_lens, num_q_heads=2, num_kv_heads=1, head_dim=16, page_size=page,
                                 dtype=torch.float32)  # fmt: skip
        want = flashinfer_ref.csr_pages(batch.block_tables, batch.seq_lens, page)
        indptr, indices, last = flashinfer_ref.csr_from_host(host_metadata(batch), batch.block_tables, page)
        assert [indptr, indices.tolist(), last] == [t.tolist() for t in want], (q_lens, kv_lens, page)
        assert indices.dtype == torch.int32
    tables = torch.zeros(2, 2, dtype=torch.int32)  # 9 keys at page 4 need 3 pages
    with pytest.raises(ValueError, match="sequence 1: seq_len 9 needs 3 pages at page_size 4; block_tables has 2"):
        flashinfer_ref.csr_from_host(HostMetadata([4, 9], [0, 1, 2]), tables, 4)


def test_plans_from_staged_host_metadata(fake_flashinfer, monkeypatch):
    """Staged metadata is planned from without reading the tensors; metadata staged for other
    tensor objects (or for these before an in-place change) is not used."""
    batch = make_paged_batch([3, 1, 2], [10, 6, 2], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4,
                             dtype=torch.float32, num_tokens=8)  # fmt: skip
    backend = flashinfer_ref.FlashInferBackend(workspace_bytes=16)
    _, _, _, tables, lens, cu, _ = batch.args()
    backend.stage(tables, lens, cu, host_metadata(batch))
    with monkeypatch.context() as m:
        m.setattr(flashinfer_ref, "csr_pages", lambda *a: pytest.fail("read the device metadata back"))
        out = backend(*batch.args())
    assert backend.plans == backend.host_plans == 1
    want = reference.paged_attention(*batch.to_float64())
    assert relative_error(out, want) < 1e-5 and not out[6:].any()
    lens.add_(0)  # in place: same object, new version; the staged copy may be stale
    backend(*batch.args())
    assert (backend.plans, backend.host_plans) == (2, 1)
    backend.stage(tables, lens.clone(), cu, host_metadata(batch))  # staged for another tensor
    backend(*batch.args())
    assert (backend.plans, backend.host_plans) == (2, 1)  # the current plan still fits: reused


@pytest.mark.parametrize("decode_only", [True, False])
def test_backend_matches_reference(decode_only, fake_flashinfer):
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    for _ in range(4):
        n = rng.randint(1, 5)
        q_lens = [1] * n if decode_only else [rng.choice([0, 1, 3, 9]) for _ in range(n)]
        kv_lens = [q + rng.choice([0, 2, 17]) for q in q_lens]
        if decode_only:
            kv_lens = [max(1, kv) for kv in kv_lens]
        page = rng.choice([1, 3, 16])
        batch = make_paged_batch(
            q_lens, kv_lens, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=page, dtype=torch.float32,
            device="cpu", num_tokens=sum(q_lens) + 2,
        )  # fmt: skip
        backend = flashinfer_ref.FlashInferBackend(workspace_bytes=16)
        out = torch.full_like(batch.q, float("nan"))
        backend(*batch.args(), out=out)
        want = reference.paged_attention(*batch.to_float64())
        assert relative_error(out, want) < 1e-5, f"seed {seed}, {q_lens}, {kv_lens}, page {page}"
        assert torch.equal(out[sum(q_lens) :], torch.zeros_like(out[sum(q_lens) :]))
        kind = "Decode" if all(n == 1 for n in q_lens) else "Prefill"
        assert _Wrapper.plans[-1] == f"Batch{kind}WithPagedKVCacheWrapper"


def test_decode_wrapper_on_tensor_cores_for_wide_groups(fake_flashinfer):
    """FlashInfer's CUDA-core decode takes GQA groups 1, 2, 3, 4, 6 and 8: groups above 4 go to its
    tensor-core decode (group 5: Qwen3-14B's 40 / 8)."""
    backend = flashinfer_ref.FlashInferBackend(workspace_bytes=16)
    for hq, tensor_cores in ((10, True), (4, False)):
        batch = make_paged_batch([1, 1], [7, 3], num_q_heads=hq, num_kv_heads=2, head_dim=32, page_size=4,
                                 dtype=torch.float32, device="cpu")  # fmt: skip
        out = backend(*batch.args())
        assert relative_error(out, reference.paged_attention(*batch.to_float64())) < 1e-5
        assert backend._wrapper.tensor_cores is tensor_cores


def test_inference_mode_metadata_plans_every_call(fake_flashinfer, caplog):
    """Tensors made in inference mode keep no version counter: no plan reuse, no staging (with a
    warning), still correct."""
    with torch.inference_mode():
        batch = make_paged_batch([3, 1], [10, 6], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4,
                                 dtype=torch.float32, device="cpu")  # fmt: skip
        backend = flashinfer_ref.FlashInferBackend(workspace_bytes=16)
        backend.stage(*batch.args()[3:6], host_metadata(batch))
        for _ in range(3):
            out = backend(*batch.args())
    assert backend.plans == 3 and backend.host_plans == 0
    assert "cannot be staged" in caplog.text
    assert relative_error(out, reference.paged_attention(*batch.to_float64())) < 1e-5


def test_prefill_batch_past_flashinfers_fixed_buffers_is_an_error(fake_flashinfer, monkeypatch):
    """FlashInfer's sm_90 prefill path writes one int32 per key of the batch into a fixed 16M-entry
    buffer without a bounds check (shared prefix pages let the keys of a batch exceed the pool)."""
    monkeypatch.setattr(flashinfer_ref, "PREFILL_MAX_KV_TOKENS", 15)
    backend = flashinfer_ref.FlashInferBackend(workspace_bytes=16)
    small = make_paged_batch([3, 1], [9, 6], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4,
                             dtype=torch.float32, device="cpu")  # fmt: skip
    backend(*small.args())  # 15 keys: at the limit
    big = make_paged_batch([3, 1], [10, 6], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4,
                           dtype=torch.float32, device="cpu")  # fmt: skip
    with pytest.raises(ValueError, match="2 sequences and 16 keys in all; allowed: .* at most 15 keys"):
        backend(*big.args())
    decode = make_paged_batch([1, 1], [10, 6], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4,
                              dtype=torch.float32, device="cpu")  # fmt: skip
    backend(*decode.args())  # the decode wrapper has no such buffer


def test_available_says_why_an_installed_flashinfer_does_not_import(tmp_path, monkeypatch, caplog):
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text("import a_dependency_that_is_missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    flashinfer_ref.available.cache_clear()
    try:
        assert flashinfer_ref.available() is False
        assert "does not import" in caplog.text and "a_dependency_that_is_missing" in caplog.text
    finally:
        flashinfer_ref.available.cache_clear()
        sys.modules.pop("flashinfer", None)


def test_one_plan_per_batch(fake_flashinfer):
    """Every layer of a step passes the same metadata tensors: one plan; new tensors or an in-place
    change of one of them (a CUDA-graph style update) plan again."""
    batch = make_paged_batch([3, 1], [10, 6], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4,
                             dtype=torch.float32, device="cpu")  # fmt: skip
    backend = flashinfer_ref.FlashInferBackend(workspace_bytes=16)
    for _ in range(5):
        backend(*batch.args())
    assert backend.plans == 1
    batch.seq_lens[1] -= 1  # in place: same object, new version
    backend(*batch.args())
    assert backend.plans == 2
    args = list(batch.args())
    args[4] = batch.seq_lens.clone()  # an equal but new tensor
    backend(*args)
    assert backend.plans == 3
    backend(*args, softmax_scale=0.5)
    assert backend.plans == 4


@pytest.mark.parametrize("overlap", [True, False])
def test_engine_runs_on_the_flashinfer_backend(overlap, fake_flashinfer, monkeypatch):
    """The engine on the flashinfer backend: greedy tokens as with the torch backend, one plan per
    forward step (not per layer), every plan from the runner's staged host metadata (never a read
    of the device metadata), overlap scheduling on or off."""
    prompts = [[5, 9, 2, 7, 1, 3], [8, 8, 4], list(range(10, 30))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    config = dict(device="cpu", dtype="float32", page_size=4, chunked_prefill_size=16,
                  disable_overlap_schedule=not overlap)  # fmt: skip
    want = [o.token_ids for o in LLM("tiny", attention_backend="torch", **config).generate(prompts, params)]
    llm = LLM("tiny", attention_backend="flashinfer", **config)
    monkeypatch.setattr(flashinfer_ref, "csr_pages", lambda *a: pytest.fail("read the device metadata back"))
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    backend = llm.engine.runner.kernels.paged_attention
    assert isinstance(backend, flashinfer_ref.FlashInferBackend)
    layers = llm.engine.model_config.num_layers
    assert layers > 1 and 0 < backend.plans == backend.host_plans == len(_Wrapper.plans)
    assert _Wrapper.runs == backend.plans * layers  # each step's plan serves all its layers


def _padded_decode(batch, bucket: int, table_rows: int):
    """What the graph runner passes the model for ``batch`` (decodes) in ``bucket``: its static
    tensors with the batch in the first rows and padding sequences (q_len 0, seq_len 0) after."""
    q, k, v, tables, lens, cu, _ = batch.args()
    static = torch.zeros(table_rows, tables.shape[1] + 1, dtype=torch.int32)
    static[: len(lens), : tables.shape[1]] = tables
    n = len(lens)
    seq_lens = torch.cat([lens, torch.zeros(bucket - n, dtype=torch.int32)])
    cu_q = torch.cat([cu, torch.full((bucket - n,), n, dtype=torch.int32)])
    return static, (q[:bucket], k, v, static[:bucket], seq_lens, cu_q, 1)


def test_graph_bucket_plans_outside_the_graph_with_padding_in_page_0(fake_flashinfer):
    """A decode batch of 3 in the graph bucket of 5: the bucket's own wrapper in FlashInfer's graph
    mode is planned with the 3 sequences (from the staged host metadata) and 2 padding sequences of
    one key in page 0; calls inside run it without planning, and once the bucket has been planned
    each entry plans (a replay runs no Python)."""
    page = 4
    batch = make_paged_batch([1, 1, 1], [10, 3, 17], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=page,
                             dtype=torch.float32, num_tokens=5)  # fmt: skip
    _, _, _, tables, lens, cu, _ = batch.args()
    static, args = _padded_decode(batch, 5, table_rows=8)
    backend = flashinfer_ref.FlashInferBackend(workspace_bytes=16)
    backend.stage(tables, lens, cu, host_metadata(batch))
    want = reference.paged_attention(*batch.to_float64())
    with backend.graph_bucket(5, static, (tables, lens, cu)):
        assert backend.graph_plans == 0  # the bucket's plan key is learnt at its first call
        first = backend(*args)
        second = backend(*args)
    assert (backend.plans, backend.graph_plans, backend.host_plans) == (1, 1, 1)
    assert _Wrapper.plans == ["BatchDecodeWithPagedKVCacheWrapper (graph)"] and _Wrapper.runs == 2
    for out in (first, second):
        assert out.shape[0] == 5 and relative_error(out[:3], want[:3]) < 1e-5
    indptr, indices, last = (t.tolist() for t in backend._graph_wrappers[5].buffers)
    assert indptr == [0, 3, 4, 9, 10, 11] and last == [2, 3, 1, 1, 1] and indices[9:11] == [0, 0]
    assert indices[:9] == tables[0, :3].tolist() + tables[1, :1].tolist() + tables[2, :5].tolist()

    with backend.graph_bucket(5, static, (tables, lens, cu)):  # planned on entry: a replay may follow
        assert backend.graph_plans == 2
        _Wrapper.frozen = True
        try:
            assert relative_error(backend(*args)[:3], want[:3]) < 1e-5
        finally:
            _Wrapper.frozen = False
        with pytest.raises(ValueError, match="4 query rows in graph bucket 5; allowed: 5"):
            backend(args[0][:4], *args[1:3], static[:4], args[4][:4], args[5][:5], 1)
        with pytest.raises(RuntimeError, match="entered twice"), backend.graph_bucket(5, static, None):
            pass
    assert backend._graph is None

    with backend.graph_bucket(2, static, None):  # a capture: every sequence is padding
        empty = torch.zeros(3, dtype=torch.int32)
        backend(args[0][:2], *args[1:3], static[:2], empty[:2], empty, 1)
    indptr, _, last = (t.tolist() for t in backend._graph_wrappers[2].buffers)
    assert indptr == [0, 1, 2] and last == [1, 1]
    assert backend.host_plans == 2  # a capture plans from nothing staged, and reads nothing back

    out = backend(*batch.args())  # outside: the eager wrapper, planned as before
    assert _Wrapper.plans[-1] == "BatchDecodeWithPagedKVCacheWrapper"
    assert relative_error(out[:3], want[:3]) < 1e-5 and not out[3:].any()

    prefill = make_paged_batch([2, 1], [10, 3], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=page,
                               dtype=torch.float32)  # fmt: skip
    lengths = r"graph bucket 5 got query lengths \[2, 1\]; allowed: at most 5 sequences"
    with pytest.raises(ValueError, match=lengths), backend.graph_bucket(5, static, prefill.args()[3:6]):
        pass
    with pytest.raises(ValueError, match=r"bucket 9; allowed: 1\.\.8"), backend.graph_bucket(9, static, None):
        pass


class _FakeGraph:
    """torch.cuda.CUDAGraph on CPU: a replay re-runs the captured model call (``fn``, bound after the
    capture) into the captured logits and argmax with every plan forbidden, as a real replay runs
    only kernels.
    A real replay also reuses the captured pointers: ``pointers`` (bound after the capture) must
    give what they gave then."""

    def replay(self):
        assert self.pointers() == self.captured_pointers, "a buffer the graph reads was replaced"
        _Wrapper.frozen = True
        try:
            with torch.inference_mode():  # the logits of a capture made in it
                logits = self.fn()
                self.logits.copy_(logits)
                self.greedy.copy_(logits.argmax(-1))
        finally:
            _Wrapper.frozen = False


@contextlib.contextmanager
def _fake_capture(graph, pool=None):
    _Wrapper.frozen = True
    try:
        yield
    finally:
        _Wrapper.frozen = False


@pytest.mark.parametrize("overlap", [True, False])
def test_engine_decode_graphs_on_the_flashinfer_backend(overlap, fake_flashinfer, monkeypatch):
    """Decode steps through captured buckets on the flashinfer backend (capture and replay emulated):
    greedy tokens as with the torch backend; every bucket planned by a warm-up run before its
    capture, and before every replay from the runner's staged host metadata; no plan inside a
    capture or replay; padded buckets among them."""
    prompts = [[5, 9, 2, 7, 1, 3], [8, 8, 4], list(range(10, 30)), [3] * 9, [7, 1], [2, 4, 6, 8, 10]]
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(len(prompts))]
    config = dict(device="cpu", dtype="float32", page_size=4, chunked_prefill_size=16,
                  disable_overlap_schedule=not overlap)  # fmt: skip
    want = [o.token_ids for o in LLM("tiny", attention_backend="torch", **config).generate(prompts, params)]
    llm = LLM("tiny", attention_backend="flashinfer", **config)
    eng = llm.engine
    kernels = eng.runner.kernels
    for name, fake in (("CUDAGraph", _FakeGraph), ("graph", _fake_capture), ("graph_pool_handle", lambda: None),
                       ("synchronize", lambda *a: None)):  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, fake)
    graphs = DecodeGraphs(eng.model, eng.runner.pool, kernels, 4, eng.runner.page_table.table.shape[1], True)
    assert sorted(graphs.graphs) == [1, 2, 4]
    backend = kernels.paged_attention
    for b, (graph, logits, greedy) in graphs.graphs.items():
        static = graphs._static_batch(b)
        graph.fn = lambda s=static: eng.model(s, eng.runner.pool.layers, kernels)
        graph.logits, graph.greedy = logits, greedy
        wrapper = backend._graph_wrappers[b]
        graph.pointers = lambda w=wrapper, b=b: (
            backend._graph_wrappers[b] is w, backend.workspace.data_ptr(), *(t.data_ptr() for t in w.buffers)
        )  # fmt: skip
        graph.captured_pointers = graph.pointers()
    assert backend.graph_plans == 3 and backend.host_plans == 0  # one warm-up plan per capture
    eng.runner.graphs = graphs
    used = []
    real = graphs.run
    graphs.run = lambda fb: used.append(fb.input_ids.shape[0]) or real(fb)
    monkeypatch.setattr(flashinfer_ref, "csr_pages", lambda *a: pytest.fail("read the device metadata back"))
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert used and any(graphs.bucket(n) != n for n in used)  # some replays were padded
    assert backend.graph_plans == 3 + len(used)  # one plan per replay
    assert backend.host_plans == backend.plans - 3  # all but the captures' from staged host metadata


def test_graph_workspace_follows_flashinfers_schedulers():
    """FlashInfer 0.5's graph-mode split-KV partials (float32 values and sums), worked by hand from its
    schedulers: tensor-core decode (group 8, 16-row tiles) of Llama-3-70B's 64 / 8 heads at bucket 512
    on 132 SMs takes ceil(512 * 8 / 16) + 511 = 767 tiles; CUDA-core decode (group 4) takes one row per
    CTA of the largest grid, 32 blocks x 132 SMs / 8 KV heads."""
    assert flashinfer_ref.graph_workspace_bytes(512, 64, 8, 128, 132) == 4 * 64 * 767 * 16 * 129 + 1024
    assert flashinfer_ref.graph_workspace_bytes(8, 64, 8, 128, 132) == 4 * 64 * 33 * 16 * 129 + 1024  # 2 CTAs / SM
    assert flashinfer_ref.graph_workspace_bytes(512, 32, 8, 128, 132) == 4 * 32 * 528 * 129 + 1024
    assert flashinfer_ref.graph_workspace_bytes(16, 128, 1, 128, 132) == 4 * 128 * 264 * 128 * 129 + 1024  # 128 rows
    wide = flashinfer_ref.graph_workspace_bytes(512, 64, 8, 128, 132)
    assert wide > flashinfer_ref.WORKSPACE_BYTES  # the default would overflow: the backend grows it
    base = flashinfer_ref.device_bytes(64, 8, 128, 132, [], 1024)
    with_graphs = flashinfer_ref.device_bytes(64, 8, 128, 132, [1, 2, 512], 1024)
    assert with_graphs - base == wide - flashinfer_ref.WORKSPACE_BYTES + 3 * 8 * 2**20 + 4 * (2 * 512 + 1 + 512 * 1024)


def test_workspace_grows_for_the_largest_bucket_before_any_graph_wrapper(fake_flashinfer, monkeypatch):
    """The first graph plan (the largest bucket: capture goes largest first) grows a too-small float
    workspace, and the eager wrappers made on the old one are made again; growing it once a graph
    wrapper holds it is an error."""
    monkeypatch.setattr(flashinfer_ref, "graph_workspace_bytes", lambda bucket, *a: 1000 * bucket)
    batch = make_paged_batch([1, 1, 1], [10, 3, 17], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4,
                             dtype=torch.float32, num_tokens=5)  # fmt: skip
    static, args = _padded_decode(batch, 5, table_rows=8)
    backend = flashinfer_ref.FlashInferBackend(workspace_bytes=16)
    backend(*batch.args())  # an eager plan first, on the 16-byte workspace
    eager = backend.wrappers[("decode", False)]
    with backend.graph_bucket(5, static, batch.args()[3:6]):
        backend(*args)
    assert backend.workspace.numel() == backend.workspace_bytes == 5000
    assert backend.wrappers == {} and backend._key is None  # made again on the next eager plan
    backend(*batch.args())
    assert backend.wrappers[("decode", False)] is not eager
    empty = torch.zeros(9, dtype=torch.int32)
    with backend.graph_bucket(8, static, None), pytest.raises(RuntimeError, match="needs a 8000 byte workspace"):
        backend(torch.randn(8, *args[0].shape[1:]), *args[1:3], static, empty[:8], empty, 1)


@pytest.mark.parametrize("chunks_first", [True, False])
def test_pod_splits_a_mixed_batch_into_its_chunks_and_decodes(chunks_first, fake_flashinfer):
    """The POD baseline: sequences of several query tokens to its prefill half, single tokens to its
    decode half, rows as views when the chunks come first (the engine's order), output in our order."""
    q_lens, kv_lens = [5, 3, 1, 1, 1], [12, 3, 9, 1, 30]
    if not chunks_first:
        q_lens, kv_lens = q_lens[::-1], kv_lens[::-1]
    batch = make_paged_batch(q_lens, kv_lens, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4,
                             dtype=torch.float32, num_tokens=13)  # fmt: skip
    pod = flashinfer_ref.FlashInferPOD(*batch.args()[:6])
    assert (pod.q_p.data_ptr() == batch.q.data_ptr()) is chunks_first
    out_p, out_d = pod.run()
    assert (out_p.shape[0], out_d.shape[0]) == (8, 3)
    out = pod.output()
    want = reference.paged_attention(*batch.to_float64())
    assert relative_error(out, want) < 1e-5 and not out[11:].any()
    decodes = make_paged_batch([1, 1], [4, 5], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=4,
                               dtype=torch.float32)  # fmt: skip
    with pytest.raises(ValueError, match=r"POD needs a chunk of several tokens and a decode; query lengths \[1, 1\]"):
        flashinfer_ref.FlashInferPOD(*decodes.args()[:6])
