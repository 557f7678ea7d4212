"""Logits adjusted before sampling, as vLLM adjusts them: ``logit_bias``, ``min_tokens`` and the
repetition / frequency / presence penalties. Greedy outputs against a float64 transformers
reference under scheduling shapes that split, preempt and overlap steps (and through the
data-parallel front end); the sampler alone against the same reference; the stop-string rule of
``min_tokens``."""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import SCHEDULING_SHAPES, doubled_letter, prompts_for

from minengine import LLM, SamplingParams
from minengine.detokenizer import IncrementalDetokenizer
from minengine.models.tiny import tiny_tokenizer
from minengine.request import Request
from minengine.sampler import Sampler
from minengine.sampling_params import FLOAT32_MAX, FLOAT32_TINY, GREEDY_TEMPERATURE


def adjusted(
    logits: torch.Tensor,
    prompt: list[int],
    output: list[int],
    p: SamplingParams,
    eos: set[int],
    bad_words: tuple[tuple[int, ...], ...] = (),
):
    """float64 reference of vLLM's adjustments of one position's logits [V], ``output`` the
    tokens before it: only the allowed tokens; the bad words' last tokens where the output ends in
    the rest of them (``bad_words``: tokenized); bias; the min_tokens ban; the penalties."""
    x = logits.double().clone()
    if p.allowed_token_ids is not None:
        keep = torch.zeros(x.shape[0], dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        x[~keep] = float("-inf")
    for ids in bad_words:
        if len(output) >= len(ids) - 1 and output[len(output) - len(ids) + 1 :] == list(ids[:-1]):
            x[ids[-1]] = float("-inf")
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    if len(output) < p.min_tokens:
        for token in set(p.stop_token_ids or ()) | (set() if p.ignore_eos else eos):
            if token < x.shape[0]:  # (a stop id may lie past the vocabulary)
                x[token] = float("-inf")
    vocab = x.shape[0]
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=vocab).double()
    seen = counts > 0
    in_prompt = torch.zeros(vocab, dtype=torch.bool)
    in_prompt[prompt] = True
    r = p.repetition_penalty
    x = torch.where(seen | in_prompt, torch.where(x > 0, x / r, x * r), x)
    return x - p.frequency_penalty * counts - p.presence_penalty * seen.double()


@torch.inference_mode()
def check_greedy(model, prompt: list[int], out, p: SamplingParams, eos: set[int], bad_words=()) -> int:
    """Each output token is the argmax (up to near ties) of the reference's adjusted logits given
    the tokens before it; its logprob (if asked) is the raw one. Returns how many positions the
    adjustment moved the argmax at."""
    output = out.token_ids
    logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 :]
    moved = 0
    for pos, token in enumerate(output):
        x = adjusted(logits[pos], prompt, output[:pos], p, eos, bad_words)
        assert x[token] >= x.max() - 1e-4, f"position {pos}: token {token} is not the argmax"
        moved += int(logits[pos].argmax()) != int(x.argmax())
        if p.logprobs is not None:
            raw = logits[pos].log_softmax(-1)[token].item()
            assert out.logprobs[pos][token].logprob == pytest.approx(raw, abs=2e-4)
    return moved


@SCHEDULING_SHAPES
def test_greedy_with_adjusted_logits_matches_a_float64_reference(checkpoint, hf_model, config):
    vocab, eos = hf_model.config.vocab_size, {hf_model.config.eos_token_id}
    rng = random.Random()
    biased = {rng.randrange(4, vocab): 3.0, rng.randrange(4, vocab): -100.0, rng.randrange(4, vocab): 0.5}
    params = [
        SamplingParams(  # (its logprobs stay the model's raw ones)
            max_tokens=14,
            temperature=0,
            repetition_penalty=1.8,
            frequency_penalty=0.6,
            presence_penalty=0.3,
            logprobs=1,
        ),
        SamplingParams(max_tokens=14, temperature=0, logit_bias=biased, frequency_penalty=-0.5, ignore_eos=True),
        # the end token is the likeliest once biased: banned for 5 tokens, then it ends the output
        SamplingParams(max_tokens=14, temperature=0, min_tokens=5, logit_bias={min(eos): 100.0}),
        SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),  # no adjustment, in the same batch
    ]
    prompts = prompts_for(vocab)
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", **config)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        # seeded sampling with penalties takes the same tokens alone as in a batch (its counts are its own)
        sampled = SamplingParams(max_tokens=10, temperature=0.8, seed=5, presence_penalty=1.5, ignore_eos=True, n=2)
        batch = llm.generate(prompts, [sampled] * len(prompts), use_tqdm=False)
        alone = llm.generate(prompts[:1], sampled, use_tqdm=False)
    finally:
        llm.shutdown()
    moved = 0
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        moved += check_greedy(hf_model, prompt, out.outputs[0], p, eos)
    assert moved, "the adjustments changed no token: the test checks nothing"
    ended = outs[2].outputs[0]
    assert ended.token_ids[-1] in eos and len(ended.token_ids) == 6 and ended.finish_reason == "stop"
    assert [s.token_ids for s in alone[0].outputs] == [s.token_ids for s in batch[0].outputs]


