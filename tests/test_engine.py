"""Engine behaviour on the built-in tiny model: inputs, validation, sampling, stopping, KV pressure."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace

import pytest
import torch
from checkpoints import build_checkpoint

from minengine import LLM, EngineConfig, SamplingParams
from minengine.detokenizer import IncrementalDetokenizer
from minengine.models.tiny import tiny_tokenizer
from minengine.sampler import filtered_probs

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TOK = tiny_tokenizer()


def gen(llm, prompt, **params):
    """One prompt's output, greedy unless params say otherwise."""
    return llm.generate(prompt, SamplingParams(**{"temperature": 0} | params), use_tqdm=False)[0]


@pytest.fixture(scope="module")
def llm():
    engine = LLM("tiny", page_size=4, max_total_tokens=4096)
    yield engine
    engine.shutdown()


def test_tiny_needs_no_files(llm):
    (out,) = llm.generate("Hello", use_tqdm=False)
    assert out.prompt == "Hello" and out.prompt_token_ids == tiny_tokenizer().encode("Hello")
    assert 1 <= len(out.token_ids) <= 16 and out.finish_reason in ("stop", "length")


def test_prompt_forms_and_order(llm):
    ids = llm.tokenizer.encode("abc")
    single = llm.generate(ids, GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].prompt is None
    outs = llm.generate(["abc", "a much longer prompt here", "x"], GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["abc", "a much longer prompt here", "x"]
    assert outs[0].token_ids == single[0].token_ids  # ids and text of the same prompt agree
    mixed = llm.generate([ids, [5, 6, 7]], [GREEDY, SamplingParams(max_tokens=3, temperature=0)], use_tqdm=False)
    assert len(mixed[1].token_ids) <= 3
    # vLLM's TextPrompt and TokensPrompt dicts, alone or in a list
    dicts = llm.generate([{"prompt": "abc"}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert [o.prompt for o in dicts] == ["abc", None]
    assert dicts[0].token_ids == dicts[1].token_ids == single[0].token_ids
    assert llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].token_ids == single[0].token_ids
    with pytest.raises(ValueError, match="prompt 1 is a dict; allowed: a string, a list of token ids"):
        llm.generate(["abc", {"text": "abc"}], GREEDY, use_tqdm=False)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], GREEDY, "empty"),
        ([1, 999], GREEDY, r"token id 999 is outside the vocabulary \[0, 260\)"),
        ([1] * 4000, SamplingParams(max_tokens=200), r"\(4000 tokens\) \+ max_tokens \(200\) = 4200 exceeds"),
        # no valid Unicode (the tokenizer raised its TypeError "TextInputSequence must be str")
        ("a \ud800", GREEDY, r"prompt 1: '\\ud800' at character 2 is an unpaired surrogate; allowed: valid Unicode"),
        ("ok", SamplingParams(bad_words=["x\udfff"]), r"prompt \d: bad_words has 'x\\udfff': '\\udfff' at character 1"),
    ],
)
def test_bad_requests_are_rejected_before_anything_runs(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3], prompt], params, use_tqdm=False)
    assert not llm.engine.has_unfinished()  # the valid first prompt was not queued either


@pytest.mark.parametrize("config", [dict(), dict(chunked_prefill_size=48), dict(disable_overlap_schedule=True)])
def test_prompt_pages_shared_in_a_step_are_computed_once(config):
    """Requests that arrive together and share prompt pages (n sequences of one prompt, or one
    system prompt) compute those pages once: a request whose next uncached page another request
    of the step computes waits a pass and finds it in the prefix cache. Outputs are unchanged."""
    llm = LLM("tiny", page_size=4, **config)
    computed = []
    real = llm.engine.runner.prepare
    llm.engine.runner.prepare = lambda batch: computed.append(sum(n for _, n in batch)) or real(batch)
    system = "s" * 150  # with BOS, 37 full pages and 3 tokens
    prompts = [system + "question one", system + "a second question", "unrelated"]
    params = SamplingParams(temperature=1.0, max_tokens=5, seed=11, n=3, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    lengths = [len(llm.tokenizer.encode(p)) for p in prompts]
    # each prompt's first sequence computes what is not shared; the others its last token at most
    # a page (their match ends at the last full page before the last token)
    shared = 37 * 4
    prefill = lengths[0] + (lengths[1] - shared) + lengths[2] + 2 * 3 * 4
    assert sum(computed) <= prefill + 9 * 4, (computed, lengths)  # + 4 decodes of 9 sequences
    fresh = LLM("tiny", page_size=4, disable_radix_cache=True)
    want = fresh.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in want]
    assert llm.engine.stats()["kv_pages_in_use"] == 0


def test_request_larger_than_kv_capacity_is_rejected():
    small = LLM("tiny", page_size=4, max_total_tokens=32)
    with pytest.raises(ValueError, match=r"= 40 exceeds the KV cache capacity of 32 tokens"):
        small.generate([[1] * 30], SamplingParams(max_tokens=10), use_tqdm=False)


def test_sampling_params_list_must_match(llm):
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate(["a", "b", "c"], [GREEDY, GREEDY], use_tqdm=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_tokens=0), "max_tokens is 0"),
        (dict(temperature=-1), "temperature is -1"),
        (dict(top_p=0), r"top_p is 0; allowed: a number in \(0, 1\]"),
        (dict(top_k=-2), "top_k is -2"),
        (dict(min_p=1.5), "min_p is 1.5"),
        (dict(stop=[""]), "stop is"),
        (dict(stop_token_ids=["a"]), "stop_token_ids is"),
        (dict(stop=0), "stop is 0"),
        (dict(stop=()), r"stop is \(\)"),
        (dict(stop_token_ids=""), "stop_token_ids is ''"),
        (dict(seed=1.5), "seed is 1.5"),
        (dict(seed=2**64), rf"seed is {2**64}; allowed: an integer in \[{-(2**63)}, {2**64 - 1}\]"),
        (dict(seed=-(2**63) - 1), "seed is -9223372036854775809"),
        (dict(n=0), "n is 0; allowed: an integer >= 1"),
        (dict(n=True), "n is True"),
        (dict(seed=2**64 - 2, n=3), rf"seed is {2**64 - 2} with n 3; allowed: seed \+ n - 1 <= {2**64 - 1}"),
        (dict(include_stop_str_in_output=1), "include_stop_str_in_output is 1; allowed: True or False"),
        (dict(skip_special_tokens=None), "skip_special_tokens is None; allowed: True or False"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens is 0; allowed: None, -1 .* or an integer >= 1"),
        (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens is -2"),
        (dict(truncate_prompt_tokens=True), "truncate_prompt_tokens is True"),
        (dict(allowed_token_ids=[]), r"allowed_token_ids is \[\]; allowed: None or a non-empty list"),
        (dict(allowed_token_ids=[3, -1]), r"allowed_token_ids is \[3, -1\]"),
        (dict(bad_words="no"), "bad_words is 'no'; allowed: None or a list of at most 128 strings"),
        (dict(bad_words=["no", ""]), "bad_words has ''; allowed: strings with a character that is not a space"),
    ],
)
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(devcie="cpu"), "unknown config field.*devcie.*allowed:.*device"),
        (dict(device="tpu"), "device is 'tpu'; allowed: auto, cuda, cpu"),
        (dict(dtype="fp8"), "dtype is 'fp8'"),
        (dict(attention_backend="tvm"), "attention_backend is 'tvm'"),
        (dict(page_size=0), "page_size is 0; allowed: an integer >= 1"),
        (dict(chunked_prefill_size=-5), "chunked_prefill_size is -5"),
        (dict(mem_fraction_static=1.5), r"mem_fraction_static is 1.5; allowed: a number in \(0, 1\)"),
        (dict(disable_radix_cache="yes"), "disable_radix_cache is 'yes'"),
        (dict(seed=2**64), rf"seed is {2**64}; allowed: an integer in \[0, {2**64 - 1}\]"),
        (dict(kv_admission="swap"), "kv_admission is 'swap'; allowed: preempt, reserve"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**kwargs)


