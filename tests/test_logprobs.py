"""Output-token logprobs (``SamplingParams.logprobs``; the APIs' ``logprobs`` / ``top_logprobs``)
against a float64 transformers reference, under scheduling shapes that split, preempt and overlap
steps, offline and through the data-parallel workers' front end."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from checkpoints import SCHEDULING_SHAPES, prompts_for

from minengine import LLM, Logprob, SamplingParams
from minengine.logprobs import prompt_offline
from minengine.request import Request
from minengine.runner import token_logprobs
from minengine.scheduler.scheduler import Scheduler

K = 4


@torch.inference_mode()
def reference(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V] float64 log-probabilities of each output position."""
    ids = torch.tensor([prompt + output])
    logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(output) - 1]
    return logits.log_softmax(-1)


def check_step(step: dict, token: int, row: torch.Tensor, k: int, tokenizer) -> float:
    """One position's {token id: Logprob} against the reference log-probabilities ``row`` [V]:
    ``token`` first, with its logprob and rank, then the top k at their ranks. Returns its logprob."""
    first = next(iter(step))
    assert first == token, "the sampled (prompt) token comes first"
    lp = step[token]
    assert isinstance(lp, Logprob) and lp.decoded_token == tokenizer.token_text(token)
    assert lp.logprob == pytest.approx(row[token].item(), abs=2e-4)
    # its rank, up to near ties
    assert int((row > row[token] + 1e-4).sum()) + 1 <= lp.rank <= int((row >= row[token] - 1e-4).sum())
    # the top k (and the token itself, when it is not one of them), at their ranks
    values = row.sort(descending=True).values
    others = {t: v for t, v in step.items() if t != token}
    ranks = {v.rank for v in others.values()} | ({lp.rank} if lp.rank <= k else set())
    assert ranks == set(range(1, k + 1)) and len(step) == k + (lp.rank > k)
    for t, v in others.items():
        assert v.logprob == pytest.approx(row[t].item(), abs=2e-4)
        assert v.logprob == pytest.approx(values[v.rank - 1].item(), abs=2e-4)
        assert v.decoded_token == tokenizer.token_text(t)
    return lp.logprob


def check_output(out, ref: torch.Tensor, k: int, tokenizer) -> None:
    assert len(out.logprobs) == len(out.token_ids) == ref.shape[0]
    total = 0.0
    for pos, (token, step) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        total += check_step(step, token, ref[pos], k, tokenizer)
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-6)


@SCHEDULING_SHAPES
def test_logprobs_match_a_float64_reference(checkpoint, hf_model, config):
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", **config)
    try:
        prompts = prompts_for(hf_model.config.vocab_size)
        params = [
            SamplingParams(max_tokens=12, temperature=0.9, seed=3, logprobs=K, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=0, logprobs=K, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=1.0, top_k=5, logprobs=1, ignore_eos=True, n=2),
            SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        ]
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, p, o in zip(prompts, params, outs, strict=True):
            for seq in o.outputs:
                if p.logprobs is None:
                    assert seq.logprobs is None and seq.cumulative_logprob is None
                    continue
                check_output(seq, reference(hf_model, prompt, seq.token_ids), p.logprobs, llm.tokenizer)
        # raw logprobs: a greedy token is the most likely one
        assert all(step[t].rank == 1 for t, step in zip(outs[1].token_ids, outs[1].outputs[0].logprobs, strict=True))
        # asking for logprobs changes no token
        again = llm.generate(prompts[:1], SamplingParams(max_tokens=12, temperature=0.9, seed=3, ignore_eos=True))
        assert again[0].token_ids == outs[0].token_ids
    finally:
        llm.shutdown()


def test_logprobs_zero_lists_only_the_sampled_token():
    llm = LLM("tiny", device="cpu")
    try:
        out = llm.generate("hello", SamplingParams(max_tokens=4, logprobs=0, seed=1), use_tqdm=False)[0].outputs[0]
        assert [list(step) for step in out.logprobs] == [[t] for t in out.token_ids]
        assert out.cumulative_logprob == pytest.approx(
            sum(s[t].logprob for t, s in zip(out.token_ids, out.logprobs, strict=True))
        )
    finally:
        llm.shutdown()