def occurs(word: tuple[int, ...], ids: list[int]) -> bool:
    return any(tuple(ids[i : i + len(word)]) == word for i in range(len(ids) - len(word) + 1))


@SCHEDULING_SHAPES
def test_allowed_tokens_and_bad_words_match_a_float64_reference(checkpoint, hf_model, config):
    """A token biased to be taken every time, with the word of it twice banned, alternates; a
    single-token bad word is never taken even when biased; allowed_token_ids confine the output;
    with the other adjustments and with seeded sampling too."""
    vocab, eos = hf_model.config.vocab_size, {hf_model.config.eos_token_id}
    prompts = prompts_for(vocab)
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", **config)
    try:
        letter, token = doubled_letter(llm.tokenizer)
        (single,) = llm.tokenizer.encode("e", add_special_tokens=False)
        allowed = random.Random().sample(sorted(set(range(vocab)) - {token, single}), 12)
        params = [
            SamplingParams(
                max_tokens=12, temperature=0, ignore_eos=True, bad_words=[letter * 2, "e"], logit_bias={token: 100}
            ),
            SamplingParams(max_tokens=12, temperature=0, allowed_token_ids=allowed, logprobs=1),
            SamplingParams(
                max_tokens=12,
                temperature=0,
                ignore_eos=True,
                bad_words=[letter * 2],
                allowed_token_ids=sorted({token, *allowed}),
                presence_penalty=0.4,
                logit_bias={token: 50, single: 50},
            ),
            SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),  # nothing adjusted, in the same batch
        ]
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        sampled = SamplingParams(
            max_tokens=10, temperature=0.9, seed=3, bad_words=[letter * 2], logit_bias={token: 8}, n=2, ignore_eos=True
        )
        batch = llm.generate(prompts, [sampled] * len(prompts), use_tqdm=False)
        alone = llm.generate(prompts[1:2], sampled, use_tqdm=False)
        bad = [p.bad_words_token_ids(llm.tokenizer, vocab) for p in params]
    finally:
        llm.shutdown()
    assert (token, token) in bad[0] and (single,) in bad[0]
    moved = 0
    for prompt, p, out, ids in zip(prompts, params, outs, bad, strict=True):
        moved += check_greedy(hf_model, prompt, out, p, eos, ids)
        assert not any(occurs(word, out.token_ids) for word in ids)
    assert moved
    # the biased token is taken wherever it is not banned: after itself, and after the first token
    # of the word's other tokenization (" " + the word, when it is two tokens ending in it)
    for out, ids in ((outs[0], bad[0]), (outs[2], bad[2])):
        before = {word[0] for word in ids if len(word) == 2 and word[1] == token}
        assert token in before
        taken = [i == 0 or out.token_ids[i - 1] not in before for i in range(len(out.token_ids))]
        assert [t == token for t in out.token_ids] == taken, (out.token_ids, before)
    assert single not in outs[0].token_ids
    assert set(outs[1].token_ids) <= set(allowed) and set(outs[2].token_ids) <= {token, *allowed}
    assert [s.token_ids for s in alone[0].outputs] == [s.token_ids for s in batch[1].outputs]
    assert not any(occurs((token, token), s.token_ids) for o in batch for s in o.outputs)
    assert any(token in s.token_ids for o in batch for s in o.outputs)