def test_the_readme_lists_every_config_field_with_its_default():
    """The README's engine config table is the flags' reference: a row per field, with the
    field's default (a field added without its row failed no test before)."""
    import dataclasses
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    table = readme.split("### Engine config", 1)[1].split("\n\n", 2)[1]
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, re.M))
    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert sorted(rows) == sorted(fields)
    for name, default in fields.items():
        shown = rows[name].strip().strip("`")
        assert shown == str(default) or (name == "tokenizer" and default is None), (name, shown, default)


def test_seeded_sampling_is_reproducible_across_batches(llm):
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate(["seeded prompt"], seeded, use_tqdm=False)[0].token_ids
    others = SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True)
    batch = llm.generate(["x", "seeded prompt", "yz"], [others, seeded, others], use_tqdm=False)
    assert batch[1].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, max_tokens=12, seed=99, ignore_eos=True)
    assert llm.generate(["seeded prompt"], other_seed, use_tqdm=False)[0].token_ids != alone


def test_seeds_at_the_ends_of_their_range_sample(llm):
    for seed in (-(2**63), 2**64 - 1):
        params = SamplingParams(temperature=1.0, max_tokens=4, seed=seed, ignore_eos=True)
        assert len(llm.generate(["edge seed"], params, use_tqdm=False)[0].token_ids) == 4


def test_a_tiny_temperature_samples_greedily(llm):
    """Logits divided by 1e-39 overflow float32 (NaN probabilities, token 0 every step); below 1e-5
    the sampler takes the argmax instead, as vLLM does."""
    greedy = gen(llm, "tiny temperature", max_tokens=6, ignore_eos=True)
    for t in (1e-6, 1e-39, 5e-324):
        assert gen(llm, "tiny temperature", max_tokens=6, ignore_eos=True, temperature=t).token_ids == greedy.token_ids


def test_a_stop_token_ends_the_output_but_is_not_its_text(llm):
    """As in vLLM: EOS or a stop token id is the last output token; the text stops before it, with
    stop strings (text made token by token) or without (made at the end)."""
    base = gen(llm, "stop token text", max_tokens=12, ignore_eos=True)
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    for extra in ({}, {"stop": ["\x00never"]}):
        out = gen(llm, "stop token text", max_tokens=12, stop_token_ids=[stop_id], **extra)
        assert out.token_ids == base.token_ids[: first + 1] and out.finish_reason == "stop"
        assert out.text == llm.tokenizer.decode(base.token_ids[:first])


def test_context_length_past_the_model_positions_is_rejected():
    with pytest.raises(ValueError, match=r"context_length is 8192; allowed: 1..4096 \(the model's max_position"):
        LLM("tiny", context_length=8192)


def test_offline_delayer_outcomes_do_not_pile_up():
    llm = LLM("tiny", page_size=4, max_total_tokens=1024, enable_prefill_delayer=True)
    for _ in range(2):
        llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
        assert llm.engine.delayer.outcomes == []
    llm.shutdown()


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.8), SamplingParams(min_p=0.5)]
    probs = filtered_probs(logits, params)
    assert (probs > 0).tolist() == [[True, True, False, False], [True, True, False, False], [True, True, False, False]]
    keep_all = filtered_probs(logits[:1], [SamplingParams(top_p=1.0, top_k=-1)])
    torch.testing.assert_close(keep_all, logits[:1].softmax(-1))
    # both: as vLLM, min-p first (keeps 0.45 and 0.35), then top-p over what it kept, renormalised
    # (0.5625 of it reaches 0.5: one token); top-p first would have kept two
    logits = torch.tensor([[0.45, 0.35, 0.1, 0.1]]).log()
    assert (filtered_probs(logits, [SamplingParams(min_p=0.25, top_p=0.5)]) > 0).tolist() == [
        [True, False, False, False]
    ]
    assert (filtered_probs(logits, [SamplingParams(min_p=0.25, top_p=0.9)]) > 0).tolist() == [
        [True, True, False, False]
    ]


def test_sampled_tokens_respect_top_k(llm):
    sampled = gen(llm, "abc", temperature=5.0, top_k=1, max_tokens=6, ignore_eos=True)
    assert sampled.token_ids == gen(llm, "abc", max_tokens=6, ignore_eos=True).token_ids


