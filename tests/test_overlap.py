"""Overlap scheduling: step N+1 is launched before step N's tokens are read.

Requests that finish, hit a stop token or string, or are aborted in step N must come out of
N+1 with no extra token and with their KV freed exactly once (the allocator raises on a double
free); outputs equal those with overlap off.
"""

from __future__ import annotations

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from minengine import LLM, SamplingParams
from minengine.engine import Engine
from minengine.structured import StructuredOutputs

PROMPTS = ["overlap one", "a second, longer overlap prompt", "3"]


def outputs(overlap: bool, params, **config):
    llm = LLM("tiny", page_size=4, chunked_prefill_size=16, disable_overlap_schedule=not overlap, **config)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    acc = llm.engine.scheduler.accounting()
    assert acc["held_by_requests"] == 0 and acc["free"] + acc["held_only_by_cache"] == acc["total"]
    return [(o.token_ids, o.text, o.finish_reason) for o in outs]


def test_overlap_really_runs_ahead(kv_checked_steps):
    llm = LLM("tiny", page_size=4)
    eng = llm.engine
    eng.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.step()
    assert eng._in_flight is not None  # launched, not read: the host is a step behind
    while eng.has_unfinished():
        eng.step()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_same_outputs_with_overlap_on_and_off(temperature):
    params = SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, seed=3)
    assert outputs(True, params) == outputs(False, params)


def test_stop_token_in_step_n_emits_nothing_after(kv_checked_steps):
    base = outputs(True, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stop_id = base[1][0][4]
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id])
    got = outputs(True, params)
    assert got == outputs(False, params)
    assert got[1][0] == base[1][0][: base[1][0].index(stop_id) + 1] and got[1][2] == "stop"


def test_stop_string_in_step_n_emits_nothing_after():
    base = outputs(True, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    text = base[0][1]
    stop = text[2:4]
    params = SamplingParams(temperature=0, max_tokens=12, stop=[stop])
    got = outputs(True, params)
    assert got == outputs(False, params)
    assert got[0][1] == text[: text.find(stop)] and got[0][2] == "stop"


@pytest.mark.parametrize("overlap", [True, False])
def test_abort_while_next_step_is_in_flight(overlap, kv_checked_steps):
    llm = LLM("tiny", page_size=4, disable_overlap_schedule=not overlap)
    eng: Engine = llm.engine
    keep = eng.add_request([1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    gone = eng.add_request([9, 8, 7, 6, 5, 4], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert (eng._in_flight is not None) is overlap
    seen = len(gone.token_ids)
    eng.abort(gone)  # its next token is being sampled right now (overlap on)
    assert gone.finished and gone.finish_reason == "abort" and gone.pages == []
    while eng.has_unfinished():
        eng.step()
    assert len(gone.token_ids) == seen  # nothing after the abort
    assert len(keep.output_ids) == 20
    acc = eng.scheduler.accounting()
    assert acc["held_by_requests"] == 0 and acc["free"] + acc["held_only_by_cache"] == acc["total"]


def test_slot_reused_after_abort_mid_chunked_prefill():
    """An abort mid-prompt queues page-table writes for a slot the next request takes at once."""
    prompt = list(range(10, 40))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM("tiny", page_size=4).generate([prompt[::-1]], params, use_tqdm=False)[0].token_ids
    llm = LLM("tiny", page_size=4, chunked_prefill_size=8)
    eng = llm.engine
    first = eng.add_request(prompt, params)
    eng.step()
    eng.step()  # two chunks in: the completed pages went to the prefix cache
    slot = first.slot
    eng.abort(first)
    second = eng.add_request(prompt[::-1], params)
    while eng.has_unfinished():
        eng.step()
    assert second.slot is None and second.output_ids == want
    assert slot is not None


class NoHostReads(TorchDispatchMode):
    """Fails any op that reads a tensor's value back to the host (on CUDA, a wait for the device):
    ``item`` and casts, ``nonzero``, boolean masks, ``unique``, ``bincount``,
    ``repeat_interleave`` without its output size, ``index_put_(accumulate=True)`` (range-checked
    on the host by some torch versions). ``tolist`` is no op here: the engine reads its step's host
    copies with it."""

    READS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "bincount"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        assert name not in self.READS, f"{func} reads a value back to the host"
        if name == "repeat_interleave":
            assert kwargs.get("output_size") is not None, f"{func} without output_size"
        if name in ("index_put", "index_put_"):
            assert not kwargs.get("accumulate", len(args) > 3 and args[3]), f"{func} with accumulate=True"
        return func(*args, **kwargs)


def steps_without_host_reads(guard, **config) -> None:
    """Decode steps with sampling, logprobs, every logit adjustment, a stop string and a grammar
    in the batch, then requests that join (prefill chunks with prompt logprobs, their first
    tokens) and finish, all under ``guard``: what the scheduling, launch and result paths run."""
    llm = LLM("tiny", max_running_requests=16, chunked_prefill_size=32, **config)
    engine = llm.engine
    base = dict(max_tokens=60, ignore_eos=True)
    params = [
        SamplingParams(temperature=0, **base),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1, **base),
        SamplingParams(temperature=0.7, logprobs=3, stop=["\x00never"], **base),
        SamplingParams(temperature=0, logit_bias={65: 2.0}, min_tokens=30, repetition_penalty=1.3, **base),
        SamplingParams(temperature=0, bad_words=["aa", "q"], frequency_penalty=0.5, **base),
        SamplingParams(temperature=0, allowed_token_ids=[32, *range(97, 123)], **base),
    ]
    joining = [
        SamplingParams(temperature=0, prompt_logprobs=2, presence_penalty=1.0, max_tokens=8),
        SamplingParams(temperature=0.9, seed=7, bad_words=["xyz"], max_tokens=12),
        SamplingParams(temperature=0, structured_outputs=StructuredOutputs(choice=["red", "green"])),
    ]
    try:
        for i, p in enumerate(params):
            engine.add_request(engine.tokenizer.encode(f"steady {i} " * (i + 1)), p)
        while any(r.prefilling for r in engine.scheduler.running) or len(engine.scheduler.running) < len(params):
            engine.step()
        for _ in range(3):  # each path's first run (kernel compiles, graph warm-up)
            engine.step()
        added = [engine.add_request(engine.tokenizer.encode(f"joins {i} " * 9), p) for i, p in enumerate(joining)]
        for req in added:
            if req.matcher is not None:
                req.matcher.compiled.result()  # (compiled before the guard: xgrammar's own work)
        with guard():
            while not all(req.finished for req in added):
                engine.step()
        assert len(engine.scheduler.running) == len(params)  # (the others still run)
    finally:
        llm.shutdown()


def test_steps_read_no_value_back_from_the_device(monkeypatch):
    """#5's rule that the scheduling path waits for no device (but the step in flight's event), on
    CPU by the ops the steps run; ``test_gpu_engine`` runs the same steps under torch's CUDA sync
    debug mode. (xgrammar's bitmask is host memory by design, and unguarded: its allocation reads a
    value.)"""
    from torch.utils._python_dispatch import _disable_current_modes

    from minengine import structured

    real = structured.allowed_mask

    def allowed_mask(*args):
        with _disable_current_modes():
            return real(*args)

    monkeypatch.setattr(structured, "allowed_mask", allowed_mask)
    steps_without_host_reads(NoHostReads, device="cpu")
