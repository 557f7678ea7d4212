"""The prefill delayer's decision table, its single-pass executor, and the engine with it on."""

from __future__ import annotations

import pytest

from minengine import LLM, SamplingParams
from minengine.scheduler.prefill_delayer import (
    DelayerConfig,
    DelayState,
    PrefillDelayer,
    WorkerInfo,
    decide,
)

CFG = DelayerConfig(max_running_requests=8, max_delay_passes=3, token_usage_low_watermark=0.2)


def w(prefillable=True, low=False, running=0, max_bs=1):
    return WorkerInfo(prefillable, low, running, max_bs)


@pytest.mark.parametrize(
    ("prev", "infos", "first", "allow", "reason", "status", "count"),
    [
        # all prefillable
        (None, [w(running=7, max_bs=5)], True, True, "no_wait", "all", None),  # the first delay after start
        (None, [w(running=2, max_bs=5)], True, True, "no_wait", "all", None),  # (not spent: nothing to skip)
        (None, [w(running=2, max_bs=5)], False, True, "no_wait", "all", None),  # 8 - 2 >= 5
        (None, [w(running=1, max_bs=1), w(running=7, max_bs=5)], False, False, "delay", "all", 1),  # maxima: any worker
        (None, [w(running=4, max_bs=2), w(running=4, max_bs=2)], False, True, "no_wait", "all", None),  # max, not sum
        (None, [w(low=True, running=7, max_bs=5)], False, False, "delay", "all", 1),  # the watermark is for mixed
        (None, [w(running=7, max_bs=5), w(running=0, max_bs=1)], False, False, "delay", "all", 1),  # 8 - 7 < 5
        (DelayState(1), [w(running=7, max_bs=5)], False, False, "delay", "all", 2),
        (DelayState(2), [w(running=7, max_bs=5)], False, True, "wait_timeout", "all", None),  # max passes - 1
        (DelayState(1), [w(running=3, max_bs=5)], False, True, "wait_success", "all", None),  # drained
        # mixed
        (None, [w(), w(prefillable=False)], False, False, "delay", "mixed", 1),
        (None, [w(), w(prefillable=False)], True, False, "delay", "mixed", 1),  # first pass only matters for all
        (DelayState(1), [w(), w(prefillable=False)], False, False, "delay", "mixed", 2),
        (DelayState(2), [w(), w(prefillable=False)], False, True, "wait_timeout", "mixed", None),
        (DelayState(1), [w(low=True), w(prefillable=False)], False, True, "token_watermark", "mixed", None),
        (None, [w(), w(prefillable=False, low=True)], False, True, "token_watermark", "mixed", None),
        # none
        (DelayState(2), [w(prefillable=False), w(prefillable=False)], False, True, "", "none", None),
    ],
)
def test_decision_table(prev, infos, first, allow, reason, status, count):
    d = decide(prev, infos, CFG, first)
    assert (d.allow, d.reason, d.status) == (allow, reason, status)
    assert d.first_used == (first and status == "all" and reason == "no_wait" and infos[0].running_bs == 7)
    assert (d.next_state.delayed_count if d.next_state else None) == count
    if prev is not None and d.next_state is not None:
        assert d.next_state.start_time == prev.start_time and d.next_state is not prev  # replaced, not mutated


@pytest.mark.parametrize("status", ["all", "mixed"])
def test_one_delay_pass_allowed_means_no_delay(status):
    """max_delay_passes 1: a hold would already be its last pass, so the prefill goes at once."""
    infos = [w(running=7, max_bs=5)] if status == "all" else [w(), w(prefillable=False)]
    d = decide(None, infos, DelayerConfig(max_running_requests=8, max_delay_passes=1), first_pass=False)
    assert (d.allow, d.reason, d.next_state) == (True, "wait_timeout", None)