def test_stop_token_ids_and_stop_strings(llm):
    base = gen(llm, "stop test", max_tokens=12, ignore_eos=True)
    stop_id = base.token_ids[3]
    out = gen(llm, "stop test", max_tokens=12, stop_token_ids=[stop_id])
    first = base.token_ids.index(stop_id)
    assert out.token_ids == base.token_ids[: first + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_id and base.stop_reason is None  # as vLLM reports them
    text = base.text
    assert len(text) >= 4
    stop = text[2:4]
    out = gen(llm, "stop test", max_tokens=12, stop=[stop, "\x00never"])
    assert out.finish_reason == "stop" and out.text == text[: text.find(stop)]
    assert stop not in out.text and out.stop_reason == stop
    kept = gen(llm, "stop test", max_tokens=12, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == text[: text.find(stop) + len(stop)] and kept.stop_reason == stop
    assert kept.token_ids == out.token_ids and kept.finish_reason == "stop"


def test_the_eos_listed_as_a_stop_token_is_no_stop_reason(llm):
    """As vLLM: the tokenizer's EOS ends the output before stop_token_ids are looked at, so its
    stop_reason is None even when they list it; with ignore_eos only the list stops it."""
    eos = llm.tokenizer.eos_token_id
    kw = dict(max_tokens=4, allowed_token_ids=[eos], stop_token_ids=[eos])
    out = gen(llm, "stop test", **kw)
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([eos], "stop", None)
    out = gen(llm, "stop test", **kw, ignore_eos=True)
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([eos], "stop", eos)


def test_the_models_other_end_tokens_are_stop_reasons(llm):
    """As vLLM, which adds a model's end tokens other than the tokenizer's EOS (tiny's ``<|im_end|>``,
    as Qwen's) to a request's stop_token_ids: one of them ends the output with its id as the
    stop_reason; with ignore_eos it does not end it."""
    (end,) = set(llm.engine.eos_token_ids) - {llm.tokenizer.eos_token_id}
    out = gen(llm, "stop test", max_tokens=4, allowed_token_ids=[end])
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([end], "stop", end)
    out = gen(llm, "stop test", max_tokens=4, allowed_token_ids=[end], ignore_eos=True)
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([end] * 4, "length", None)


def test_include_stop_str_in_output_keeps_a_stop_token_text(llm):
    """As vLLM: with include_stop_str_in_output a stop token id's text stays in the output text
    (decoded at the end without stop strings, token by token with them)."""
    kw = dict(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    ids = gen(llm, "stop test", **kw).token_ids
    tok = next(t for t in ids[1:] if llm.tokenizer.decode([t]).isalnum())
    want = llm.tokenizer.decode(ids[: ids.index(tok) + 1])
    for stop in (None, ["\x00never"]):
        out = gen(llm, "stop test", **kw, stop=stop, stop_token_ids=[tok], include_stop_str_in_output=True)
        assert (out.text, out.stop_reason) == (want, tok)
        assert gen(llm, "stop test", **kw, stop=stop, stop_token_ids=[tok]).text == want[:-1]


def test_n_sequences_per_prompt(llm):
    """vLLM's ``n``: each prompt's RequestOutput has n CompletionOutputs; sequence j samples as a
    request alone with seed + j would. request_id: as vLLM's, a string counting this LLM's prompts
    (unique across its calls). A tuple of params is one per prompt, as a list."""
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=7, n=3, ignore_eos=True)
    outs = llm.generate(["n prompt", [5, 6, 7]], (params, replace(params, n=2, seed=None)), use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [3, 2] and all(isinstance(o.request_id, str) for o in outs)
    first = int(outs[0].request_id)
    assert int(outs[1].request_id) == first + 1 and int(gen(llm, "next call").request_id) == first + 2
    assert [c.index for c in outs[0].outputs] == [0, 1, 2] and outs[0].prompt == "n prompt"
    for j, c in enumerate(outs[0].outputs):
        alone = gen(llm, "n prompt", temperature=1.0, max_tokens=6, seed=7 + j, ignore_eos=True)
        assert (c.token_ids, c.text, c.finish_reason) == (alone.token_ids, alone.text, "length")
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) == 3
    assert outs[0].text == outs[0].outputs[0].text and outs[0].token_ids == outs[0].outputs[0].token_ids
    assert all(len(c.token_ids) == 6 for c in outs[1].outputs) and outs[1].prompt_token_ids == [5, 6, 7]
    greedy = llm.generate("n prompt", SamplingParams(temperature=0, max_tokens=5, n=2), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert llm.engine.stats()["kv_pages_in_use"] == 0
    with pytest.raises(ValueError, match="n is 2; a request runs one sequence"):
        llm.engine.add_request([1, 2], SamplingParams(n=2))


@pytest.mark.parametrize("dp_size", [1, 2])
def test_num_cached_tokens_counts_the_prompt_pages_the_prefix_cache_served(llm, dp_size):
    """vLLM's ``RequestOutput.num_cached_tokens``; with n sequences, its first one's."""
    prompt = [9 + i % 200 for i in range(41)]  # 10 full pages of 4, and one token
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    here = llm if dp_size == 1 else LLM("tiny", page_size=4, max_total_tokens=4096, dp_size=2)
    try:
        # round-robin over the workers: each worker sees the prompt once before it is a hit
        first = [here.generate([prompt], params, use_tqdm=False)[0] for _ in range(dp_size)]
        again = here.generate([prompt], params, use_tqdm=False)[0]
        both = here.generate([prompt], replace(params, n=2), use_tqdm=False)[0]
    finally:
        if here is not llm:
            here.shutdown()
    assert [o.num_cached_tokens for o in first] == [0] * dp_size
    assert again.num_cached_tokens == 40 and both.num_cached_tokens == 40


@pytest.mark.parametrize("dp_size", [1, 2])
def test_a_cache_salt_shares_the_prefix_cache_only_within_the_salt(llm, dp_size):
    """vLLM's cache_salt (a prompt dict's key offline): a prompt is a prefix-cache hit only for a
    request of the same salt; the output is the same either way."""
    prompt = [7 + i % 150 for i in range(41)]  # 10 full pages of 4, and one token
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)
    here = llm if dp_size == 1 else LLM("tiny", page_size=4, max_total_tokens=4096, dp_size=2)

    def run(salt=None, n=1):
        p = {"prompt_token_ids": prompt} | ({} if salt is None else {"cache_salt": salt})
        # (with dp_size 2, once on each worker: round-robin)
        outs = [here.generate([p], replace(params, n=n), use_tqdm=False)[0] for _ in range(dp_size)]
        return outs[-1]

    try:
        first = [run("a"), run("a"), run("b"), run(), run(), run("b", n=2)]
        with pytest.raises(ValueError, match="prompt 0: cache_salt is ''; allowed: None or a string of 1..1024"):
            here.generate([{"prompt": "x", "cache_salt": ""}], params, use_tqdm=False)
    finally:
        if here is not llm:
            here.shutdown()
    assert [o.num_cached_tokens for o in first] == [0, 40, 0, 0, 40, 40]
    assert len({tuple(o.outputs[0].token_ids) for o in first}) == 1


def test_text_is_decoded_once_without_stop_strings(llm):
    """Without stop strings the engine decodes a request's output once, when it ends; with one, token
    by token. Either way the text is the decode of the output."""
    plain = gen(llm, "text test", max_tokens=10, ignore_eos=True)
    assert plain.text == llm.tokenizer.decode(plain.token_ids)
    streamed = gen(llm, "text test", max_tokens=10, ignore_eos=True, stop=["\x00never"])
    assert streamed.token_ids == plain.token_ids and streamed.text == plain.text
    engine = llm.engine
    req = engine.add_request(llm.tokenizer.encode("text test"), SamplingParams(max_tokens=6, ignore_eos=True))
    context = list(req.detok.ids)  # the prompt's tail, decoded ahead of the output
    while not req.finished:
        assert req.detok.ids == context  # no per-token work while it runs
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert req.text == llm.tokenizer.decode(req.output_ids) and len(req.output_ids) == 6
    req = engine.add_request(llm.tokenizer.encode("text test"), SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(5):
        engine.step()
    engine.abort(req)  # an aborted request keeps the text it had
    want = IncrementalDetokenizer(llm.tokenizer, (), req.prompt_ids)
    want.add(req.output_ids)
    assert req.output_ids and req.text == want.text
    engine.abort(req)  # twice: nothing more
    assert req.text == want.text
    while engine.has_unfinished():
        engine.step()
    never_added = engine.new_request(llm.tokenizer.encode("x"), SamplingParams(max_tokens=2))
    engine.abort(never_added)  # made but never queued: it just ends
    assert never_added.finished and never_added.finish_reason == "abort"


def test_truncate_prompt_tokens_keeps_the_prompts_end(llm, monkeypatch):
    """vLLM's truncate_prompt_tokens: the last k tokens are the prompt (its output, its ids, its
    cache), -1 the context length's worth; a k past the context length is refused. A text is
    tokenized once."""
    text = "a text prompt of more than a few tokens"
    calls = []
    encode = llm.tokenizer.encode
    monkeypatch.setattr(llm.tokenizer, "encode", lambda *a, **k: calls.append(a) or encode(*a, **k))
    cut = gen(llm, text, max_tokens=2, truncate_prompt_tokens=5).prompt_token_ids
    assert cut == TOK.encode(text)[:1] + TOK.encode(text, add_special_tokens=False)[-4:]  # its BOS stays
    assert calls == [(text,)]
    monkeypatch.undo()
    prompt = list(range(60, 90))
    out = gen(llm, prompt, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=10)
    want = gen(llm, prompt[-10:], max_tokens=6, ignore_eos=True)
    assert out.prompt_token_ids == prompt[-10:] and out.token_ids == want.token_ids
    assert gen(llm, prompt, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=-1).prompt_token_ids == prompt
    assert gen(llm, prompt, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=30).prompt_token_ids == prompt
    engine = llm.engine
    req = engine.add_request(prompt, SamplingParams(max_tokens=2, truncate_prompt_tokens=4))
    assert req.prompt_ids == prompt[-4:]  # the engine's own API truncates too
    while engine.has_unfinished():
        engine.step()
    k = engine.context_length + 1
    with pytest.raises(ValueError, match=rf"truncate_prompt_tokens is {k}; allowed: -1 .* or 1..{k - 1}"):
        gen(llm, prompt, truncate_prompt_tokens=k)


def test_max_tokens_gives_length(llm):
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_prepare_builds_every_input_of_mixed_batches(monkeypatch):
    """Every step's device inputs, checked field by field against the requests as scheduled:
    prompt chunks that sample and that do not, a one-token prompt, decodes beside them, and the
    prompt rows scored for prompt logprobs (after the samplers' rows)."""
    llm = LLM("tiny", page_size=4, chunked_prefill_size=16, disable_overlap_schedule=True, max_total_tokens=2048)
    runner, ps = llm.engine.runner, 4
    seen = set()
    real = runner.prepare

    def checked(batch):
        before = [(req, n, req.num_computed, list(req.token_ids), list(req.pages), req.num_tokens) for req, n in batch]
        prefilling = [req.prefilling for req, _ in batch]
        assert prefilling == sorted(prefilling, reverse=True), "prefill chunks come first"
        scored = {req: req.num_prompt_logprobs for req, _ in batch if req.scores_prompt}
        fb, samplers, prompt = real(batch)
        ids, positions, slots, seq_lens, cu, logits, expect_samplers = [], [], [], [], [0], [], []
        prompt_rows, targets, spans = [], [], []
        for (req, n, start, tokens, pages, num_tokens), pre in zip(before, prefilling, strict=True):
            ids += tokens[start : start + n] if pre else [tokens[-1]]  # overlap off: the last token is known
            assert pre or n == 1
            positions += range(start, start + n)
            if req in scored:  # the positions whose next token is a prompt token not scored yet
                for p in range(max(start, scored[req]), min(start + n, len(req.prompt_ids) - 1)):
                    prompt_rows.append(cu[-1] + p - start)
                    targets.append(req.prompt_ids[p + 1])
                    if not spans or spans[-1][0] is not req:
                        spans.append((req, p, 0))
                    spans[-1] = (req, spans[-1][1], spans[-1][2] + 1)
                    seen.add("scored prompt rows")
            slots += [pages[p // ps] * ps + p % ps for p in range(start, start + n)]
            seq_lens.append(start + n)
            cu.append(cu[-1] + n)
            if start + n == num_tokens:
                logits.append(cu[-1] - 1)
                expect_samplers.append(req)
            assert fb.block_tables[len(seq_lens) - 1, : len(pages)].tolist() == pages
            seen.add("prefill" if pre else "decode")
            seen.update({"one-token prefill"} if pre and n == 1 else set())
            seen.update({"chunk without a sample"} if start + n < num_tokens else set())
        seen.update({"mixed"} if any(prefilling) and not all(prefilling) else set())
        assert fb.input_ids.tolist() == ids and fb.positions.tolist() == positions
        assert fb.slot_mapping.tolist() == slots and fb.seq_lens.tolist() == seq_lens
        assert fb.cu_seqlens_q.tolist() == cu and fb.logits_indices.tolist() == logits + prompt_rows
        assert (prompt is None) == (not spans)
        assert prompt is None or (prompt.spans == spans and prompt.targets.tolist() == targets)
        assert fb.max_seqlen_q == max(n for _, n in batch) and samplers == expect_samplers
        assert (fb.positions.dtype, fb.seq_lens.dtype, fb.cu_seqlens_q.dtype) == (torch.int64, torch.int32, torch.int32)
        return fb, samplers, prompt

    monkeypatch.setattr(runner, "prepare", checked)
    prompts = [[7] * 3, [8] * 5, list(range(1, 41)), [9], list(range(2, 19)), list(range(3, 36))]
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=i % 3 or None) for i in range(6)
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.token_ids) == 6 for o in outs)
    assert [len(o.prompt_logprobs or ()) for o in outs] == [0, 5, 40, 0, 17, 33]
    seen_all = {"prefill", "decode", "mixed", "one-token prefill", "chunk without a sample", "scored prompt rows"}
    assert seen == seen_all
    llm.shutdown()


def test_records_built_field_by_field_have_every_field(llm, monkeypatch):
    """The per-request records the scheduler and its sender build with ``tuple.__new__`` (no
    constructor checks their fields) are whole: one value per field."""
    from minengine.scheduler import scheduler as scheduler_module
    from minengine.scheduler.policy import RunningInfo
    from minengine.server.protocol import TokenUpdate
    from minengine.server.scheduler_process import engine_updates

    seen = []
    real = scheduler_module.build_schedule
    monkeypatch.setattr(
        scheduler_module, "build_schedule", lambda running, *a: seen.extend(running) or real(running, *a)
    )
    engine, live = llm.engine, {}
    for i in range(3):
        live[f"r{i}"] = engine.add_request([5 + i, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    updates = []
    while engine.has_unfinished():
        updates += engine_updates(engine, live)
    assert seen and all(type(r) is RunningInfo and len(r) == len(RunningInfo._fields) for r in seen)
    assert len(updates) == 9 and all(len(u) == len(TokenUpdate._fields) for u in updates)
    assert not live


def test_kv_pressure_queues_and_keeps_accounting(kv_checked_steps):
    """KV for only ~3 of 8 requests at once: the rest wait, all finish, pages balance every step."""
    llm = LLM("tiny", page_size=4, max_total_tokens=96, chunked_prefill_size=16)
    prompts = [[10 + i] * 20 for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 10 for o in outs)
    assert max(step["waiting"] for step in kv_checked_steps) > 0
    acc = llm.engine.scheduler.accounting()
    assert acc["held_by_requests"] == 0 and acc["free"] + acc["held_only_by_cache"] == acc["total"]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ck") / "qwen3", "qwen3")


def test_loading_errors(qwen3_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    bad = tmp_path / "gpt2"
    shutil.copytree(qwen3_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(cfg | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*supported: LlamaForCausalLM"):
        LLM(str(bad))
    no_size = {k: v for k, v in cfg.items() if k != "intermediate_size"}
    (bad / "config.json").write_text(json.dumps(no_size))
    with pytest.raises(ValueError, match="config.json lacks intermediate_size"):
        LLM(str(bad))
    (bad / "config.json").write_text(json.dumps(cfg | {"hidden_act": "gelu"}))  # the MLP computes SiLU only
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'.*supported: silu"):
        LLM(str(bad))
    # a head dim the attention kernels do not take: refused at load, not at every generate
    (bad / "config.json").write_text(json.dumps(cfg | {"head_dim": 16}))
    with pytest.raises(
        ValueError, match="head dim 16 in .*config.json is not supported; allowed: multiples of 16 from 32"
    ):
        LLM(str(bad))
    # weights the config has no place for (a layer, a bias) would be dropped: the model would run wrong
    (bad / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 1}))
    with pytest.raises(ValueError, match="of 1 layers as its config.json describes has no place for: model.layers.1"):
        LLM(str(bad))
    # RoPE buffers some trainers save (inv_freq; ColossalAI's cos/sin caches) are not weights
    buffers = tmp_path / "buffers"
    shutil.copytree(qwen3_dir, buffers)
    from safetensors.torch import load_file, save_file

    weights = load_file(buffers / "model.safetensors")
    for name in ("inv_freq", "cos_cached", "sin_cached"):
        weights[f"model.layers.0.self_attn.rotary_emb.{name}"] = torch.ones(16)
    save_file(weights, buffers / "model.safetensors")
    LLM(str(buffers)).shutdown()
    empty = tmp_path / "noweights"
    shutil.copytree(qwen3_dir, empty)
    (empty / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        LLM(str(empty))
    partial = tmp_path / "partial"
    shutil.copytree(qwen3_dir, partial)
    weights = load_file(partial / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, partial / "model.safetensors")
    with pytest.raises(ValueError, match="missing weights in .*model.norm.weight"):
        LLM(str(partial))
    # parts of the merged projections are checked one by one, under their checkpoint names
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, partial / "model.safetensors")
    with pytest.raises(ValueError, match="missing weights in .*model.layers.1.self_attn.k_proj.weight"):
        LLM(str(partial))
    weights = load_file(qwen3_dir / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"][:-1]
    save_file(weights, partial / "model.safetensors")
    with pytest.raises(ValueError, match="weight model.layers.0.mlp.up_proj.weight .* has shape"):
        LLM(str(partial))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_checkpoint_tensors_tile_the_merged_parameters(arch, tmp_path):
    """q/k/v and gate/up are merged projections: every checkpoint weight names exactly its rows,
    with the checkpoint's shape, and together the names cover every parameter element once."""
    from safetensors import safe_open

    from minengine.models import load_model_config
    from minengine.models.decoder import CausalLM

    path = build_checkpoint(tmp_path / arch, arch)
    cfg = load_model_config(str(path))
    net = CausalLM(cfg, 64)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    views = net.checkpoint_tensors()
    assert {name: tuple(t.shape) for name, t in views.items()} == shapes
    assert any("qkv_proj" in name for name, _ in net.named_parameters())
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
        for view in views.values():
            view.add_(1)
    assert all(bool((p == 1).all()) for p in net.parameters())


def test_chat_template_and_real_checkpoint(qwen3_dir):
    llm = LLM(str(qwen3_dir))
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<s><|user|>\nhi</s>\n<|assistant|>\n"
    assert llm.generate(text, GREEDY, use_tqdm=False)[0].finish_reason == "length"


def test_chat_renders_each_conversation_and_generates(qwen3_dir):
    """vLLM's LLM.chat: one conversation or a list; the output's prompt is the rendered text and
    its tokens are those of generating from it (the template's own special tokens, no others)."""
    llm = LLM(str(qwen3_dir))
    hi = [{"role": "user", "content": "hi"}]
    parts = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "a"}]}]
    (one,) = llm.chat(hi, GREEDY, use_tqdm=False)
    assert one.prompt == "<s><|user|>\nhi</s>\n<|assistant|>\n"
    assert one.prompt_token_ids == llm.tokenizer.encode(one.prompt, add_special_tokens=False)
    both = llm.chat([hi, parts], GREEDY, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    assert both[0].token_ids == one.token_ids and "<|system|>\nbe brief" in both[1].prompt
    assert both[1].token_ids == llm.generate(both[1].prompt_token_ids, GREEDY, use_tqdm=False)[0].token_ids
    for bad, message in (
        ([["user"]], "conversation 0 is"),
        (
            [hi, [{"role": "user", "content": [{"type": "image_url"}]}]],
            'conversation 1: messages.0.content.0.type is "image_url"',
        ),
    ):
        with pytest.raises(ValueError, match=message):
            llm.chat(bad, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set"):
        llm.chat(hi, GREEDY, use_tqdm=False, chat_template_kwargs={"messages": []})
    # vLLM's template arguments: the prompt ends inside the last message; no turn opened; a template
    partial = [*hi, {"role": "assistant", "content": "The answer"}]
    (cont,) = llm.chat(partial, GREEDY, use_tqdm=False, continue_final_message=True)
    assert cont.prompt == "<s><|user|>\nhi</s>\n<|assistant|>\nThe answer"
    assert cont.outputs[0].token_ids == llm.generate(cont.prompt_token_ids, GREEDY, use_tqdm=False)[0].token_ids
    (closed,) = llm.chat(hi, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert closed.prompt == "<s><|user|>\nhi</s>\n"
    (own,) = llm.chat(hi, GREEDY, use_tqdm=False, chat_template="{{ messages[0].content }}{{ add_generation_prompt }}")
    assert own.prompt == "hiTrue"
    with pytest.raises(ValueError, match="conversation 0: continue_final_message and add_generation_prompt cannot"):
        llm.chat(partial, GREEDY, use_tqdm=False, add_generation_prompt=True, continue_final_message=True)
    # vLLM's tools: shown to the template (chat_template_kwargs may give its own)
    tool = {"type": "function", "function": {"name": "get_time"}}
    shows = "{{ tools | tojson }}|{{ messages[0].content }}"
    (tooled,) = llm.chat(hi, GREEDY, use_tqdm=False, chat_template=shows, tools=[tool])
    assert tooled.prompt == '[{"type": "function", "function": {"name": "get_time"}}]|hi'
    (theirs,) = llm.chat(
        hi, GREEDY, use_tqdm=False, chat_template=shows, tools=[tool], chat_template_kwargs={"tools": []}
    )
    assert theirs.prompt == "[]|hi"
    with pytest.raises(ValueError, match="tools is 'get_time'; allowed: a list of dicts"):
        llm.chat(hi, GREEDY, use_tqdm=False, tools="get_time")
    llm.shutdown()


def test_dummy_load_format_needs_only_config(qwen3_dir, tmp_path):
    cfg_only = tmp_path / "cfg_only"
    shutil.copytree(qwen3_dir, cfg_only)
    (cfg_only / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="load_format is 'fake'"):
        LLM(str(cfg_only), load_format="fake")
    out = LLM(str(cfg_only), load_format="dummy").generate("hi", GREEDY, use_tqdm=False)[0]
    assert len(out.token_ids) == GREEDY.max_tokens


def test_eos_stops_unless_ignored(llm):
    eos = next(iter(llm.engine.eos_token_ids))
    req = llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=5))
    req.token_ids.append(eos)
    assert llm.engine.stop_reason(req) == "stop"
    ignoring = llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    ignoring.token_ids.append(eos)
    assert llm.engine.stop_reason(ignoring) is None
    while llm.engine.has_unfinished():  # drain them
        llm.engine.step()


def test_shutdown_frees_and_refuses_more_work():
    llm = LLM("tiny")
    llm.shutdown()
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("hi", use_tqdm=False)


def test_tokenizer_matches_auto_tokenizer(qwen3_dir):
    from transformers import AutoTokenizer

    from minengine.tokenizer import Tokenizer

    ours, theirs = Tokenizer.from_dir(qwen3_dir), AutoTokenizer.from_pretrained(qwen3_dir)
    texts = ["Hello world", "  spaces  and\nnewlines\t", "東京 🚀 naïve", "<s>special</s> <|user|> inside", ""]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        ids = theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
    # vLLM's truncate_prompt_tokens on a text: transformers' left truncation (its BOS stays)
    left = AutoTokenizer.from_pretrained(qwen3_dir, truncation_side="left")
    for text in texts[:4]:
        for keep in (1, 2, 5, 100):
            want = left(text, truncation=True, max_length=keep)["input_ids"]
            assert ours.encode(text, truncate_left=keep) == want, (text, keep)
            want = left(text, truncation=True, max_length=keep, add_special_tokens=False)["input_ids"]
            assert ours.encode(text, add_special_tokens=False, truncate_left=keep) == want
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    for gen_prompt in (True, False):
        want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen_prompt) == want


# chat templates for the comparisons with transformers: one that keeps a message as it is, one
# that trims it (as Llama 3's does), one that reads content parts itself
TRIMMING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PARTS_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %};{% endfor %}"
)


