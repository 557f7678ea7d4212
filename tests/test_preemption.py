"""Preemption by recompute (``kv_admission="preempt"``, the default).

A request is admitted on the KV its next tokens need, not its whole ``max_tokens``; when a
running request's next tokens find no page, the newest running requests are preempted: their
KV goes to the prefix cache (or is freed), they return to the front of the queue and resume by
recomputing their tokens. Outputs must not change, whatever is preempted when: greedy and
seeded outputs equal those of a run with KV for everything, with overlap on and off.
"""

from __future__ import annotations

import random

import pytest

from minengine import LLM, SamplingParams
from minengine.engine import Engine
from minengine.request import Status
from minengine.server.metrics import Metrics


def workload(seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(2, 30))] for _ in range(10)]
    params = [
        SamplingParams(max_tokens=rng.randrange(1, 60), ignore_eos=True, temperature=0.8, seed=i)
        if i % 2
        else SamplingParams(max_tokens=rng.randrange(1, 60), ignore_eos=True, temperature=0)
        for i in range(len(prompts))
    ]
    return prompts, params


def run(prompts, params, **config):
    llm = LLM("tiny", **({"page_size": 4, "chunked_prefill_size": 24} | config))
    outs = llm.generate(prompts, params, use_tqdm=False)
    eng = llm.engine
    preempted = eng.scheduler.num_preemptions
    acc = eng.scheduler.accounting()
    assert acc["held_by_requests"] == 0 and acc["free"] + acc["held_only_by_cache"] == acc["total"]
    llm.shutdown()
    return [(o.token_ids, o.finish_reason) for o in outs], preempted


@pytest.mark.parametrize(
    "config",
    [dict(), dict(disable_overlap_schedule=True), dict(disable_radix_cache=True), dict(page_size=1)],
    ids=["overlap", "no-overlap", "no-radix", "page1"],
)
def test_preempted_requests_resume_with_the_same_tokens(config, kv_checked_steps):
    seed = random.randrange(1 << 30)
    prompts, params = workload(seed)
    want, none = run(prompts, params, kv_admission="reserve")
    assert none == 0
    # KV for the longest request alone (29 + 59 tokens): most of the others get preempted
    got, preempted = run(prompts, params, max_total_tokens=96, **config)
    assert got == want, f"seed {seed}"
    assert preempted > 0, f"seed {seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_preempted_requests_resume_with_the_same_tokens_on_gpu(backend, kv_checked_steps):
    """On a GPU: decode steps replay CUDA graphs while requests are preempted and readmitted
    (slots and pages change between replays), overlap on, float32."""
    if backend == "cuda":
        pytest.importorskip("minengine._C")
    seed = random.randrange(1 << 30)
    prompts, params = workload(seed)
    gpu = dict(device="cuda", dtype="float32", attention_backend=backend)
    want, none = run(prompts, params, kv_admission="reserve", **gpu)
    assert none == 0
    got, preempted = run(prompts, params, max_total_tokens=96, cuda_graph_max_bs=16, **gpu)
    assert got == want, f"seed {seed}"
    assert preempted > 0, f"seed {seed}"


def test_requests_without_a_small_max_tokens_run_together():
    """The case preemption is for: max_tokens up to the context (chat clients that send none)."""
    params = SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0)
    for mode, together in (("preempt", 8), ("reserve", 1)):
        eng = LLM("tiny", page_size=4, max_total_tokens=4096, kv_admission=mode).engine
        reqs = [eng.add_request([5 + i] * 8, params) for i in range(8)]
        for _ in range(3):
            eng.step()
        assert len(eng.scheduler.running) == together, mode
        for req in reqs:
            eng.abort(req)
        eng.step()
        assert eng.scheduler.accounting()["held_by_requests"] == 0


def two_running(overlap: bool, max_tokens: int = 8):
    llm = LLM("tiny", page_size=4, disable_overlap_schedule=not overlap)
    eng: Engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    old = eng.add_request([1, 2, 3, 4, 5, 6], params)
    new = eng.add_request([9, 8, 7, 6, 5], params)
    return eng, old, new


def finish_all(eng: Engine) -> None:
    while eng.has_unfinished():
        eng.step()
    acc = eng.scheduler.accounting()
    assert acc["held_by_requests"] == 0 and acc["free"] + acc["held_only_by_cache"] == acc["total"]


@pytest.mark.parametrize("overlap", [True, False])
def test_preempted_with_a_token_in_flight_resumes_after_it(overlap, kv_checked_steps):
    eng, _, ref = two_running(overlap)
    finish_all(eng)
    eng, old, new = two_running(overlap)
    for _ in range(3):
        eng.step()
    assert new.num_inflight == overlap  # overlap: its next token is being sampled right now
    eng.scheduler._preempt(new)
    assert new.status is Status.WAITING and new.pages == [] and eng.scheduler.waiting[0] is new
    eng.step()  # the token arrives; the request cannot resume before it has
    assert new.num_inflight == 0 and new.num_preemptions == 1
    finish_all(eng)
    assert new.output_ids == ref.output_ids and new.finish_reason == "length"
    assert new.num_computed == len(new.token_ids) - 1 and len(old.output_ids) == 8


def test_the_token_in_flight_can_finish_a_preempted_request(kv_checked_steps):
    eng, old, new = two_running(True, max_tokens=3)
    while len(new.output_ids) + new.num_inflight < 3:  # its last token in flight
        eng.step()
    eng.scheduler._preempt(new)
    eng.step()
    assert new.finished and new.finish_reason == "length" and len(new.output_ids) == 3
    assert new not in eng.scheduler.waiting
    finish_all(eng)


