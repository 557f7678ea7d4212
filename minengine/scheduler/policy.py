"""The batch-building policy (vLLM V1 style): a pure function over plain data.

Each step has a token budget (``chunked_prefill_size``). Running requests go first, in order:
a decode takes 1 token, an unfinished prefill its next chunk. Then waiting requests are admitted
in arrival order while the budget, ``max_running_requests`` and KV capacity allow, each taking
``min(remaining prompt, budget left, long_prefill_token_threshold)``. Admission stops at the
first waiting request that does not fit (first come, first served); one with nothing it may
compute yet (its last prompt token waits for its grammar) is passed over, as vLLM does. Pages held only by the
prefix cache count as available: they are evicted on demand.

KV capacity, two modes (``Budget.preempt``):

- reserve: vLLM's full-sequence check. A request is admitted only if the pages it may still
  need until ``max_tokens`` fit beside what every running request may still need, so a running
  request never runs out of KV and nothing is ever preempted.
- preempt (vLLM V1's default behaviour): each step takes only the pages its tokens need now.
  When a running request's next tokens do not fit, the newest running requests not scheduled
  yet (the request itself last) are preempted until they do: their KV is dropped (to the prefix
  cache where there is one), they go back to the front of the queue and resume by recomputing
  their tokens. A step that preempts admits nothing, and admission keeps a page per running
  request for the decode growth of the next steps, so a request just admitted is less likely to
  be preempted at once. ``freed_pages`` is a lower bound (cached pages only the victims lock
  become evictable too): the scheduler applies the first victim, which the exact budget makes
  necessary, and plans again, so no request is preempted that the step did not need and the
  oldest request is never preempted for a newer one: it always makes progress.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

# NOTE: the per-request records are NamedTuples (immutable, and about 2x cheaper to build than
# frozen dataclasses: the scheduler builds one per running request every step). Calling the class
# runs type.__call__ and a generated Python __new__; ``new_record(RunningInfo, fields)`` (every field
# given) makes the same record about 3x faster still.
new_record = tuple.__new__


class RunningInfo(NamedTuple):
    rid: int
    num_pending: int  # tokens known but not yet in the KV cache
    prefilling: bool
    held_pages: int
    final_pages: int  # pages it needs at its longest (prompt + max_tokens)
    num_computed: int = 0  # tokens with KV (preempt mode: its next tokens' pages count from here)
    freed_pages: int = 0  # pages preempting it makes available, at least (freed, or evictable)
    preemptible: bool = False


# NOTE: two waiting requests sharing an unlocked cached prefix each count its pages in
# ``pinned_pages``; admitting both pins them once. The check is conservative, never optimistic.
class WaitingInfo(NamedTuple):
    rid: int
    num_pending: int  # prompt tokens not covered by the cached prefix
    cached_pages: int  # pages the prefix cache already holds for it
    pinned_pages: int  # of those, pages that admission locks and so makes unevictable
    final_pages: int


@dataclass(frozen=True)
class Budget:
    tokens: int  # chunked_prefill_size
    max_running: int
    available_pages: int  # free + evictable from the prefix cache
    long_prefill_threshold: int | None = None
    preempt: bool = False  # False: reserve each request's full sequence; True: preempt (see above)
    page_size: int = 1  # preempt mode: to count the pages of a step's tokens


@dataclass(frozen=True)
class Schedule:
    running: tuple[tuple[int, int], ...]  # (rid, new tokens), in running order
    admitted: tuple[tuple[int, int], ...]  # (rid, new tokens), in arrival order
    preempted: tuple[int, ...] = ()  # rids, newest first (preempt mode)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.running) + sum(n for _, n in self.admitted)


def _chunk(pending: int, tokens_left: int, threshold: int | None) -> int:
    n = min(pending, tokens_left)
    return min(n, threshold) if threshold is not None else n


def _newest_preemptible(queue: list[RunningInfo], first: int) -> int | None:
    """Index of the newest preemptible request in ``queue[first:]`` (those not scheduled yet)."""
    return next((j for j in range(len(queue) - 1, first - 1, -1) if queue[j].preemptible), None)


def build_schedule(running: list[RunningInfo], waiting: list[WaitingInfo], budget: Budget) -> Schedule:
    tokens_left = budget.tokens
    available = budget.available_pages
    if not budget.preempt:
        available -= sum(r.final_pages - r.held_pages for r in running)
    ps = budget.page_size
    queue = list(running)  # preemption takes from its end
    scheduled, preempted = [], []
    i = 0
    threshold = budget.long_prefill_threshold
    while i < len(queue):
        r = queue[i]
        n = r.num_pending if r.num_pending < tokens_left else tokens_left  # _chunk, inline: once per request a step
        if r.prefilling and threshold is not None and threshold < n:
            n = threshold
        if n > 0 and budget.preempt:
            need = max(0, -(-(r.num_computed + n) // ps) - r.held_pages)
            while need > available and (victim := _newest_preemptible(queue, i)) is not None:
                preempted.append(queue[victim].rid)
                available += queue.pop(victim).freed_pages
                if victim == i:
                    break
            if i == len(queue) or queue[i] is not r:
                continue  # ``r`` itself was preempted: queue[i] is the next request now
            if need > available:
                n = 0  # nothing left to take from: ``r`` waits (only a reservation is not preemptible)
            else:
                available -= need
        if n > 0:
            scheduled.append((r.rid, n))
            tokens_left -= n
        i += 1
    admitted = []
    num_running = len(queue)
    for w in waiting:
        if tokens_left == 0 or num_running >= budget.max_running or preempted:
            break
        if w.num_pending == 0:  # nothing it may compute yet (its grammar compiles): the next ones pass it
            continue
        n = _chunk(w.num_pending, tokens_left, budget.long_prefill_threshold)
        if budget.preempt:
            cached_tokens = w.cached_pages * ps
            cost = -(-(cached_tokens + n) // ps) - w.cached_pages + w.pinned_pages
            headroom = num_running  # a page of decode growth for each request already running
        else:
            cost, headroom = w.final_pages - w.cached_pages + w.pinned_pages, 0
        if cost + headroom > available:
            break
        admitted.append((w.rid, n))
        available -= cost
        tokens_left -= n
        num_running += 1
    return Schedule(tuple(scheduled), tuple(admitted), tuple(preempted))