def test_continue_final_message_and_a_given_template_render_as_transformers(qwen3_dir):
    """vLLM's continue_final_message and chat_template reach the template as transformers passes
    them: the prompt ends inside the last message (its spaces kept, unless the template trims
    them), by the checkpoint's template or the one given."""
    from transformers import AutoTokenizer

    from minengine.tokenizer import Tokenizer

    ours, theirs = Tokenizer.from_dir(qwen3_dir), AutoTokenizer.from_pretrained(qwen3_dir)
    user = {"role": "user", "content": "q"}
    for template in (None, TRIMMING_TEMPLATE, PARTS_TEMPLATE):
        for final in ("The answer is", "The answer is ", "  spaced  ", "q", "two\nlines\n"):
            messages = [user, {"role": "assistant", "content": final}]
            want = theirs.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=False,
                continue_final_message=True,
                chat_template=template,
            )
            got = ours.apply_chat_template(messages, False, continue_final_message=True, chat_template=template)
            assert got == want, (template, final)
            assert ours.render_chat(messages, continue_final_message=True, chat_template=template) == want
        for gen_prompt in (True, False):
            want = theirs.apply_chat_template(
                [user], tokenize=False, add_generation_prompt=gen_prompt, chat_template=template
            )
            assert ours.render_chat([user], add_generation_prompt=gen_prompt, chat_template=template) == want
    # content parts: the template that reads them sees the tag after the last text part; the others
    # see the parts joined by newlines (as vLLM hands them over)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b "}]
    messages = [user, {"role": "assistant", "content": parts}]
    want = theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True, chat_template=PARTS_TEMPLATE
    )
    assert ours.apply_chat_template(messages, False, True, PARTS_TEMPLATE) == want == "user:q;assistant:[a][b "
    assert ours.render_chat(messages, continue_final_message=True).endswith("<|assistant|>\na\nb ")
    # an empty last message: the prompt ends where its text would start
    empty = [user, {"role": "assistant", "content": ""}]
    assert ours.render_chat(empty, continue_final_message=True) == "<s><|user|>\nq</s>\n<|assistant|>\n"
    for bad, message in (
        (dict(add_generation_prompt=True, continue_final_message=True), "cannot both be true"),
        (dict(continue_final_message=True, chat_template="{{ messages[0].content }}"), "drops part of the final"),
        (dict(chat_template="{% for %}"), "chat_template does not parse"),
        (dict(chat_template_kwargs={"add_generation_prompt": False}), "may not set add_generation_prompt; it is a"),
        (dict(chat_template_kwargs={"chat_template": "x"}), "may not set chat_template"),
    ):
        with pytest.raises(ValueError, match=message):
            ours.render_chat(messages, **bad)