def test_abort_a_preempted_request_with_a_token_in_flight(kv_checked_steps):
    eng, old, new = two_running(True)
    for _ in range(3):
        eng.step()
    eng.scheduler._preempt(new)
    seen = len(new.token_ids)
    eng.abort(new)
    assert new.finished and new.finish_reason == "abort" and new not in eng.scheduler.waiting
    finish_all(eng)
    assert len(new.token_ids) == seen and len(old.output_ids) == 8


def test_preemptions_metric_counts_the_workers_sum():
    m = Metrics()
    m.set_gauges({"num_preemptions": 3})
    m.set_gauges({"num_preemptions": 3, "num_requests_running": 1})
    m.set_gauges({"num_preemptions": 5})
    assert "minengine:num_preemptions_total 5.0" in m.render().decode()


def test_the_oldest_is_not_preempted_when_newer_ones_sharing_a_prefix_make_room(kv_checked_steps):
    """B and C lock the same cached prefix: preempting one frees none of it, both frees it all.
    The scheduler preempts one at a time and plans again on exact counts, so A (the oldest, its
    prompt prefilled 3 pages a step) keeps running while B and C give way."""
    llm = LLM("tiny", page_size=4, max_total_tokens=52, chunked_prefill_size=32, long_prefill_token_threshold=12)
    eng = llm.engine
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    prefix = list(range(7, 15))  # 2 pages
    llm.generate([prefix + [3]], greedy(1), use_tqdm=False)  # the prefix is now in the cache
    a = eng.add_request(list(range(100, 148)), greedy(2))
    b, c = (eng.add_request(prefix + [t], greedy(30)) for t in (200, 201))
    finish_all(eng)
    assert eng.scheduler.num_preemptions > 0 and a.num_preemptions == 0
    want = LLM("tiny", kv_admission="reserve").generate([r.prompt_ids for r in (a, b, c)], greedy(30), use_tqdm=False)
    assert a.output_ids == want[0].token_ids[:2]
    assert [b.output_ids, c.output_ids] == [o.token_ids for o in want[1:]]


@pytest.mark.parametrize("mode", ["preempt", "reserve"])
def test_decode_server_preallocation(mode):
    """A decode server's admission (``Scheduler.preallocate``, no transfer needed to check it):
    preempt mode takes the pages of the prompt and the reserved tokens plus a page per request
    running or receiving; reserve mode the whole sequence beside what the others may need. No
    request is admitted while one it preempted waits or is still recomputing its tokens."""
    eng = LLM("tiny", page_size=4, max_total_tokens=64, kv_admission=mode, chunked_prefill_size=2).engine  # 16 pages
    sched = eng.scheduler
    params = SamplingParams(max_tokens=40, ignore_eos=True)  # 10 + 40 tokens: 13 pages at its longest
    reqs = [eng.new_request(list(range(20 + i, 30 + i)), params) for i in range(5)]
    # 10 prompt + 2 reserved tokens: 3 pages each, plus a page per request already there
    admitted = [sched.preallocate(r, 2) for r in reqs]
    assert admitted == ([True] * 4 + [False] if mode == "preempt" else [True] + [False] * 4)
    assert [len(r.pages) for r in sched.receiving] == [3] * admitted.count(True)
    if mode == "preempt":  # 12 pages taken, 4 free: the 5th needs 3 + 4 of headroom
        assert sched.allocator.num_free == 4
        sched.activate(reqs[0], 1)
        sched._preempt(reqs[0])  # 7 free or evictable now: enough for the 5th (3 + 3) ...
        assert sched.allocator.num_free + sched.cache.evictable_pages == 7
        assert not sched.preallocate(reqs[4], 2)  # ... but the preempted request goes first
        sched.activate(reqs[1], 1)
        sched.finish(reqs[1], "length")  # 10 now: room for the 5th beside the 1st's recompute too
        # readmitted, the 1st recomputes its 11 tokens (8 cached, then chunks of 2); a new request
        # would take the pages of its next chunks and could not be preempted for them while its KV
        # arrives, so it waits for the recompute too
        for computed in (10, 11):
            assert not sched.preallocate(reqs[4], 2)
            sched.advance(sched.schedule())
            assert reqs[0].status is Status.RUNNING and reqs[0].num_computed == computed
        assert sched.allocator.num_free + sched.cache.evictable_pages == 7
        assert sched.preallocate(reqs[4], 2)  # 3 pages + 3 of headroom


@pytest.mark.parametrize("mode", ["preempt", "reserve"])
def test_decode_server_admits_a_prompt_it_has_cached_whole(mode):
    """A decode server with its own prefix cache and no reserved decode tokens: a page-aligned
    prompt found whole in the cache has nothing to receive and takes no page now, but still needs
    a seat. (It was refused as a request with nothing to compute, at every try; the decode
    server's first-come queue admits nothing past a refused request.)"""
    eng = LLM("tiny", page_size=4, max_total_tokens=64, kv_admission=mode).engine  # 16 pages
    sched = eng.scheduler
    prompt = list(range(10, 18))  # 2 full pages
    sched.cache.insert(prompt, sched.allocator.alloc(2))
    free = sched.allocator.num_free
    req = eng.new_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    assert sched.preallocate(req, 0)
    assert req.cached_pages == 2 and len(req.pages) == 2 and sched.allocator.num_free == free
    other = eng.new_request(list(range(50, 58)), SamplingParams(max_tokens=4, ignore_eos=True))
    assert sched.preallocate(other, 0) and len(other.pages) == 2