def test_token_logprobs_kernel_on_ties_and_masked_tokens():
    """As vLLM, a token's rank counts the tokens at least as likely (itself included); a -inf logit
    gives -inf, not NaN."""
    logits = torch.tensor([[1.0, 3.0, 3.0, -float("inf")], [0.0, 0.0, 0.0, 0.0]])
    tokens = torch.tensor([2, 3])
    values, ids = token_logprobs(logits, tokens, torch.tensor([0, 1]), 2)
    ref = logits.double().log_softmax(-1)
    assert values[0, 0].item() == pytest.approx(ref[0, 2].item()) and ids[0, 0].item() == 2
    assert ids[0, 1:].tolist() in ([1, 2], [2, 1])
    assert values[1, 0].item() == pytest.approx(-torch.log(torch.tensor(4.0)).item()) and ids[1, 0].item() == 4
    whole = token_logprobs(logits, tokens, None, 2)  # every row: no copy of the rows
    assert torch.equal(whole[0], token_logprobs(logits, tokens, torch.tensor([0, 1]), 2)[0])
    values, ids = token_logprobs(logits, torch.tensor([3, 0]), torch.tensor([0]), 0)
    assert values.shape == (1, 1) and values[0, 0].item() == -float("inf") and ids[0, 0].item() == 4


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0, "3"])
def test_bad_logprobs_are_refused(bad):
    with pytest.raises(ValueError, match=r"logprobs is .*; allowed: None or an integer in \[0, 20\]"):
        SamplingParams(logprobs=bad)


def test_commit_keeps_logprobs_aligned_with_the_tokens_it_keeps():
    """A request finished since the launch drops its token and its logprobs together."""
    sched = Scheduler.__new__(Scheduler)
    keep = Request(0, [1, 2], SamplingParams(logprobs=1), max_len=10, num_inflight=1)
    gone = Request(1, [1, 2], SamplingParams(logprobs=1), max_len=10, num_inflight=1)
    plain = Request(2, [1, 2], SamplingParams(), max_len=10, num_inflight=1)
    gone.status = gone.status.FINISHED
    entries = [(-0.5, 1, [7], [-0.5]), (-1.0, 2, [3], [-0.2]), None]
    got = Scheduler.commit(sched, [keep, gone, plain], [7, 8, 9], lambda r: None, entries)
    assert got == [keep, plain]
    assert keep.output_logprobs == [entries[0]] and gone.output_logprobs == [] and plain.output_logprobs is None


def test_a_scheduler_process_sends_each_logprob_once_and_keeps_none():
    """The server's scheduler hands each token's logprobs to the front end with the token and
    drops them (the front end keeps what the response needs), so a long request holds no list."""
    from minengine.server.scheduler_process import engine_updates

    llm = LLM("tiny", device="cpu")
    try:
        engine = llm.engine
        live = {"r": engine.add_request([5, 6, 7], SamplingParams(max_tokens=9, logprobs=2, ignore_eos=True))}
        req, sent = live["r"], []
        while live:
            for update in engine_updates(engine, live):
                assert len(update.logprobs) == len(update.new_token_ids) == 1
                sent += update.logprobs
            assert req.output_logprobs == []
        assert len(sent) == 9 and all(len(e[2]) == 2 for e in sent)
    finally:
        llm.shutdown()


def test_json_shapes_floor_what_json_cannot_carry():
    """-inf (a token the model rules out) and NaN (logits that overflowed) become vLLM's -9999.0."""
    from minengine import logprobs as fmt
    from minengine.models.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    entries = [(float("nan"), 1, [10], [float("-inf")])]
    out = fmt.completion([10], entries, tok)
    assert out["token_logprobs"] == [-9999.0] and list(out["top_logprobs"][0].values()) == [-9999.0]
    chat = fmt.chat([10], entries, tok)
    assert chat[0]["logprob"] == -9999.0 and chat[0]["top_logprobs"][0]["logprob"] == -9999.0


# --- prompt logprobs (SamplingParams.prompt_logprobs; the completions API's echo) ---------------


