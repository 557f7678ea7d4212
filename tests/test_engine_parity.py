"""Greedy generation is token-identical to transformers (float32), under every scheduling shape.

Checkpoints are built here with transformers (random weights, save_pretrained) and a trained
byte-level BPE tokenizer: Llama with GQA and llama3 RoPE (sharded safetensors), Qwen2 with q/k/v
bias, Qwen3 with q/k norm and tied embeddings. The KV accounting invariant is asserted after
every engine step.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from checkpoints import build_checkpoint

from minengine import LLM, SamplingParams

MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp(request.param), request.param, shard=request.param == "llama")


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def make_prompts(vocab: int, rng: random.Random) -> list[list[int]]:
    """Different lengths, and shared prefixes (two share 40 tokens, one extends another)."""
    ids = lambda n: [rng.randrange(4, vocab) for _ in range(n)]  # noqa: E731  (skip special ids)
    shared = ids(40)
    return [shared + ids(7), ids(3), shared + ids(21), ids(33), shared[:17], [rng.randrange(4, vocab)]]


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(n):
        nxt = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def expected(hf_model):
    rng = random.Random()
    prompts = make_prompts(hf_model.config.vocab_size, rng)
    return prompts, [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize(
    "config",
    [
        dict(page_size=16),
        dict(page_size=1, chunked_prefill_size=3),
        dict(page_size=5, chunked_prefill_size=8, max_running_requests=2),
        dict(page_size=5, disable_radix_cache=True, chunked_prefill_size=11),
        dict(page_size=16, long_prefill_token_threshold=6, max_running_requests=3),
        dict(page_size=5, chunked_prefill_size=8, disable_overlap_schedule=True),
        dict(page_size=5, max_running_requests=3, enable_prefill_delayer=True, prefill_delayer_max_delay_passes=2),
        dict(page_size=4, dp_size=2, enable_prefill_delayer=True, prefill_delayer_max_delay_passes=2),
        # KV for one longest request (61 + 10 tokens): the others are preempted and recomputed
        dict(page_size=4, max_total_tokens=72, chunked_prefill_size=16),
        dict(page_size=3, max_total_tokens=72, disable_radix_cache=True, disable_overlap_schedule=True),
        dict(page_size=5, max_total_tokens=80, kv_admission="reserve"),
    ],
    ids=[
        "page16",
        "page1-chunk3",
        "page5-chunk8-run2",
        "page5-noradix",
        "page16-threshold6",
        "no-overlap",
        "delayer",
        "dp2-delayer",
        "preempt",
        "preempt-noradix-no-overlap",
        "reserve",
    ],
)
def test_greedy_matches_transformers(checkpoint, expected, config, kv_checked_steps):
    prompts, want = expected
    steps = kv_checked_steps
    llm = LLM(str(checkpoint), **config)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert all(o.finish_reason == "length" for o in outs)
    # again on the warm prefix cache (every prompt now hits it), same tokens; n=2 runs each prompt
    # twice at once (the two share its cached pages)
    again = llm.generate(prompts, replace(GREEDY, n=2), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in again] == [[w, w] for w in want]
    if config.get("max_total_tokens"):  # the small KV pools: preempt mode preempts, reserve never
        preempted = llm.engine.scheduler.num_preemptions
        assert (preempted > 0) == (config.get("kv_admission", "preempt") == "preempt"), preempted
    llm.shutdown()
    if config.get("dp_size", 1) > 1:
        return  # the engines ran in worker processes (the server tests check their KV there)
    acc = steps[-1]
    assert acc["held_by_requests"] == 0
    assert acc["free"] + acc["held_only_by_cache"] == acc["total"]
    if config.get("disable_radix_cache"):
        assert acc["held_only_by_cache"] == 0


def test_cached_prefix_is_not_recomputed(checkpoint, expected, monkeypatch):
    prompts, want = expected
    llm = LLM(str(checkpoint), page_size=4)
    computed = []
    real = llm.engine.runner.prepare
    monkeypatch.setattr(
        llm.engine.runner, "prepare", lambda batch: computed.append(sum(n for _, n in batch)) or real(batch)
    )
    llm.generate(prompts, GREEDY, use_tqdm=False)
    first = sum(computed)
    computed.clear()
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    # second pass: each prompt recomputes at most its last partial page + 1 token, then decodes
    bound = sum(len(p) % 4 + 4 for p in prompts) + len(prompts) * (MAX_TOKENS - 1)
    assert sum(computed) <= bound < first


@pytest.mark.parametrize(
    "arch, fields",
    [
        ("mistral", {}),
        ("llama", dict(attention_bias=True, mlp_bias=True)),  # biases on q/k/v, o and the MLP
        ("qwen3", dict(attention_bias=True)),  # q/k/v and o biases
    ],
    ids=["mistral", "llama-biases", "qwen3-attention-bias"],
)
def test_config_variants_match_transformers(arch, fields, tmp_path):
    import transformers

    path = build_checkpoint(tmp_path / arch, arch, **fields)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random()
    prompts = [[rng.randrange(4, hf.config.vocab_size) for _ in range(n)] for n in (5, 19)]
    want = [hf_greedy(hf, p, 6) for p in prompts]
    llm = LLM(str(path), page_size=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == want


def test_triton_backend_matches_transformers(checkpoint, hf_model):
    """The Triton kernels (interpreted on CPU) inside the engine: a smaller case."""
    rng = random.Random()
    vocab = hf_model.config.vocab_size
    shared = [rng.randrange(4, vocab) for _ in range(9)]
    prompts = [shared + [rng.randrange(4, vocab) for _ in range(4)], shared[:6]]
    want = [hf_greedy(hf_model, p, 4) for p in prompts]
    llm = LLM(str(checkpoint), attention_backend="triton", page_size=5, chunked_prefill_size=6)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == want


def test_cuda_backend_matches_transformers(checkpoint, hf_model):
    """The CUDA C++ kernels (attention, KV store, input-id gather) inside the engine, in fp32 (the
    CUDA-core attention kernel): on the GPU, or here through the CPU emulator."""
    from conftest import HAS_CUDA, use_cuda_emulator

    from minengine.ops import cuda

    if HAS_CUDA and not cuda.available():
        pytest.skip("minengine._C is not built")
    if not HAS_CUDA:
        use_cuda_emulator()
    try:
        rng = random.Random()
        vocab = hf_model.config.vocab_size
        shared = [rng.randrange(4, vocab) for _ in range(9)]
        prompts = [shared + [rng.randrange(4, vocab) for _ in range(4)], shared[:6], [rng.randrange(4, vocab)]]
        want = [hf_greedy(hf_model, p, 4) for p in prompts]
        device = dict(device="cuda", dtype="float32") if HAS_CUDA else {}
        llm = LLM(str(checkpoint), attention_backend="cuda", page_size=5, chunked_prefill_size=6, **device)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert [o.token_ids for o in outs] == want
    finally:
        cuda.use_emulator(False)