def request(prompt: list[int], output: list[int], p: SamplingParams) -> Request:
    """A request being sampled: its next token is in flight (as after the scheduler's advance)."""
    generator = None if p.seed is None else torch.Generator().manual_seed(p.seed)
    req = Request(rid=0, prompt_ids=prompt, params=p, max_len=len(prompt) + len(output) + 8, generator=generator)
    req.token_ids = prompt + output
    req.num_inflight = 1
    return req


def test_sampler_adjusts_only_what_is_asked_and_counts_on_the_device():
    """A batch of adjusted, plain greedy and sampled rows over several steps: greedy rows take the
    reference's argmax, the raw logits (read for logprobs) and a graph's argmax buffer are left as
    they were, and a row with nothing to adjust samples the same token as in a batch without the others."""
    vocab, eos = 50, {1}
    sampler = Sampler(torch.device("cpu"), seed=0, eos_token_ids=frozenset(eos))
    rng = random.Random()
    adjusting = [
        SamplingParams(temperature=0, repetition_penalty=0.7, frequency_penalty=1.0, presence_penalty=-0.4),
        SamplingParams(temperature=0, logit_bias={3: 2.0, 7: -1.5}, min_tokens=2, stop_token_ids=[9]),
        SamplingParams(temperature=0, min_tokens=3),
        SamplingParams(temperature=1.0, seed=3, presence_penalty=2.0),
        SamplingParams(temperature=0, min_tokens=3, ignore_eos=True),  # the end token is not banned
    ]
    plain = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=11)]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 6))] for _ in adjusting + plain]
    reqs = [request(pr, [], p) for pr, p in zip(prompts, adjusting + plain, strict=True)]
    alone = [request(pr, [], p) for pr, p in zip(prompts[len(adjusting) :], plain, strict=True)]
    alone_sampler = Sampler(torch.device("cpu"), seed=0)
    for _ in range(6):
        logits = torch.randn(len(reqs), vocab) * 3
        # in the adjusted rows, the end token is the likeliest by far (min_tokens must ban it), the
        # stop token id next
        logits[: len(adjusting), 1] = 100
        logits[: len(adjusting), 9] = 50
        raw, argmax = logits.clone(), logits.argmax(-1)
        graph_argmax = argmax.clone()  # a CUDA graph's output buffer: adjusted rows take no token from it
        tokens = sampler(logits, reqs, greedy=graph_argmax).tolist()
        assert torch.equal(logits, raw) and torch.equal(graph_argmax, argmax)
        alone_tokens = alone_sampler(raw[len(adjusting) :].clone(), alone).tolist()
        assert tokens[len(adjusting) :] == alone_tokens
        for i, (req, token) in enumerate(zip(reqs, tokens, strict=True)):
            x = adjusted(raw[i], req.prompt_ids, req.output_ids, req.params, eos)
            if req.params.greedy:
                assert x[token] >= x.max() - 1e-5
            else:
                assert x[token] > float("-inf")
            if req.params.penalizes:
                counts = torch.bincount(torch.tensor(req.output_ids + [token]), minlength=vocab)
                assert torch.equal(req.output_counts, counts.int())
        for req, token in zip(reqs + alone, tokens + alone_tokens, strict=True):
            req.token_ids.append(token)
    assert reqs[2].output_ids[:4] == [9, 9, 9, 1]  # its end banned for 3 tokens
    assert not {1, 9} & set(reqs[1].output_ids[:2])
    assert reqs[4].output_ids[:3] == [1, 1, 1]  # ignore_eos: min_tokens bans no end token


