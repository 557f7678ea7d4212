"""Decode steps through padded CUDA-graph buckets.

On CPU the padded path runs eagerly (no capture), which checks the padding: batch sizes that
are not buckets, padded tokens that must neither write KV nor disturb real rows. On a GPU the
graphs are captured and replayed (marked ``gpu``)."""

from __future__ import annotations

import pytest
import torch

from minengine import LLM, SamplingParams
from minengine.cuda_graph import DecodeGraphs

PROMPTS = [f"graph prompt {i}" * (i % 3 + 1) for i in range(7)]
# different lengths: decode batches shrink from 7 to 1 (7, 6, 5 pad to the bucket of 8)
PARAMS = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(7)]
# greedy rows take the graph's argmax; seeded sampling rows overwrite theirs (reproducible in any batch)
MIXED = [
    SamplingParams(temperature=0.9, top_k=20, seed=i, max_tokens=p.max_tokens, ignore_eos=True) if i % 2 else p
    for i, p in enumerate(PARAMS)
]

# logits adjusted before sampling (penalties, bias, min_tokens, bad words, allowed tokens): those rows
# leave the graph's argmax
ADJUSTED = [
    SamplingParams(
        temperature=p.temperature,
        top_k=p.top_k,
        seed=p.seed,
        max_tokens=p.max_tokens,
        ignore_eos=True,
        **[
            dict(repetition_penalty=1.5, frequency_penalty=0.5),
            dict(logit_bias={65: 3.0}),
            dict(presence_penalty=1.0),
            dict(min_tokens=3, stop_token_ids=[100]),
            {},
            dict(bad_words=["aa", "q"], logit_bias={97: 6.0}),  # "a" is 97: taken, but never twice in a row
            dict(allowed_token_ids=[32, *range(97, 123)]),
        ][i % 7],
    )
    for i, p in enumerate(MIXED)
]


def with_padded_decode(llm: LLM, max_bs: int) -> list[int]:
    eng = llm.engine
    graphs = DecodeGraphs(
        eng.model, eng.runner.pool, eng.runner.kernels, max_bs, eng.runner.page_table.table.shape[1], False
    )
    eng.runner.graphs = graphs
    used = []
    real = graphs.run
    graphs.run = lambda fb: used.append(fb.input_ids.shape[0]) or real(fb)
    return used


@pytest.mark.parametrize(
    "max_bs, params", [(5, PARAMS), (8, PARAMS), (8, MIXED), (8, ADJUSTED)], ids=["5", "8", "8-mixed", "8-adjusted"]
)
def test_padded_decode_path_gives_the_same_tokens(max_bs, params, kv_checked_steps):
    want = [o.token_ids for o in LLM("tiny", page_size=4).generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM("tiny", page_size=4)
    used = with_padded_decode(llm, max_bs)
    assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == want
    assert used and max(used) <= max_bs  # larger decode batches ran eagerly
    assert any(llm.engine.runner.graphs.bucket(n) != n for n in used)  # some were padded


def test_buckets():
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.buckets = [b for b in (1, 2, 4, 8, 12) if b < 10] + [10]
    assert [graphs.bucket(n) for n in (1, 3, 5, 9, 10, 11)] == [1, 4, 8, 10, 10, None]


# float32: a replay pads the batch to its bucket, which may change a kernel's split of the keys or
# the GEMM's tiling; in bf16 that moves the tiny random model's near-tied logits enough to flip a token
@pytest.mark.gpu
def test_cuda_graphs_match_eager_on_gpu():
    eager = LLM("tiny", device="cuda", dtype="float32", page_size=16, disable_cuda_graph=True)
    want = [o.token_ids for o in eager.generate(PROMPTS * 5, MIXED * 5, use_tqdm=False)]
    eager.shutdown()
    llm = LLM("tiny", device="cuda", dtype="float32", page_size=16, cuda_graph_max_bs=32)
    assert llm.engine.runner.graphs.graphs  # captured
    assert [o.token_ids for o in llm.generate(PROMPTS * 5, MIXED * 5, use_tqdm=False)] == want


@pytest.mark.gpu
def test_cuda_graphs_with_adjusted_logits_match_eager_on_gpu():
    """Penalised rows count their tokens on the device across replays; the graph's argmax of
    other rows stays theirs."""
    params = (ADJUSTED + PARAMS) * 3
    eager = LLM("tiny", device="cuda", dtype="float32", page_size=16, disable_cuda_graph=True)
    want = [o.token_ids for o in eager.generate(PROMPTS * 6, params, use_tqdm=False)]
    eager.shutdown()
    llm = LLM("tiny", device="cuda", dtype="float32", page_size=16, cuda_graph_max_bs=32)
    assert [o.token_ids for o in llm.generate(PROMPTS * 6, params, use_tqdm=False)] == want
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "heads, max_bs, copies, overlap",
    [
        ((4, 2), 32, 5, True),
        ((4, 2), 32, 5, False),
        ((8, 1), 32, 5, True),  # group 8: FlashInfer's tensor-core decode (its prefill scheduler)
        ((8, 8), 512, 60, True),  # buckets up to 448 x 8 KV heads: past the CUDA-core decode's split-KV grid
    ],
)
def test_flashinfer_decode_graphs_match_its_eager_run_on_gpu(heads, max_bs, copies, overlap, tmp_path):
    """The flashinfer backend under CUDA graphs: every replayed decode step's logits against the same
    step run eagerly (FlashInfer's eager decode wrapper, planned for the real batch), padded buckets
    among them. Graph and eager plans may split the keys differently, so logits are compared with a
    tolerance rather than tokens. Head dim 64 (FlashInfer's kernels take 64, 128, 256)."""
    from checkpoints import build_checkpoint

    from minengine.ops import flashinfer_ref
    from minengine.ops.testing import relative_error

    if not flashinfer_ref.available():
        pytest.skip("flashinfer is not installed")
    num_heads, num_kv_heads = heads
    model = build_checkpoint(tmp_path / "llama64", "llama", hidden_size=64 * num_heads, num_heads=num_heads,
                             num_kv_heads=num_kv_heads)  # fmt: skip
    llm = LLM(str(model), device="cuda", dtype="float16", page_size=16, attention_backend="flashinfer",
              cuda_graph_max_bs=max_bs, max_running_requests=max_bs, disable_overlap_schedule=not overlap)  # fmt: skip
    eng = llm.engine
    graphs = eng.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == graphs.buckets  # captured
    checked = []
    real = graphs.run

    def run(fb):
        logits, greedy = real(fb)
        assert torch.equal(greedy, logits.argmax(-1))  # greedy sampling in the graph
        eager = eng.model(fb, eng.runner.pool.layers, eng.runner.kernels)
        checked.append((fb.input_ids.shape[0], relative_error(logits, eager)))
        return logits, greedy

    graphs.run = run
    outputs = llm.generate(PROMPTS * copies, PARAMS * copies, use_tqdm=False)
    torch.cuda.synchronize()
    assert [len(o.token_ids) for o in outputs] == [p.max_tokens for p in PARAMS * copies]
    assert checked and any(graphs.bucket(n) != n for n, _ in checked)  # padded buckets too
    assert max(n for n, _ in checked) > min(max_bs, 7 * copies) // 2  # the wide buckets ran
    worst = max(err for _, err in checked)
    assert worst < 1e-2, checked
    backend = eng.runner.kernels.paged_attention
    assert backend.graph_plans >= len(graphs.buckets) + len(checked)  # a plan per capture and per replay
    llm.shutdown()