@torch.inference_mode()
def prompt_reference(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V] float64: row i scores prompt token i + 1."""
    return model(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)


def check_prompt(out, prompt: list[int], ref: torch.Tensor, k: int, tokenizer) -> None:
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None, "None for the first token, then one per token"
    for pos, (token, step) in enumerate(zip(prompt[1:], lps[1:], strict=True)):
        check_step(step, token, ref[pos], k, tokenizer)


@SCHEDULING_SHAPES
def test_prompt_logprobs_match_a_float64_reference(checkpoint, hf_model, config):
    """Every prompt token's logprob, rank and top k, across chunks, pages and preemption; the
    tokens generated are those of the same requests without prompt logprobs. A request asking
    for them computes its whole prompt, as in vLLM: its prefix cache hits are 0."""
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", **config)
    try:
        prompts = prompts_for(hf_model.config.vocab_size)
        base = dict(max_tokens=6, temperature=0, ignore_eos=True)
        plain = llm.generate(prompts, SamplingParams(**base), use_tqdm=False)  # caches the shared prefix
        params = [
            SamplingParams(**base, prompt_logprobs=K),
            SamplingParams(**base, prompt_logprobs=0, logprobs=2),
            SamplingParams(**{**base, "temperature": 1.0}, seed=5, prompt_logprobs=1, n=2),
            SamplingParams(**base, prompt_logprobs=3),  # a one-token prompt: [None]
        ]
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, p, o, ref_out in zip(prompts, params, outs, plain, strict=True):
            check_prompt(o, prompt, prompt_reference(hf_model, prompt), p.prompt_logprobs, llm.tokenizer)
            assert o.num_cached_tokens == 0
            if p.temperature == 0:
                assert o.token_ids == ref_out.token_ids
        if config.get("max_total_tokens"):
            assert llm.engine.scheduler.num_preemptions > 0
        # without prompt logprobs the same prompt reads the prefix cache again
        again = llm.generate(prompts[2], SamplingParams(**base), use_tqdm=False)[0]
        assert again.prompt_logprobs is None and again.num_cached_tokens > 0
    finally:
        llm.shutdown()


def test_prompt_logprobs_in_flight_across_a_preemption_are_kept_once(checkpoint, hf_model):
    """Overlap on: a request preempted while a prompt chunk's results are in flight recomputes its
    prompt; the scored positions it computes again are not added twice."""
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", page_size=4, chunked_prefill_size=8)
    try:
        engine = llm.engine
        prompt = prompts_for(hf_model.config.vocab_size)[2]  # 53 tokens: 7 chunks
        req = engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2))
        engine.step()  # chunk 1 launched
        engine.step()  # chunk 2 launched, chunk 1 read
        assert req.num_prompt_logprobs == 8 and engine.has_unfinished()
        engine.scheduler._preempt(req)  # chunk 2's results still in flight
        # the recompute, in one chunk, is prepared before chunk 2 is read: it scores positions 8 on
        engine.scheduler.chunked_prefill_size = 64
        calls = []
        add = req.add_prompt_logprobs
        req.add_prompt_logprobs = lambda first, entries: (calls.append((first, len(entries))), add(first, entries))
        while engine.has_unfinished():
            engine.step()
        assert calls == [(8, 8), (8, len(prompt) - 9)], "the recompute scored positions 8..15 again"
        assert req.num_preemptions == 1 and len(req.prompt_logprobs) == len(prompt) - 1
        out = SimpleNamespace(prompt_logprobs=prompt_offline(prompt, req.prompt_logprobs, llm.tokenizer))
        check_prompt(out, prompt, prompt_reference(hf_model, prompt), 2, llm.tokenizer)
    finally:
        llm.shutdown()


def test_add_prompt_logprobs_keeps_each_position_once():
    req = Request(0, [1, 2, 3, 4, 5, 6], SamplingParams(prompt_logprobs=0), max_len=8)
    entry = [(-float(i), 1, [], []) for i in range(5)]  # entry i scores prompt token i + 1
    req.add_prompt_logprobs(0, entry[:2])
    req.add_prompt_logprobs(2, entry[2:4])
    req.add_prompt_logprobs(0, entry[:3])  # recomputed after a preemption: nothing new
    req.add_prompt_logprobs(2, entry[2:5])
    assert req.prompt_logprobs == entry and req.num_prompt_logprobs == 5 and not req.scores_prompt
    with pytest.raises(AssertionError):
        Request(0, [1, 2, 3], SamplingParams(prompt_logprobs=0), max_len=4).add_prompt_logprobs(1, entry[1:2])


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0])
def test_bad_prompt_logprobs_are_refused(bad):
    with pytest.raises(ValueError, match=r"prompt_logprobs is .*; allowed: None or an integer in \[0, 20\]"):
        SamplingParams(prompt_logprobs=bad)


def test_prompt_logprobs_are_sliced_to_bound_the_logits_they_hold(monkeypatch):
    """A chunk's scored rows make their logits a slice at a time: the same values as all at once."""
    from minengine import runner

    llm = LLM("tiny", device="cpu")
    try:
        model = llm.engine.model
        hidden = torch.randn(11, model.config.hidden_size)
        targets = torch.randint(0, model.config.vocab_size, (11,))
        whole = runner.prompt_logprobs(model, hidden, targets, 3)
        monkeypatch.setattr(runner, "PROMPT_SLICE_ELEMENTS", 2 * model.config.vocab_size)  # 2 rows a slice
        sliced = runner.prompt_logprobs(model, hidden, targets, 3)
        assert torch.allclose(whole[0], sliced[0]) and torch.equal(whole[1], sliced[1])
        assert torch.allclose(whole[0], token_logprobs(model.logits(hidden), targets, None, 3)[0])
    finally:
        llm.shutdown()