def test_the_first_delay_after_start_is_skipped_once():
    """As SGLang's skip_first_delayer: passes that would not delay leave it unspent; the first that
    would is allowed, and from then on the rule holds."""
    delayer = PrefillDelayer(CFG)
    reasons = []
    for info in (w(running=0, max_bs=5), w(running=2, max_bs=5), w(running=7, max_bs=5), w(running=7, max_bs=5)):
        p = delayer.begin_pass()
        p.negotiate(info)
        p.finalize(actual_prefill=False)
        reasons.append(delayer.outcomes[-1].reason)
    assert reasons == ["no_wait", "no_wait", "no_wait", "delay"] and delayer.first_pass is False


def test_a_wait_ends_when_its_requests_leave_between_passes():
    """One worker, overlap off: a held request aborted while the engine goes idle ends the wait then
    (its passes, not the idle seconds after it), and the next request's first pass is a new one."""
    import time

    llm = LLM("tiny", page_size=4, max_running_requests=4, enable_prefill_delayer=True,
              prefill_delayer_max_delay_passes=10, disable_overlap_schedule=True)  # fmt: skip
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    reqs = [eng.add_request([i + 1] * 5, short) for i in range(2)] + [eng.add_request([3] * 5, params)]
    eng.step()
    reqs += [eng.add_request([i + 10] * 5, params) for i in range(4)]  # the first delay (skipped) admits 1
    for _ in range(10):  # then two seats free up for the other three: held
        eng.step()
        if eng.delayer.outcomes[-1].reason == "delay":
            break
    assert eng.delayer.outcomes[-1].reason == "delay"
    for req in reqs:
        eng.abort(req)
    ended = eng.delayer.outcomes[-1]
    assert ended.reason == "" and ended.waited_passes >= 1 and ended.waited_seconds < 1
    time.sleep(0.3)
    eng.add_request([3] * 5, params)
    eng.step()
    first = eng.delayer.outcomes[-1]
    assert first.reason == "no_wait" and first.waited_passes is None


def test_one_negotiation_per_pass_and_finalize_fills_in():
    calls = []

    def gather(info):
        calls.append(info)
        return [info, w(prefillable=False)]

    delayer = PrefillDelayer(CFG, gather)
    p = delayer.begin_pass()
    assert p.negotiate(w()) is False  # mixed, no watermark: delay
    assert p.negotiate(w()) is False and len(calls) == 1  # no second collective
    p.finalize(actual_prefill=False)
    assert len(calls) == 1
    idle = delayer.begin_pass()
    idle.finalize(actual_prefill=False)  # a pass with nothing to prefill still joins the collective
    assert len(calls) == 2 and calls[-1].prefillable is False
    assert [o.reason for o in delayer.outcomes] == ["delay", ""]
    assert delayer.outcomes[-1].waited_passes == 1  # the wait ended (status none)


def test_delayer_delays_times_out_and_everything_completes(kv_checked_steps):
    llm = LLM(
        "tiny", page_size=4, max_running_requests=4, enable_prefill_delayer=True, prefill_delayer_max_delay_passes=3
    )
    eng = llm.engine
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    first = [eng.add_request([i + 1] * 5, long) for i in range(2)]
    for _ in range(3):
        eng.step()
    short = [
        eng.add_request([i + 20] * 5, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)) for i in range(6)
    ]
    while eng.has_unfinished():
        eng.step()
    assert all(r.finished and r.finish_reason == "length" for r in first + short)
    reasons = [o.reason for o in eng.delayer.outcomes]
    assert "delay" in reasons and "wait_timeout" in reasons
    assert any(o.waited_passes == 2 for o in eng.delayer.outcomes)


@pytest.mark.parametrize("overlap", [True, False])
def test_same_greedy_outputs_with_the_delayer(overlap):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [f"prompt number {i}" for i in range(7)]
    base = LLM("tiny", page_size=4, max_running_requests=3).generate(prompts, params, use_tqdm=False)
    delayed = LLM(
        "tiny",
        page_size=4,
        max_running_requests=3,
        enable_prefill_delayer=True,
        prefill_delayer_max_delay_passes=2,
        disable_overlap_schedule=not overlap,
    ).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in delayed] == [o.token_ids for o in base]
