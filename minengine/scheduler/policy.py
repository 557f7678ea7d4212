"""The batch-building policy (vLLM V1 style): a pure function over plain data.

Each step has a token budget (``chunked_prefill_size``). Running requests go first, in order:
a decode takes 1 token, an unfinished prefill its next chunk. Then waiting requests are admitted
in arrival order while the budget, ``max_running_requests`` and KV capacity allow, each taking
``min(remaining prompt, budget left, long_prefill_token_threshold)``. Admission stops at the
first waiting request that does not fit (first come, first served).

KV capacity uses vLLM's full-sequence check: a request is admitted only if the pages it may
still need until ``max_tokens`` fit beside what every running request may still need, so a
running request never runs out of KV (no preemption, no deadlock). Pages held only by the
prefix cache count as available: they are evicted on demand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


# NOTE: the per-request records are NamedTuples (immutable, and about 2x cheaper to build than
# frozen dataclasses: the scheduler builds one per running request every step).
class RunningInfo(NamedTuple):
    rid: int
    num_pending: int  # tokens known but not yet in the KV cache
    prefilling: bool
    held_pages: int
    final_pages: int  # pages it needs at its longest (prompt + max_tokens)


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


@dataclass(frozen=True)
class Schedule:
    running: tuple[tuple[int, int], ...]  # (rid, new tokens), in running order
    admitted: tuple[tuple[int, int], ...]  # (rid, new tokens), in arrival order

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.running) + sum(n for _, n in self.admitted)


def _chunk(pending: int, tokens_left: int, threshold: int | None) -> int:
    n = min(pending, tokens_left)
    return min(n, threshold) if threshold is not None else n


def build_schedule(running: list[RunningInfo], waiting: list[WaitingInfo], budget: Budget) -> Schedule:
    tokens_left = budget.tokens
    scheduled = []
    for r in running:
        n = _chunk(r.num_pending, tokens_left, budget.long_prefill_threshold if r.prefilling else None)
        if n > 0:
            scheduled.append((r.rid, n))
            tokens_left -= n
    available = budget.available_pages - sum(r.final_pages - r.held_pages for r in running)
    admitted = []
    num_running = len(running)
    for w in waiting:
        if tokens_left == 0 or num_running >= budget.max_running:
            break
        cost = w.final_pages - w.cached_pages + w.pinned_pages
        if cost > available:
            break
        n = _chunk(w.num_pending, tokens_left, budget.long_prefill_threshold)
        admitted.append((w.rid, n))
        available -= cost
        tokens_left -= n
        num_running += 1
    return Schedule(tuple(scheduled), tuple(admitted))