def test_a_step_queues_every_host_copy_before_the_event_its_reader_waits_for(monkeypatch):
    """The CUDA path of ``ModelRunner.sample``, run on CPU with the device's type, copies and event
    stood in for: the tokens', logprobs' and prompt logprobs' copies to the host all come before
    the step's event (``resolve`` waits for it, then reads them all), and they carry the values
    the CPU path gives."""
    from minengine import runner as runner_module

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=3)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    llm = LLM("tiny", device="cpu", chunked_prefill_size=4)
    try:
        want = llm.generate(prompts, params, use_tqdm=False)
        log = []

        class Event:
            def record(self):
                log.append("event")

            def synchronize(self):
                assert log[-1] == "event"

        def to_host(x):
            log.append("copy")
            return x.clone()

        runner = llm.engine.runner
        real_sample = runner.sample

        def sample(step):
            log.clear()
            runner.device = SimpleNamespace(type="cuda")  # (only the branch taken reads it)
            try:
                real_sample(step)
            finally:
                runner.device = torch.device("cpu")
            assert log[-1] == "event" and log.count("event") == 1, log
            copies.append(log.count("copy"))

        copies = []
        monkeypatch.setattr(runner_module, "_to_host", to_host)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(runner, "sample", sample)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert 5 in copies  # a step with tokens, logprobs and prompt logprobs
        for g, w in zip(got, want, strict=True):
            assert g.prompt_logprobs == w.prompt_logprobs and g.outputs[0].logprobs == w.outputs[0].logprobs
            assert g.token_ids == w.token_ids
    finally:
        llm.shutdown()


def test_a_scheduler_process_sends_prompt_logprobs_with_the_first_token_and_keeps_none():
    from minengine.server.scheduler_process import engine_updates

    llm = LLM("tiny", device="cpu", chunked_prefill_size=4)
    try:
        engine = llm.engine
        prompt = list(range(5, 16))
        live = {"r": engine.add_request(prompt, SamplingParams(max_tokens=3, prompt_logprobs=1))}
        req, firsts = live["r"], []
        while live:
            for update in engine_updates(engine, live):
                firsts.append(update.prompt_logprobs)
        assert len(firsts) == 3 and firsts[1:] == [None, None] and len(firsts[0]) == len(prompt) - 1
        assert req.prompt_logprobs == [] and req.num_prompt_logprobs == len(prompt) - 1
    finally:
        llm.shutdown()