def test_tokenizer_ignores_add_bos_eos_switches_like_transformers(qwen3_dir, tmp_path):
    from transformers import AutoTokenizer

    from minengine.tokenizer import Tokenizer

    path = tmp_path / "switches"
    shutil.copytree(qwen3_dir, path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(cfg | {"add_bos_token": False, "add_eos_token": True}))
    assert Tokenizer.from_dir(path).encode("Hello world") == AutoTokenizer.from_pretrained(path).encode("Hello world")


def test_tokenizer_files_are_read_as_transformers_reads_them(qwen3_dir, tmp_path):
    """chat_template.jinja comes before tokenizer_config.json's template; special tokens missing
    from tokenizer_config.json come from special_tokens_map.json (an older checkpoint's only
    record of them), and every special token reaches the template by name."""
    from transformers import AutoTokenizer

    from minengine.tokenizer import Tokenizer

    path = tmp_path / "older"
    shutil.copytree(qwen3_dir, path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    moved = {k: cfg.pop(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token") if cfg.get(k) is not None}
    assert "eos_token" in moved
    cfg["chat_template"] = "OLD{{ messages[0]['content'] }}"
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "special_tokens_map.json").write_text(json.dumps(moved))
    (path / "chat_template.jinja").write_text(
        "{{ bos_token }}NEW{{ messages[0]['content'] }}{{ eos_token }}[{{ pad_token }}][{{ unk_token }}]"
    )
    ours, theirs = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "hi"}]
    want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == want
    assert "NEW" in want and moved["eos_token"] in want
    assert ours.eos_token_id == theirs.eos_token_id is not None


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_generate_with_data_parallel_workers_aborts_its_requests(monkeypatch, error):
    """Ctrl-C, or an error in one request's task, in a generate over dp_size 2 workers: the requests
    still running are aborted in the workers and nothing is left on the LLM's loop, so the next call
    runs at once and only itself (an error ended the gather, whose cancel then reached no task)."""
    import asyncio

    import minengine.llm as offline

    class Bar:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):  # the first request to end
            raise error("stop")

    llm = LLM("tiny", dp_size=2)
    try:
        monkeypatch.setattr(offline, "tqdm", Bar)
        one = SamplingParams(temperature=0, max_tokens=1)
        long = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
        running = set(asyncio.all_tasks(llm._workers.loop))  # (the client's dispatcher)
        with pytest.raises(error):
            llm.generate(["x", "y y", "z z z", "w"], [one, long, long, long], use_tqdm=False)
        assert not [t for t in asyncio.all_tasks(llm._workers.loop) if not t.done() and t not in running]
        assert not llm._workers.workers.client.queues
        monkeypatch.undo()
        start = time.monotonic()
        out = llm.generate(["hi"], one, use_tqdm=False)[0]
        assert len(out.token_ids) == 1 and time.monotonic() - start < 10
        assert not llm._workers.workers.client.queues  # (each request released, the interrupted ones aborted)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_generate_leaves_nothing_running(monkeypatch, error):
    """A step that raises (Ctrl-C, a failing kernel) ends generate with the error, and its requests
    are aborted: the next call does not run them first."""
    llm = LLM("tiny")
    step, calls = llm.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise error("stop")
        return step()

    monkeypatch.setattr(llm.engine, "step", failing_step)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with pytest.raises(error):
        llm.generate(["a", "b", "c"], params, use_tqdm=False)
    assert not llm.engine.scheduler.has_unfinished()
    calls.clear()
    out = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert len(out.token_ids) == 1 and len(calls) <= 3
    acc = llm.engine.scheduler.accounting()
    assert acc["held_by_requests"] == 0
    llm.shutdown()