def test_bad_word_ends_are_banned_on_the_device_step_by_step():
    """Words of one to four tokens, two of them ending in the same token; logits that push the
    output into them: a word's last token is banned exactly when the output ends in the rest (the
    prompt does not count), each request's output tail moves on with its sampled token on the
    device, and a decode server's first token (sampled elsewhere) starts it."""
    vocab = 12
    words = ((3,), (4, 5), (6, 4, 5), (7, 8, 9, 5))  # (4, 5) and (7, 8, 9, 5) both end in 5
    sampler = Sampler(torch.device("cpu"), seed=0)
    p = SamplingParams(temperature=0, bad_words=["(tokenized below)"])
    limited = SamplingParams(temperature=0, allowed_token_ids=[2, 5, 9])
    rng = random.Random()
    reqs = [request([4, 7, 8, 9], [], p), request([1], [6], p), request([2], [], limited), request([2], [], p)]
    for req in (reqs[0], reqs[1], reqs[3]):
        req.bad_words_ids = words
    for step in range(40):
        logits = torch.randn(len(reqs), vocab)
        for row, req in enumerate(reqs):  # the likeliest: the next token of a word the output has begun
            out, word = req.output_ids, rng.choice(words)
            done = max(k for k in range(len(word)) if out[len(out) - k :] == list(word[:k]))
            logits[row, word[done]] += 6
        if step == 0:
            logits[0, 5] += 20  # the prompt ends in 4: (4, 5) may still begin the output with 5
        raw = logits.clone()
        tokens = sampler(logits, reqs).tolist()
        for row, (req, token) in enumerate(zip(reqs, tokens, strict=True)):
            ids = req.bad_words_ids
            x = adjusted(raw[row], req.prompt_ids, req.output_ids, req.params, set(), ids)
            assert x[token] >= x.max() - 1e-6, f"step {step}, row {row}: {token} is not the reference's argmax"
            req.token_ids.append(token)
            if ids:
                out = req.output_ids
                assert req.output_tail.tolist() == ([-1] * 3 + out)[-3:]  # on the device, moved on
                assert not any(occurs(w, out) for w in ids)
    assert reqs[0].output_ids[0] == 5
    assert reqs[2].output_tail is None and set(reqs[2].output_ids) <= {2, 5, 9}


def test_sampling_with_every_adjustment_makes_no_op_that_waits_for_a_cuda_device():
    """Every adjustment in one batch, its ops recorded: no op that reads a value back to the host
    (``item``, ``nonzero``, a boolean mask), and no ``index_put_(accumulate=True)`` (whose indices
    some torch versions range-check on the host on CUDA). CPU runs the same ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            self.seen.append(
                (func.overloadpacket.__name__, kwargs.get("accumulate", args[3] if len(args) > 3 else None))
            )
            return func(*args, **kwargs)

    sampler = Sampler(torch.device("cpu"), seed=0, eos_token_ids=frozenset({1}))
    params = [
        SamplingParams(temperature=0, logit_bias={3: 2.0, 7: -1.5}, min_tokens=2, stop_token_ids=[9]),
        SamplingParams(temperature=0.8, seed=3, repetition_penalty=1.2, presence_penalty=0.5, top_p=0.9, top_k=5),
        SamplingParams(temperature=0, allowed_token_ids=[2, 5, 9]),
        SamplingParams(temperature=0, bad_words=["(tokenized below)"]),
        SamplingParams(temperature=0.5),
    ]
    reqs = [request([4, 7, 8], [2, 4], p) for p in params]
    reqs[3].bad_words_ids = ((3,), (4, 5), (6, 4, 5))
    for step in range(3):
        with Ops() as ops:
            tokens = sampler(torch.randn(len(reqs), 12), reqs)
        names = {name for name, _ in ops.seen}
        assert not names & {"_local_scalar_dense", "nonzero", "masked_select", "item"}, (step, names)
        assert not [a for name, a in ops.seen if name in ("index_put", "index_put_") and a], step
        for req, token in zip(reqs, tokens.tolist(), strict=True):
            req.token_ids.append(token)


def test_counts_start_from_the_output_a_decode_server_was_handed():
    """A disaggregated decode server's first token came from the prefill server: counted too."""
    p = SamplingParams(temperature=0, frequency_penalty=2.0)
    req = request([5, 6], [4], p)
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.zeros(1, 8)
    logits[0, 4] = 1.5  # the likeliest, but already out once: 1.5 - 2 < 0
    assert sampler(logits, [req]).tolist() == [0]
    assert req.output_counts.tolist() == [1, 0, 0, 0, 1, 0, 0, 0]


