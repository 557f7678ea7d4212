"""The engine on a GPU with the Triton kernels (marked ``gpu``: skipped without CUDA)."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from checkpoints import build_checkpoint

from minengine import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_matches_transformers_on_gpu(arch, tmp_path):
    import transformers

    path = build_checkpoint(tmp_path / arch, arch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    rng = random.Random()
    shared = [rng.randrange(4, hf.config.vocab_size) for _ in range(60)]
    prompts = [shared + [rng.randrange(4, hf.config.vocab_size) for _ in range(n)] for n in (1, 30, 90)]
    want = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            for _ in range(12):
                ids = torch.cat([ids, hf(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
            want.append(ids[0, len(p) :].tolist())
    config = dict(device="cuda", dtype="float32", attention_backend="triton", page_size=16, chunked_prefill_size=64)
    llm = LLM(str(path), **config)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want  # warm prefix cache


def test_bf16_mixed_batches_on_gpu():
    llm = LLM("tiny", device="cuda", page_size=16, chunked_prefill_size=256)
    prompts = [[rng_id % 250 for rng_id in range(i, i + 40 * (i % 5 + 1))] for i in range(64)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 20 for o in outs)
    acc = llm.engine.scheduler.accounting()
    assert acc["held_by_requests"] == 0 and acc["free"] + acc["held_only_by_cache"] == acc["total"]


def test_logprobs_with_cuda_graphs_match_a_float64_reference(tmp_path):
    """Decode steps replay CUDA graphs; logprobs are computed from the graph's logits after it,
    and pinned host copies of them are read with the step's tokens; prompt logprobs too."""
    import transformers
    from test_logprobs import check_output, check_prompt, prompt_reference, prompts_for, reference

    path = build_checkpoint(tmp_path / "qwen3", "qwen3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    prompts = prompts_for(hf.config.vocab_size)
    params = [
        SamplingParams(max_tokens=16, temperature=0.9, seed=5, logprobs=4, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0, logprobs=2, prompt_logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0, logprobs=0, prompt_logprobs=0, ignore_eos=True),
    ]
    llm = LLM(str(path), device="cuda", dtype="float32", attention_backend="triton", page_size=16)
    try:
        assert llm.engine.runner.graphs is not None
        for prompt, p, o in zip(prompts, params, llm.generate(prompts, params, use_tqdm=False), strict=True):
            out = o.outputs[0]
            if p.logprobs is None:
                assert out.logprobs is None
            else:
                check_output(out, reference(hf, prompt, out.token_ids), p.logprobs, llm.tokenizer)
            if p.prompt_logprobs is not None:  # made a slice at a time beside the step, read with its tokens
                check_prompt(o, prompt, prompt_reference(hf, prompt), p.prompt_logprobs, llm.tokenizer)
    finally:
        llm.shutdown()


def test_structured_outputs_with_overlap_and_cuda_graphs_on_gpu(tmp_path):
    """The device parts of structured outputs on CUDA: masks sent through pinned memory, the row
    of a request that reasons with its token in flight chosen on the device from the token
    buffer, decode steps replayed from graphs around them."""
    pytest.importorskip("xgrammar")
    from test_structured import structured_outputs_run

    structured_outputs_run(tmp_path, device="cuda", dtype="float32", attention_backend="triton", page_size=16)


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_steps_make_no_synchronizing_cuda_call(backend):
    """#5's rule that the scheduling path waits for no device (but the step in flight's event,
    which torch's sync debug mode does not count): ``test_overlap``'s steps (graph replays,
    sampling, logprobs, every logit adjustment, a grammar, joining prefills) with the mode set to
    raise."""
    if backend == "cuda":
        pytest.importorskip("minengine._C")
    pytest.importorskip("xgrammar")
    from test_overlap import steps_without_host_reads

    @contextlib.contextmanager
    def sync_raises():
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    steps_without_host_reads(sync_raises, device="cuda", attention_backend=backend)