def test_an_interrupted_forward_leaves_no_unwritten_kv_in_the_prefix_cache(monkeypatch):
    """Ctrl-C inside a prefill's forward: the scheduler had already handed the prefix cache the
    step's pages (at launch, for overlap), whose KV was never written. The next generate of the
    same prompts must not read them: it matches a fresh engine's."""
    prompts = [f"Document {i}: " + "pages of keys and values. " * 6 for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True)
    fresh = LLM("tiny", page_size=4)
    want = [(o.token_ids, o.outputs[0].cumulative_logprob) for o in fresh.generate(prompts, params, use_tqdm=False)]
    fresh.shutdown()
    llm = LLM("tiny", page_size=4)
    try:
        launch = llm.engine.runner.launch

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(llm.engine.runner, "launch", interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, params, use_tqdm=False)
        monkeypatch.setattr(llm.engine.runner, "launch", launch)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [(o.token_ids, o.outputs[0].cumulative_logprob) for o in got] == want
        assert llm.engine.scheduler.accounting()["held_by_requests"] == 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        (None, "prompts is a NoneType; allowed: a string, a list of token ids"),
        (7, "prompts is a int; allowed"),
        (torch.tensor([1, 2]), "prompts is a Tensor; allowed"),
        ((x for x in ["a"]), "prompts is a generator; allowed"),
        ([[1.0, 2.0]], "prompt 0: prompt token id 1.0 is a float; allowed: Python ints in [0, "),
        ([[torch.tensor(3)]], "prompt 0: prompt token id tensor(3) is a Tensor; allowed: Python ints in [0, "),
    ],
)
def test_prompts_of_a_wrong_type_are_named(llm, prompts, message):
    with pytest.raises(ValueError) as exc:
        llm.generate(prompts, use_tqdm=False)
    assert str(exc.value).startswith(message)
    assert not llm.engine.has_unfinished()


