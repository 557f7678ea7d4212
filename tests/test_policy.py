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


# --- preempt mode: pages for this step's tokens only, the newest running requests give way -----


def prun(rid, computed, held, pending=1, prefilling=False, freed=None, preemptible=True):
    """A running request in preempt mode (page size 4): ``freed`` defaults to all it holds."""
    return RunningInfo(rid, pending, prefilling, held, 99, computed, held if freed is None else freed, preemptible)


def pbudget(pages, tokens=100, max_running=8):
    return Budget(tokens, max_running, pages, None, preempt=True, page_size=4)


def test_preempt_mode_takes_only_the_pages_of_this_step():
    # decodes at a page boundary need a page each; one inside a page needs none
    running = [prun(0, computed=8, held=2), prun(1, computed=5, held=2), prun(2, computed=4, held=1)]
    s = build_schedule(running, [], pbudget(pages=2))
    assert s.running == ((0, 1), (1, 1), (2, 1)) and s.preempted == ()


def test_preempt_mode_preempts_the_newest_until_the_oldest_fits():
    # request 0's chunk needs 3 pages, 1 is free: the newest (2), then 1, give theirs
    running = [prun(0, computed=4, held=1, pending=12, prefilling=True), prun(1, 8, 1), prun(2, 8, 1)]
    s = build_schedule(running, [wait(9)], pbudget(pages=1))
    assert s.preempted == (2, 1) and s.running == ((0, 12),)
    assert s.admitted == ()  # a step that preempts admits nothing


def test_preempt_mode_a_request_with_nothing_newer_preempts_itself():
    running = [prun(0, computed=8, held=2), prun(1, computed=8, held=2)]
    s = build_schedule(running, [], pbudget(pages=0))
    # 1 (the newest) gives its 2 pages; 0 takes one of them; 1 is not scheduled
    assert s.preempted == (1,) and s.running == ((0, 1),)
    # preempting 1 frees nothing the policy can count (pages shared with another request): 0 gives
    # way too, newest first, so the oldest resumes first
    running = [prun(0, computed=8, held=2, freed=0), prun(1, computed=8, held=2, freed=0)]
    s = build_schedule(running, [], pbudget(pages=0))
    assert s.preempted == (1, 0) and s.running == ()


def test_preempt_mode_never_preempts_an_older_request_or_a_reservation():
    # 2 is a reservation (its KV is arriving from a prefill server): it cannot be preempted, so
    # 1 gives way itself; 0, older, keeps its place
    running = [prun(0, 8, 2), prun(1, 8, 2), prun(2, 0, 3, pending=0, preemptible=False)]
    s = build_schedule(running, [], pbudget(pages=1))
    assert s.running == ((0, 1),) and s.preempted == (1,)


def test_preempt_mode_admits_the_pages_of_its_chunk_and_keeps_a_page_per_running_request():
    running = [prun(0, computed=5, held=2), prun(1, computed=6, held=2)]  # need no page now
    w = wait(9, pending=8)  # 2 pages for its 8 tokens, + 1 page of growth each for 0 and 1
    assert build_schedule(running, [w], pbudget(pages=3)).admitted == ()
    assert build_schedule(running, [w], pbudget(pages=4)).admitted == ((9, 8),)
    # nothing running: a request may take every page (it must be able to run alone)
    assert build_schedule([], [w], pbudget(pages=2)).admitted == ((9, 8),)
    # 2 cached pages (1 to pin) + 3 tokens: 3 pages in all, 1 new
    w = wait(9, pending=3, cached=2, pinned=1)
    assert build_schedule([], [w], pbudget(pages=1)).admitted == ()
    assert build_schedule([], [w], pbudget(pages=2)).admitted == ((9, 3),)