@pytest.mark.parametrize("temperature", [0.0, 1.0, 2 * GREEDY_TEMPERATURE])
@pytest.mark.parametrize(("penalty", "allowed_logit"), [(FLOAT32_TINY, 10.0), (FLOAT32_MAX, -10.0)])
def test_logits_that_overflow_still_sample_an_allowed_token(temperature, penalty, allowed_logit):
    """The extreme repetition penalties allowed send seen tokens' logits past float32 (+inf with
    the smallest, -inf with the largest): they stay finite, also over the smallest temperature
    that samples, so greedy and sampled draws take an allowed token, not token 0 (a NaN softmax or
    an all -inf row did; 0 is not allowed here and has the largest raw logit)."""
    p = SamplingParams(temperature=temperature, seed=3, repetition_penalty=penalty, allowed_token_ids=[1, 2])
    req = request([1, 2], [], p)
    logits = torch.tensor([[50.0, allowed_logit, allowed_logit, 0.0]])
    tokens = Sampler(torch.device("cpu"), seed=0)(logits, [req])
    assert tokens.tolist()[0] in (1, 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(presence_penalty=2.5), "presence_penalty is 2.5; allowed: a number in [-2.0, 2.0]"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty is nan"),
        (dict(repetition_penalty=0.0), "repetition_penalty is 0.0; allowed: a number in [1.17549e-38, 3.40282e+38]"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty is inf; allowed: a number in [1.17549e-38"),
        (dict(repetition_penalty=1e-50), "repetition_penalty is 1e-50; allowed: a number in [1.17549e-38"),
        (dict(temperature=float("inf")), "temperature is inf; allowed: a number in [0, 3.40282e+38]"),
        (dict(temperature=1e39), "temperature is 1e+39; allowed: a number in [0, 3.40282e+38]"),
        (dict(min_tokens=-1), "min_tokens is -1; allowed: an integer >= 0"),
        (dict(min_tokens=17), "min_tokens is 17; allowed: an integer in [0, max_tokens] = [0, 16]"),
        (dict(min_tokens=True), "min_tokens is True"),
        (dict(logit_bias={3: 101}), "logit_bias of token 3 is 101; allowed: a number in [-100.0, 100.0]"),
        (dict(logit_bias={-3: 1.0}), "logit_bias has token id -3; allowed: an integer >= 0"),
        (dict(logit_bias=[3]), "logit_bias is [3]"),
        (dict(stop_token_ids=[3, -5]), "stop_token_ids is [3, -5]; allowed: a list of token ids (integers >= 0)"),
    ],
)
def test_bad_adjustments_are_refused(kwargs, message):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    assert str(exc.value).startswith(message)


def test_a_logit_bias_token_outside_the_vocabulary_is_refused():
    llm = LLM("tiny", page_size=4)
    try:
        vocab = llm.engine.model_config.vocab_size
        with pytest.raises(ValueError, match=rf"logit_bias token id {vocab} is outside the vocabulary \[0, {vocab}\)"):
            llm.generate(["x"], SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
        # a prefill server checks min_tokens against the one token it makes
        assert SamplingParams(max_tokens=20, min_tokens=9).first_token_only().min_tokens == 1
    finally:
        llm.shutdown()


def test_token_lists_are_put_on_the_device_once_each_id_once():
    """``allowed_token_ids`` and the end tokens ``min_tokens`` bans go to the device at the
    request's first adjusted step, duplicates dropped (a stop id past the vocabulary too), and are
    reused after that: a long list costs a step no host work. The sampled tokens stay those of the
    float64 reference."""
    vocab, eos = 40, {1}
    sampler = Sampler(torch.device("cpu"), seed=0, eos_token_ids=frozenset(eos))
    p = SamplingParams(
        temperature=0,
        allowed_token_ids=[1, 7, 9, 12] * 50_000,
        min_tokens=3,
        stop_token_ids=[9, 9, 33, 1000] * 50_000,
    )
    req = request([5], [], p)
    q = SamplingParams(temperature=0, allowed_token_ids=[3, 4, 3], min_tokens=2)  # a second row of each
    other = request([6], [], q)
    made = []
    for step in range(5):
        logits = torch.randn(2, vocab)
        logits[:, 1], logits[:, 9], logits[:, 33] = 100, 90, 95  # ends first, then a stop id
        raw = logits.clone()
        token, other_token = sampler(logits, [req, other]).tolist()
        x = adjusted(raw[0], req.prompt_ids, req.output_ids, p, eos)
        assert x[token] >= x.max() - 1e-5 and token in (7, 12) + ((1, 9) if step >= 3 else ())
        y = adjusted(raw[1], other.prompt_ids, other.output_ids, q, eos)
        assert y[other_token] >= y.max() - 1e-5 and other_token in (3, 4)
        made.append((req.allowed_ids, req.end_ids))
        req.token_ids.append(token)
        other.token_ids.append(other_token)
    assert req.allowed_ids.tolist() == [1, 7, 9, 12] and req.end_ids.tolist() == [1, 9, 33]
    assert all(a is made[0][0] and e is made[0][1] for a, e in made)
    req.drop_sampler_state()
    assert req.allowed_ids is None and req.end_ids is None


def test_allowed_tokens_that_the_first_step_bans_are_refused():
    """Every allowed token an end token that ``min_tokens`` holds back, or a one-token bad word:
    the first step could sample none of them (a row of -inf gives token 0, allowed or not)."""
    llm = LLM("tiny", page_size=4)
    try:
        ends = sorted(llm.engine.eos_token_ids)
        end = ends[0]
        refused = [
            SamplingParams(allowed_token_ids=ends, min_tokens=2),
            SamplingParams(allowed_token_ids=[end, 70], stop_token_ids=[70], min_tokens=1),
            SamplingParams(allowed_token_ids=[98, 98], bad_words=["b"]),
        ]
        for p in refused:
            with pytest.raises(ValueError, match=r"allowed_token_ids is \[.*ban them all"):
                llm.generate(["x"], p, use_tqdm=False)
        fine = [
            SamplingParams(allowed_token_ids=[end], min_tokens=2, ignore_eos=True, max_tokens=2),
            SamplingParams(allowed_token_ids=[end, 70], stop_token_ids=[70], max_tokens=2),
        ]
        outs = llm.generate(["x"] * 2, fine, use_tqdm=False)
        assert outs[0].outputs[0].token_ids == [end, end] and outs[1].outputs[0].token_ids[0] in (end, 70)
    finally:
        llm.shutdown()


def test_a_finished_request_gives_back_its_counts():
    llm = LLM("tiny", page_size=4)
    try:
        p = SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.2, presence_penalty=0.5)
        reqs = [llm.engine.add_request([5, 6, 7], p) for _ in range(2)]
        llm.engine.step()
        llm.engine.step()
        assert all(r.output_counts is not None and r.prompt_seen is not None for r in reqs)
        llm.engine.abort(reqs[0])
        assert reqs[0].output_counts is None and reqs[0].prompt_seen is None
        while llm.engine.has_unfinished():
            llm.engine.step()
        assert reqs[1].finished and reqs[1].output_counts is None and reqs[1].prompt_seen is None
    finally:
        llm.shutdown()


TOK = tiny_tokenizer()


@pytest.mark.parametrize(
    ("stop", "min_tokens", "text"),
    [
        ("b", 0, "a"),
        ("b", 4, "abca"),  # no stop string ends in the first min_tokens tokens' text
        ("ca", 3, "ab"),  # one may begin there and end after it
        ("ab", 12, "abcabcabcabc"),
        ("a", 3, "ba€"),  # the third token is the first byte of "€": its text is "ba"
    ],
)
def test_min_tokens_keeps_stop_strings_from_ending_in_its_text(stop, min_tokens, text):
    ids = TOK.encode("ba€a" if "€" in text else "abc" * 4, add_special_tokens=False)
    p = SamplingParams(stop=stop, min_tokens=min_tokens, max_tokens=20)
    one = IncrementalDetokenizer.for_request(TOK, p, [])
    out = "".join(one.add([t]) for t in ids) + one.finish()
    together = IncrementalDetokenizer.for_request(TOK, p, [])  # tokens that arrive several at a time
    out_together = together.add(ids[:2]) + together.add(ids[2:7]) + together.add(ids[7:]) + together.finish()
    assert out == out_together == text
    assert one.stopped == (text != "abc" * 4)
    for cut in range(len(ids) + 1):  # any split of the tokens into two calls
        d = IncrementalDetokenizer.for_request(TOK, p, [])
        assert d.add(ids[:cut]) + d.add(ids[cut:]) + d.finish() == text


def test_min_tokens_with_a_stop_string_offline():
    llm = LLM("tiny", page_size=4)
    try:
        free = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        first = free[0].outputs[0].text[:1]
        assert first, "the tiny model's greedy output starts with a character"
        stop = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=first)
        assert llm.generate(["abc"], stop, use_tqdm=False)[0].outputs[0].text == ""
        held = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=first, min_tokens=8)
        out = llm.generate(["abc"], held, use_tqdm=False)[0].outputs[0]
        assert out.text == free[0].outputs[0].text and out.finish_reason == "length"
    finally:
        llm.shutdown()
