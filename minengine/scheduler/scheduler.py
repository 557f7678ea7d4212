"""Scheduler state: waiting and running requests, KV pages, the prefix cache.

``schedule()`` asks the pure policy (``policy.build_schedule``) for the next step, then applies
it: preempts requests (preempt mode; one at a time, planning again after each), admits requests
(locking their cached prefix), allocates the pages their new tokens need (evicting from the
prefix cache on demand) and returns the batch, prefill chunks first, then decodes. ``advance()``
(at launch) and ``commit()`` (when the sampled tokens arrive) move each request on, cache
completed chunks, and free or cache the pages of finished requests.

A request whose grammar is still compiling (structured outputs) offers the policy all its pending
tokens but the one that samples (``Request.num_schedulable``): it may be admitted and prefilled,
and its sampling token runs once the grammar is ready, so no step waits for a compilation. A
waiting one with nothing else to compute is passed over (later requests are admitted first).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Callable

from minengine.memory import PageAllocator, PageTable, RadixCache
from minengine.request import Request, Status, TokenLogprobs
from minengine.scheduler.policy import Budget, RunningInfo, Schedule, WaitingInfo, build_schedule, new_record
from minengine.scheduler.prefill_delayer import PrefillDelayer, WorkerInfo


class Scheduler:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        page_table: PageTable,
        max_running: int,
        chunked_prefill_size: int,
        long_prefill_threshold: int | None,
        enable_radix_cache: bool,
        delayer: PrefillDelayer | None = None,
        hold_kv_on_finish: bool = False,
        preempt: bool = False,
    ):
        """``hold_kv_on_finish`` (a disaggregated prefill server): a finished request keeps its KV
        pages in ``held`` until ``release_held``, while they are sent to the decode server.
        ``preempt``: the policy's preempt mode (admit on current need, preempt by recompute)
        instead of reserving each request's full sequence."""
        self.page_size = page_size
        self.page_table = page_table
        self.max_running = max_running
        self.chunked_prefill_size = chunked_prefill_size
        self.long_prefill_threshold = long_prefill_threshold
        self.allocator = PageAllocator(num_pages)
        self.cache = RadixCache(page_size, self.allocator.free) if enable_radix_cache else None
        self.delayer = delayer
        self.hold_kv_on_finish = hold_kv_on_finish
        self.preempt = preempt
        self.num_preemptions = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: list[Request] = []  # finished, KV kept until it has been sent (prefill server)
        self.receiving: list[Request] = []  # KV preallocated, arriving from a prefill server (decode server)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)  # held / receiving requests run no steps

    # --- one step --------------------------------------------------------------------------

    def schedule(self) -> list[tuple[Request, int]]:
        """The next batch as (request, new tokens), prefill chunks first, then decodes."""
        if self.cache is not None:
            self.cache.sweep()
        # the delayer also needs the prefill batch a drained decode batch would admit
        limit = self.max_running if self.delayer is not None else self.max_running - len(self.running)
        # a preempted request whose last token is still in flight resumes once it has arrived
        ready = itertools.takewhile(lambda r: r.num_inflight == 0, self.waiting)
        candidates = list(itertools.islice(ready, max(0, limit)))
        matches = {req.rid: self._match(req) for req in candidates}
        ps = self.page_size
        waiting = [
            WaitingInfo(
                w.rid,
                len(w.token_ids) - len(matches[w.rid][0]) * self.page_size - w.grammar_hold,
                len(matches[w.rid][0]),
                self._pages_to_pin(matches[w.rid][1]),
                self.pages_for(w.max_len),
            )
            for w in candidates
        ]
        by_rid = {r.rid: r for r in self.running}
        preempted = False
        while True:
            running = [
                new_record(
                    RunningInfo,
                    (
                        r.rid,
                        r.num_pending if r.matcher is None else r.num_schedulable,  # (the common case: 1 call)
                        r.prefilling,
                        len(r.pages),
                        -(-r.max_len // ps),
                        r.num_computed,
                        len(r.pages) - r.cached_pages,
                        True,
                    ),
                )
                for r in self.running
            ]
            running += self._reservations(self.receiving)
            evictable = self.cache.evictable_pages if self.cache else 0
            budget = Budget(
                self.chunked_prefill_size,
                self.max_running,
                self.allocator.num_free + evictable,
                self.long_prefill_threshold,
                self.preempt,
                ps,
            )
            plan = build_schedule(running, [] if preempted else waiting, budget)
            if not plan.preempted:
                break
            # The budget is exact, so the first victim is needed; what the next ones free is a lower
            # bound (cached pages only they lock become evictable too). Preempt one and plan again
            # on exact counts, as vLLM does: no request is preempted that the step did not need.
            self._preempt(by_rid[plan.preempted[0]])
            preempted = True
        plan = self._defer_shared_prefixes(plan, by_rid, candidates, matches)
        if self.delayer is not None:
            plan = self._negotiate_prefill(plan, running, waiting, budget)

        admitted, passed = {rid for rid, _ in plan.admitted}, []
        while admitted:  # in arrival order, among the first waiting requests (the candidates)
            req = self.waiting.popleft()
            if req.rid in admitted:
                admitted.remove(req.rid)
                self._admit(req, *matches[req.rid])
                by_rid[req.rid] = req
            else:
                passed.append(req)  # passed over: it stays in its place
        self.waiting.extendleft(reversed(passed))
        prefills, decodes = [], []
        for rid, n in (*plan.running, *plan.admitted):
            if n > 0:
                req = by_rid[rid]
                if -(-(req.num_computed + n) // ps) > len(req.pages):  # (most decodes have their page)
                    self._grow(req, req.num_computed + n)
                # a decode is one token, the last sampled: ModelRunner.prepare relies on it (the tests
                # check it on every batch, tests/conftest.py)
                (prefills if req.prefilling else decodes).append((req, n))
        return prefills + decodes

    def advance(self, batch: list[tuple[Request, int]]) -> None:
        """At launch: the batch's KV is being written, its sampling requests have a token coming.
        Completed prompt chunks go to the prefix cache now (later readers run after this step)."""
        for req, n in batch:
            prefilling = req.prefilling
            req.num_computed += n
            if self.cache is not None and prefilling:  # a chunk of the prompt (the last one too)
                self._cache_prefix(req)
            if req.num_computed == req.num_tokens:
                req.num_inflight += 1

    def commit(
        self,
        samplers: list[Request],
        tokens: list[int],
        stop: Callable[[Request], str | None],
        logprobs: list[TokenLogprobs | None] | None = None,
    ) -> list[Request]:
        """When a step's tokens reach the host: append them (and their ``logprobs``, one per
        sampler, for the requests that asked) and finish what is done. Requests finished or
        aborted since the launch are skipped (their tokens are dropped). Returns the requests that
        got a token."""
        got = []
        for i, (req, token) in enumerate(zip(samplers, tokens, strict=True)):
            if req.finished:
                continue
            req.num_inflight -= 1
            req.token_ids.append(token)
            if req.output_logprobs is not None:
                req.output_logprobs.append(logprobs[i])
            got.append(req)
            if (reason := stop(req)) is not None:
                self.finish(req, reason)
        return got

    # --- helpers -----------------------------------------------------------------------------

    def _negotiate_prefill(
        self, plan: Schedule, running: list[RunningInfo], waiting: list[WaitingInfo], budget: Budget
    ) -> Schedule:
        """One delayer negotiation for this pass (every pass negotiates, prefill or not)."""
        one_pass = self.delayer.begin_pass()
        if plan.admitted:
            # the prefill batch it could admit if the decode batch had drained
            no_cap = len(running) + len(waiting)
            unbounded = build_schedule(running, waiting, dataclasses.replace(budget, max_running=no_cap))
            max_prefill_bs = min(len(unbounded.admitted), self.max_running)
            watermark = self.delayer.cfg.token_usage_low_watermark
            acc = self.accounting()
            low = watermark is not None and acc["held_by_requests"] / acc["total"] < watermark
            if not one_pass.negotiate(WorkerInfo(True, low, len(self.running), max_prefill_bs)):
                plan = dataclasses.replace(plan, admitted=())
        one_pass.finalize(actual_prefill=bool(plan.admitted))
        return plan

    def _defer_shared_prefixes(
        self, plan: Schedule, by_rid: dict, candidates: list[Request], matches: dict
    ) -> Schedule:
        """Hold back a request whose next uncached page another request of this step computes
        (with those after it: first come, first served). ``advance`` caches that page when the
        step launches, so next pass it is a prefix-cache hit instead of a second computation: the
        n sequences of one prompt, or requests sharing a system prompt that arrive together,
        compute the shared pages once. (vLLM shares them within the step; SGLang runs an n > 1
        prompt once first.) Each deferral lengthens the held request's cached prefix by a page or
        more, so it waits at most until the shared part is computed."""
        if self.cache is None or not plan.admitted:
            return plan
        ps = self.page_size
        # (cache salt, token ids, tokens with KV after this step) of each request computing prompt pages
        computing = []
        for rid, n in plan.running:
            if (r := by_rid[rid]).prefilling:
                computing.append((r.params.cache_salt, r.token_ids, r.num_computed + n))
        # {start: {(salt, the page at start): the token lists computing it}}, built per start the
        # admitted requests ask about (most share one), so the pass is linear in the batch, not quadratic
        pages_at: dict[int, dict[tuple, list]] = {}

        def add(index: dict, start: int, salt: str | None, tokens: list[int], upto: int) -> None:
            if upto >= start + ps:
                index.setdefault((salt, tuple(tokens[start : start + ps])), []).append(tokens)

        waiting = {r.rid: r for r in candidates}
        for i, (rid, n) in enumerate(plan.admitted):
            req = waiting[rid]
            start = len(matches[rid][0]) * ps
            end = start + ps  # its next page, if full before its last token (always computed)
            tokens = req.token_ids
            if end < len(tokens) and not req.scores_prompt:  # (one that reads no cache gains nothing)
                if (index := pages_at.get(start)) is None:
                    index = pages_at[start] = {}
                    for salt, other, upto in computing:
                        add(index, start, salt, other, upto)
                sharing = index.get((req.params.cache_salt, tuple(tokens[start:end])), ())
                if any(other[:start] == tokens[:start] for other in sharing):
                    return dataclasses.replace(plan, admitted=plan.admitted[:i])
            computing.append((req.params.cache_salt, tokens, start + n))
            for at, index in pages_at.items():
                add(index, at, req.params.cache_salt, tokens, start + n)
        return plan

    def _match(self, req: Request):
        if self.cache is None:
            return [], None
        if req.scores_prompt:  # it computes its whole prompt (vLLM's prompt logprobs skip the cache too)
            return [], self.cache.root_of(req.params.cache_salt)
        key = (self.cache.version, len(req.token_ids))
        if req.prefix_match is not None and req.prefix_match[0] == key:
            return req.prefix_match[1:]  # the tree gained or lost no page since: still the match
        # the last token is always recomputed: its logits give the next output token (a preempted
        # request resumes from all its tokens, prompt and output)
        pages, node = self.cache.match_prefix(req.token_ids[: len(req.token_ids) - 1], req.params.cache_salt)
        req.prefix_match = (key, pages, node)
        return pages, node

    @staticmethod
    def _pages_to_pin(node) -> int:
        pages = 0
        while node is not None and node.lock_ref == 0:
            pages += len(node.pages)
            node = node.parent
        return pages

    def _admit(self, req: Request, pages: list[int], node) -> None:
        if node is not None:
            node = self.cache.lock(node)  # (a new salt's root: the one kept)
        req.node, req.pages, req.cached_pages = node, list(pages), len(pages)
        req.num_computed = len(pages) * self.page_size
        req.prefill_len = len(req.token_ids)
        if req.num_preemptions == 0:  # the prompt tokens served by the prefix cache (usage)
            req.cached_tokens = req.num_computed
        req.slot = self.page_table.acquire()
        self.page_table.write(req.slot, 0, req.pages)
        req.status = Status.RUNNING
        self.running.append(req)

    def _grow(self, req: Request, num_tokens: int) -> None:
        need = self.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return
        if self.allocator.num_free < need and self.cache is not None:
            self.cache.evict(need - self.allocator.num_free)
        pages = self.allocator.alloc(need)
        if pages is None:  # the policy's KV check (and preemption) makes this unreachable
            raise RuntimeError(f"out of KV pages for request {req.rid}: {self.accounting()}")
        self.page_table.write(req.slot, len(req.pages), pages)
        req.pages += pages

    def _cache_prefix(self, req: Request) -> None:
        """Hand the request's full computed pages to the prefix cache and lock them for it."""
        full = req.num_computed // self.page_size
        if full <= req.cached_pages:
            return
        cached, ps = req.cached_pages, self.page_size
        # from the request's locked match on: the tokens before it are not compared again
        already, pages, node = self.cache.insert_below(req.node, cached * ps, req.token_ids, req.pages[:full])
        already //= ps
        self.allocator.free(req.pages[cached:already])  # duplicates of cached pages
        self.cache.lock(node)
        self.cache.unlock(req.node)
        req.pages[cached:full], req.cached_pages, req.node = pages, full, node
        if already > cached:  # only the duplicates' ids changed: the cache's pages replace them
            self.page_table.write(req.slot, cached, pages[: already - cached])

    def _preempt(self, req: Request) -> None:
        """Drop a running request's KV (its full pages go to the prefix cache) and queue it first;
        it resumes by recomputing its tokens. A token still in flight reaches it in ``commit``."""
        self.page_table.release(req.slot)
        req.slot = None
        self.running.remove(req)
        self._release_kv(req)
        req.status, req.num_computed, req.prefix_match = Status.WAITING, 0, None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Release a running request: its full pages go to the prefix cache (or are freed), or
        with ``hold_kv_on_finish`` stay held for a KV transfer (see ``release_held``). A preempted
        request that its in-flight token finishes just leaves the queue."""
        req.drop_sampler_state()  # no step samples it again
        if req.status is Status.WAITING:
            self.waiting.remove(req)
            req.status, req.finish_reason = Status.FINISHED, reason
            return
        self.page_table.release(req.slot)
        req.slot = None
        req.status, req.finish_reason = Status.FINISHED, reason
        self.running.remove(req)
        if self.hold_kv_on_finish and reason != "abort":
            self.held.append(req)
        else:
            self._release_kv(req)

    def release_held(self, req: Request) -> None:
        """A held request's KV has been sent (or will not be): cache or free its pages."""
        self.held.remove(req)
        self._release_kv(req)

    def _release_kv(self, req: Request) -> None:
        if self.cache is not None:
            # KV exists (or is being written by a launched step) for every token the host knows
            computed = min(req.num_computed, len(req.token_ids))
            full = computed // self.page_size
            tokens, pages = req.token_ids[:computed], req.pages[:full]
            already = self.cache.insert_below(req.node, req.cached_pages * self.page_size, tokens, pages)[0]
            already //= self.page_size
            self.allocator.free(req.pages[req.cached_pages : already] + req.pages[full:])
            self.cache.unlock(req.node)
        else:
            self.allocator.free(req.pages)
        req.pages, req.cached_pages, req.node = [], 0, None

    # --- decode server: KV that arrives from a prefill server ----------------------------------

    def preallocate(self, req: Request, reserved_tokens: int) -> bool:
        """Admit a request whose prompt KV will arrive from a prefill server: match its prompt in
        the prefix cache, lock the match, and allocate pages for the rest of the prompt plus
        ``reserved_tokens`` generated tokens. False (nothing taken) if it does not fit now.

        Admission is the policy's, asked after locking (a lock makes cached pages unevictable):
        ``max_running``, and in reserve mode the full-sequence KV check; in preempt mode the pages
        it takes now plus a page of headroom per request running or receiving, as for a waiting
        request. A preempted request resumes by recomputing its prompt and output on this server
        (from the decode radix cache where it has one), as vLLM's decode instances do. Such
        requests come first: none is admitted while one waits or is still recomputing (a new one
        would take the pages of its next chunk, and could not be preempted for them while its KV
        arrives). ``req.cached_pages * page_size`` tokens need no transfer.
        """
        # NOTE: on a decode server only a preempted request waits or prefills (the scan, about 30 us
        # at 256 running on the build machine, is skipped in reserve mode, which never preempts)
        if self.waiting or (self.preempt and any(r.prefilling for r in self.running)):
            return False
        salt = req.params.cache_salt
        pages, node = self.cache.match_prefix(req.prompt_ids, salt) if self.cache is not None else ([], None)
        if node is not None:
            node = self.cache.lock(node)  # (a new salt's root: the one kept)
        evictable = self.cache.evictable_pages if self.cache is not None else 0
        upto = min(req.max_len, len(req.prompt_ids) + reserved_tokens)  # what it takes now
        # at least 1: a prompt cached whole (page-aligned, no reserved tokens) still needs a seat, and
        # its first decode step a page (a policy candidate with nothing pending would be passed over)
        pending = max(1, upto - len(pages) * self.page_size)
        candidate = WaitingInfo(req.rid, pending, len(pages), 0, self.pages_for(req.max_len))  # its match is pinned
        free = self.allocator.num_free + evictable
        budget = Budget(pending, self.max_running, free, None, self.preempt, self.page_size)
        if not build_schedule(self._reservations((*self.running, *self.receiving)), [candidate], budget).admitted:
            if node is not None:
                self.cache.unlock(node)
            return False
        req.node, req.pages, req.cached_pages = node, list(pages), len(pages)
        req.cached_tokens = len(pages) * self.page_size
        req.slot = self.page_table.acquire()
        self.page_table.write(req.slot, 0, req.pages)
        req.status = Status.RUNNING
        self.receiving.append(req)
        self._grow(req, upto)
        return True

    def _reservations(self, reqs) -> list[RunningInfo]:
        """Requests as the policy's KV reservation sees them, with nothing to run (a request whose
        KV is arriving counts toward max_running and the reservation, and runs nothing)."""
        return [RunningInfo(r.rid, 0, False, len(r.pages), self.pages_for(r.max_len)) for r in reqs]

    def activate(self, req: Request, first_token: int) -> None:
        """The prompt's KV and the first token arrived: the request joins the decode batch."""
        self.receiving.remove(req)
        req.num_computed = len(req.prompt_ids)
        req.token_ids.append(first_token)
        self.running.append(req)

    def drop_receiving(self, req: Request, reason: str = "abort") -> None:
        """The transfer failed or was aborted and no write can still land: free the pages."""
        self.receiving.remove(req)
        self.page_table.release(req.slot)
        # its cached prefix stays the cache's; the rest never got (all of) its KV: free it
        self.allocator.free(req.pages[req.cached_pages :])
        if req.node is not None:
            self.cache.unlock(req.node)
        req.pages, req.cached_pages, req.node, req.slot = [], 0, None, None
        req.status, req.finish_reason = Status.FINISHED, reason

    def abort(self, req: Request) -> None:
        """Drop a request wherever it is; a running one releases its pages at once."""
        if req in self.receiving:
            self.drop_receiving(req)
        elif req.status is Status.RUNNING:
            self.finish(req, "abort")
        elif req in self.held:
            self.release_held(req)
        elif req.status is Status.WAITING:  # queued, or made but never added
            if req in self.waiting:
                self.waiting.remove(req)
            req.status, req.finish_reason = Status.FINISHED, "abort"
            req.drop_sampler_state()  # a preempted one's (``finish``: the rest)

    def accounting(self) -> dict[str, int]:
        """Where every KV page is: free, held by running requests, held only by the prefix cache."""
        owned = sum(len(r.pages) - r.cached_pages for r in (*self.running, *self.held, *self.receiving))
        cached = self.cache.total_pages if self.cache else 0
        # NOTE: a running request locks the radix path of its cached prefix, so the pages of locked
        # nodes are exactly the cached pages that running requests use (tests check this).
        shared = self.cache.protected_pages if self.cache else 0
        return {
            "total": self.allocator.num_pages,
            "free": self.allocator.num_free,
            "held_by_requests": owned + shared,
            "held_only_by_cache": cached - shared,
        }