LEFT_WITHOUT_SHUTDOWN = """
import gc, sys
from minengine import LLM, SamplingParams

kept = []

def main():
    llm = LLM("tiny", dp_size=2)
    w = llm._workers.workers
    print(w.ipc_dir, *[p.pid for p in w.processes], flush=True)
    assert llm.generate("x", SamplingParams(max_tokens=1), use_tqdm=False)[0].token_ids
    if sys.argv[1] == "del":
        del llm
        gc.collect()
        print("collected", flush=True)
    else:
        kept.append(llm)  # alive until the interpreter exits

if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("how", ["del", "exit"])
def test_an_llm_left_without_shutdown_stops_its_workers(tmp_path, how):
    """``del`` (the garbage collector) or the interpreter's exit, of an LLM with dp_size 2 that was
    never shut down: the workers exit and the folder of sockets goes (the zmq context, collected
    alone, blocked in ``term``; at exit the folder stayed, and asyncio logged a pending task)."""
    import os
    import sys

    from test_server import alive, run_cli, wait_for

    script = tmp_path / "left.py"
    script.write_text(LEFT_WITHOUT_SHUTDOWN)
    r = run_cli([sys.executable, str(script), how], timeout=120)
    assert r.returncode == 0, r.stderr
    folder, *pids = r.stdout.split("\n")[0].split()
    assert ("collected" in r.stdout) == (how == "del")
    assert not os.path.exists(folder) and wait_for(lambda: not any(alive(int(p)) for p in pids), 10)
    assert "Task was destroyed" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_chat_template_kwargs_that_are_no_dict_are_named(llm):
    with pytest.raises(ValueError, match="chat_template_kwargs is 'abc'; allowed: a dict, or None"):
        llm.chat([{"role": "user", "content": "hi"}], chat_template_kwargs="abc", use_tqdm=False)


def test_an_llm_with_workers_inside_async_code():
    """An LLM with dp_size 2 runs its own event loop: made inside a running one, a clear error
    before any worker starts; shut down inside one (a finalizer in async code), its workers and
    folder of sockets still go (the loop's RuntimeError skipped the stop)."""
    import asyncio
    import os

    async def make():
        return LLM("tiny", dp_size=2)

    with pytest.raises(RuntimeError, match="dp_size is 2: the offline LLM then drives its workers on an event loop"):
        asyncio.run(make())
    llm = LLM("tiny", dp_size=2)
    processes, folder = llm._workers.workers.processes, llm._workers.workers.ipc_dir

    async def stop():
        llm.shutdown()

    asyncio.run(stop())
    assert not any(p.is_alive() for p in processes) and not os.path.exists(folder)


def test_an_llm_whose_worker_died_shuts_down_at_once():
    """A worker of an LLM(dp_size=2) is killed: generate fails naming it, and shutdown ends the
    other at once (it heard no Shutdown; shutdown waited its 5 s grace for nothing)."""
    import os
    import signal

    from minengine.server.frontend import SchedulerDied

    llm = LLM("tiny", dp_size=2)
    processes, folder = llm._workers.workers.processes, llm._workers.workers.ipc_dir
    os.kill(processes[1].pid, signal.SIGKILL)
    processes[1].join(10)
    with pytest.raises(SchedulerDied, match="scheduler process"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
    start = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - start < 3
    assert not any(p.is_alive() for p in processes) and not os.path.exists(folder)


def test_an_llm_as_a_context_manager_shuts_down():
    with LLM("tiny") as llm:
        assert llm.generate("x", SamplingParams(max_tokens=1), use_tqdm=False)[0].token_ids
    with pytest.raises(RuntimeError, match="this LLM was shut down"):
        llm.generate("x", use_tqdm=False)


def test_generation_config_sampling_fields_are_the_defaults(qwen3_dir, tmp_path):
    """As vLLM's --generation-config auto: a generate call without sampling params samples with
    the sampling fields of the model's generation_config.json (top_k 1 here: greedy at any
    temperature); "vllm" leaves them out; a value SamplingParams does not take names the file."""
    path = tmp_path / "recommended"
    shutil.copytree(qwen3_dir, path)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(gen | {"temperature": 0.7, "top_k": 1, "do_sample": True}))
    prompts = [[5 + i, 9, 17 + i] for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(path))
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.7, top_k=1)
    want = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    got = llm.generate(prompts, use_tqdm=False)
    assert [o.token_ids[:6] for o in got] == want
    llm.shutdown()
    llm = LLM(str(path), generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
    llm.shutdown()
    (path / "generation_config.json").write_text(json.dumps(gen | {"top_p": 0}))
    with pytest.raises(ValueError, match="generation_config.json: top_p is 0; allowed: a number in \\(0, 1\\]"):
        LLM(str(path))
    with pytest.raises(ValueError, match="generation_config is 'hf'; allowed: auto, vllm"):
        LLM(str(path), generation_config="hf")


@pytest.mark.parametrize("model_type", ["llama", "mistral", None])
def test_a_sentencepiece_llama_tokenizer_encodes_as_transformers_5(tmp_path, model_type):
    """Llama 2's tokenizer.json (converted from SentencePiece: a Prepend("▁") normalizer)
    declares LlamaTokenizer, which transformers 5 rebuilds (no normalizer, a Metaspace that marks
    only the first piece, unless legacy): minengine encodes and decodes as AutoTokenizer does, for
    a Llama model or none; a Mistral model's file is read as it is."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, normalizers, processors, trainers
    from transformers import AutoTokenizer

    from minengine.tokenizer import Tokenizer

    hf = HF(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    hf.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    special = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=special, show_progress=False)
    hf.train_from_iterator(["The quick brown fox [INST] hello world, said the  dog"] * 20, trainer)
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf.save(str(tmp_path / "tokenizer.json"))
    if model_type is not None:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    texts = [" hello", "hello world", "<s>[INST] hello [/INST]", "</s> The", "  two  spaces ", "naïve 🚀", ""]
    for extra in ({}, {"legacy": True}, {"legacy": False, "add_prefix_space": False}):
        cfg = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg | extra))
        ours, theirs = Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
        for text in texts:
            ids = theirs.encode(text)
            assert ours.encode(text) == ids, (extra, text)
            assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), (extra, text)
            assert ours.decode(ids[1:], False) == theirs.decode(ids[1:]), (extra, text)


def test_max_tokens_none_generates_up_to_the_context():
    """As vLLM: SamplingParams(max_tokens=None) takes all the room the prompt leaves."""
    llm = LLM("tiny", context_length=12)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 9 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="leaving no room to generate; allowed: at most 11"):
        llm.generate([[5] * 12], SamplingParams(max_tokens=None), use_tqdm=False)
    llm.shutdown()
