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


@pytest.mark.parametrize("max_bs", [5, 8])
def test_padded_decode_path_gives_the_same_tokens(max_bs, kv_checked_steps):
    want = [o.token_ids for o in LLM("tiny", page_size=4).generate(PROMPTS, PARAMS, use_tqdm=False)]
    llm = LLM("tiny", page_size=4)
    used = with_padded_decode(llm, max_bs)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == want
    assert used and max(used) <= max_bs  # larger decode batches ran eagerly
    assert any(llm.engine.runner.graphs.bucket(n) != n for n in used)  # some were padded


def test_buckets():
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.buckets = [b for b in (1, 2, 4, 8, 12) if b < 10] + [10]
    assert [graphs.bucket(n) for n in (1, 3, 5, 9, 10, 11)] == [1, 4, 8, 10, 10, None]


@pytest.mark.gpu
def test_cuda_graphs_match_eager_on_gpu():
    eager = LLM("tiny", device="cuda", page_size=16, disable_cuda_graph=True)
    want = [o.token_ids for o in eager.generate(PROMPTS * 5, PARAMS * 5, use_tqdm=False)]
    eager.shutdown()
    llm = LLM("tiny", device="cuda", page_size=16, cuda_graph_max_bs=32)
    assert llm.engine.runner.graphs.graphs  # captured
    assert [o.token_ids for o in llm.generate(PROMPTS * 5, PARAMS * 5, use_tqdm=False)] == want
    torch.cuda.synchronize()
