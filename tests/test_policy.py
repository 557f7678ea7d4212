"""The batch-building policy, as a pure function over plain data."""

from __future__ import annotations

from minengine.scheduler.policy import Budget, RunningInfo, WaitingInfo, build_schedule


def run(rid, pending=1, prefilling=False, held=4, final=4):
    return RunningInfo(rid, pending, prefilling, held, final)


def wait(rid, pending=10, cached=0, pinned=0, final=4):
    return WaitingInfo(rid, pending, cached, pinned, final)


def budget(tokens=100, max_running=8, pages=100, threshold=None):
    return Budget(tokens, max_running, pages, threshold)


def test_decodes_take_one_token_each_running_first():
    s = build_schedule([run(0), run(1)], [wait(2)], budget())
    assert s.running == ((0, 1), (1, 1))
    assert s.admitted == ((2, 10),)
    assert s.num_tokens == 12


def test_unfinished_prefill_continues_with_next_chunk():
    s = build_schedule([run(0, pending=50, prefilling=True), run(1)], [], budget(tokens=20))
    assert s.running == ((0, 20),)  # the chunk uses the whole budget; the decode waits a step


def test_waiting_admitted_in_order_with_budget_left():
    s = build_schedule([run(0)], [wait(1, pending=30), wait(2, pending=30), wait(3)], budget(tokens=50))
    assert s.admitted == ((1, 30), (2, 19))


def test_long_prefill_threshold_caps_prefills_not_decodes():
    s = build_schedule(
        [run(0, pending=50, prefilling=True), run(1)], [wait(2, pending=30)], budget(tokens=100, threshold=8)
    )
    assert s.running == ((0, 8), (1, 1))
    assert s.admitted == ((2, 8),)


def test_max_running_requests_caps_admission():
    s = build_schedule([run(0), run(1)], [wait(2), wait(3)], budget(max_running=3))
    assert s.admitted == ((2, 10),)


def test_full_sequence_kv_check_reserves_what_running_requests_still_need():
    # running request 0 holds 2 of its final 10 pages: 8 are reserved for it
    running = [run(0, held=2, final=10)]
    assert build_schedule(running, [wait(1, final=5)], budget(pages=12)).admitted == ()
    assert build_schedule(running, [wait(1, final=4)], budget(pages=12)).admitted == ((1, 10),)


def test_cached_pages_are_not_needed_but_pinned_ones_cost():
    # 6 of its final 8 pages are cached; 3 of those are evictable now and would be locked
    w = wait(1, pending=4, cached=6, pinned=3, final=8)
    assert build_schedule([], [w], budget(pages=4)).admitted == ()
    assert build_schedule([], [w], budget(pages=5)).admitted == ((1, 4),)


def test_first_come_first_served_head_of_line():
    # the first waiting request does not fit: the smaller one behind it waits too
    s = build_schedule([], [wait(1, final=50), wait(2, final=1)], budget(pages=10))
    assert s.admitted == ()


def test_no_budget_left_admits_nothing():
    s = build_schedule([run(0, pending=10, prefilling=True)], [wait(1)], budget(tokens=10))
    assert s.running == ((0, 10),) and s.admitted == ()
