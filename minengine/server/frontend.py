"""The front end's side of the ZMQ link to the scheduler process, and one choice's token stream.

``SchedulerClient`` sends requests and aborts, and a dispatcher task routes each ``TokenUpdate``
to its request's queue. ``generate`` turns one request's updates into text pieces: incremental
detokenization and stop strings happen here, in the front end, never in the scheduler loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import zmq
import zmq.asyncio

from minengine.detokenizer import IncrementalDetokenizer, stop_reason
from minengine.sampling_params import SamplingParams
from minengine.server.metrics import Metrics
from minengine.server.protocol import (
    AbortRequest,
    AddRequest,
    Bootstrap,
    FailRoom,
    Fatal,
    ProfileReply,
    Ready,
    Shutdown,
    StartProfile,
    StepOutput,
    StopProfile,
    TokenUpdate,
)
from minengine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
# the longest wait for the ZMQ context to end (its sockets closed, their linger over: 0.5 s)
TERM_SECONDS = 5.0
# the longest wait for the workers' answers to a profile's start or stop (a long profile's trace
# takes a while to write)
PROFILE_REPLY_SECONDS = 600.0


class SchedulerDied(RuntimeError):
    pass


class ProfileFailed(RuntimeError):
    """A profile's start or stop that a worker refused (``user_error``: what was asked cannot be
    done) or failed at; the message is that worker's."""

    def __init__(self, message: str, user_error: bool):
        super().__init__(message)
        self.user_error = user_error


class RequestFailed(RuntimeError):
    """The scheduler dropped one request with a reason (a failed KV transfer, a peer's rejection)."""


class SchedulerClient:
    """Talks to the data-parallel scheduler workers: one PUSH socket each, one shared PULL.

    Requests go to a worker round-robin or to the least-loaded one (fewest live requests sent
    from here); aborts go to the worker that owns the request; gauges are summed over workers."""

    def __init__(self, requests_addrs: list[str], outputs_addr: str, metrics: Metrics, method: str = "round_robin"):
        self.ctx = zmq.asyncio.Context()
        try:
            self.outboxes = []
            for addr in requests_addrs:
                self.outboxes.append(self.ctx.socket(zmq.PUSH))
                self.outboxes[-1].bind(addr)
            self.inbox = self.ctx.socket(zmq.PULL)
            self.inbox.bind(outputs_addr)
        except BaseException:  # (a path too long, a folder gone): no socket or context left open
            self.ctx.destroy(linger=0)
            raise
        self.metrics = metrics
        self.method = method
        self.queues: dict[str, asyncio.Queue] = {}
        self.owner: dict[str, int] = {}  # rid -> worker
        self.load = [0] * len(requests_addrs)  # live requests per worker
        self.stats: list[dict[str, int]] = [{} for _ in requests_addrs]
        self.ready: Ready | None = None
        self.dead: str | None = None  # why the scheduler is gone
        self._next = 0
        self._dispatcher: asyncio.Task | None = None
        self._shutdown_sent = False
        self._profile_lock = asyncio.Lock()  # one profile call at a time
        self._profile_calls = itertools.count(1)
        self._profile_replies: asyncio.Queue | None = None  # the call's: ProfileReply, or a Fatal

    async def start(self, is_alive, timeout: float = 600.0) -> Ready:
        """Wait for every worker's Ready (models loaded), then start routing updates."""
        deadline = time.monotonic() + timeout
        ready: dict[int, Ready] = {}
        while len(ready) < len(self.outboxes):
            if await self.inbox.poll(200):
                msg = pickle.loads(await self.inbox.recv())
                if isinstance(msg, Fatal):
                    raise SchedulerDied(f"scheduler {msg.rank} failed to start:\n{msg.message}")
                if isinstance(msg, Ready):
                    ready[msg.rank] = msg
                elif isinstance(msg, StepOutput):  # a worker ready before the others: its first gauges
                    self._take(msg)
            elif not is_alive():
                raise SchedulerDied("a scheduler process exited during start-up")
            elif time.monotonic() > deadline:
                raise SchedulerDied(f"the schedulers were not ready after {timeout:.0f} s")
        # requests are checked against the smallest KV pool: any worker may be given one (on GPUs
        # each sizes its pool from its own free memory)
        self.ready = replace(ready[0], kv_capacity_tokens=min(r.kv_capacity_tokens for r in ready.values()))
        self._dispatcher = asyncio.create_task(self._dispatch(is_alive))
        return self.ready

    def submit(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, bootstrap: Bootstrap | None = None
    ) -> asyncio.Queue:
        if self.dead:
            raise SchedulerDied(self.dead)
        if self.method == "least_loaded":
            worker = min(range(len(self.load)), key=self.load.__getitem__)
        else:
            worker, self._next = self._next, (self._next + 1) % len(self.outboxes)
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[rid], self.owner[rid] = queue, worker
        self.load[worker] += 1
        if self._shutdown_sent:  # (a request that got past the 503 check before shutdown began)
            # the workers abort what they hold and exit, reading nothing more: end it as they would
            queue.put_nowait(TokenUpdate(rid, [], "abort"))
            return queue
        self.outboxes[worker].send(pickle.dumps(AddRequest(rid, prompt_ids, params, bootstrap)))
        return queue

    def fail_room(self, bootstrap: Bootstrap, reason: str) -> None:
        """A disaggregated request rejected here: the scheduler tells the other server."""
        if not self.dead:
            self.outboxes[0].send(pickle.dumps(FailRoom(bootstrap, reason)))

    def abort(self, rid: str) -> None:
        if self.queues.pop(rid, None) is not None:
            worker = self._forget(rid)
            if not self.dead:
                self.outboxes[worker].send(pickle.dumps(AbortRequest(rid)))

    def release(self, rid: str) -> None:
        if self.queues.pop(rid, None) is not None:
            self._forget(rid)

    def _forget(self, rid: str) -> int:
        worker = self.owner.pop(rid)
        self.load[worker] -= 1
        return worker

    async def profile(self, msg: StartProfile | StopProfile) -> list[ProfileReply]:
        """Send a profile's start or stop to every worker; their answers, by rank. A TimeoutError
        when one does not answer in time (a stop answers once its trace is written)."""
        async with self._profile_lock:
            if self.dead or self._shutdown_sent:
                raise SchedulerDied(self.dead or "the server is shutting down")
            msg = replace(msg, call=next(self._profile_calls))
            self._profile_replies = replies = asyncio.Queue()
            try:
                for sock in self.outboxes:
                    sock.send(pickle.dumps(msg))
                got: dict[int, ProfileReply] = {}
                deadline = time.monotonic() + PROFILE_REPLY_SECONDS
                while len(got) < len(self.outboxes):
                    try:
                        item = await asyncio.wait_for(replies.get(), max(0.0, deadline - time.monotonic()))
                    except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
                        raise TimeoutError(
                            f"{len(self.outboxes) - len(got)} scheduler(s) did not answer {type(msg).__name__} "
                            f"within {PROFILE_REPLY_SECONDS:g} s"
                        ) from None
                    if isinstance(item, Fatal):
                        raise SchedulerDied(item.message)
                    if item.call == msg.call:  # (a late answer to a call that timed out: dropped)
                        got[item.rank] = item
            finally:
                self._profile_replies = None
            return [got[rank] for rank in sorted(got)]

    async def profile_traces(self, msg: StartProfile | StopProfile) -> list[str]:
        """``profile``, then the traces' paths; a ProfileFailed with the worst answer's error (a
        failure before a refusal) when a worker did not do it. A start that failed on some workers
        is discarded on the others, so none is left running."""
        replies = await self.profile(msg)
        bad = [r for r in replies if r.error is not None]
        if not bad:
            return [r.path for r in replies if r.path]
        if isinstance(msg, StartProfile) and len(bad) < len(replies):
            await self.profile(StopProfile(discard=True))
        worst = next((r for r in bad if not r.user_error), bad[0])
        who = f"scheduler {worst.rank}: " if len(replies) > 1 else ""
        raise ProfileFailed(who + worst.error, worst.user_error)

    def shutdown(self) -> None:
        """Ask every worker to abort everything and exit; the aborts come back as updates."""
        if not self.dead and not self._shutdown_sent:
            self._shutdown_sent = True
            for sock in self.outboxes:
                sock.send(pickle.dumps(Shutdown()))
            if self._profile_replies is not None:  # (the workers write a running profile as they exit)
                self._profile_replies.put_nowait(Fatal("the server is shutting down"))

    async def _dispatch(self, is_alive) -> None:
        checked = time.monotonic()
        while True:
            if await self.inbox.poll(500):
                msg = pickle.loads(await self.inbox.recv())
                if isinstance(msg, StepOutput):
                    self._take(msg)
                elif isinstance(msg, ProfileReply):
                    if self._profile_replies is not None:
                        self._profile_replies.put_nowait(msg)
                elif isinstance(msg, Fatal):
                    self._fail(f"scheduler {msg.rank} failed:\n{msg.message}")
                    return
            # every 0.5 s, busy or not: a dead worker must not wait for the others to go quiet
            if time.monotonic() - checked >= 0.5:
                checked = time.monotonic()
                if not is_alive():
                    self._fail("a scheduler process exited")
                    return

    def _take(self, msg: StepOutput) -> None:
        """A worker's step: gauges (summed over workers; a worker sends them only when they
        change), counters, and each update to its request's queue."""
        self.stats[msg.rank] = msg.stats
        self.metrics.set_gauges({k: sum(s.get(k, 0) for s in self.stats) for k in msg.stats})
        self.metrics.record_delayer(msg.delayer)
        self.metrics.record_transfers(msg.kv_received, msg.kv_pages_sent)
        for update in msg.updates:
            if (queue := self.queues.get(update.rid)) is not None:
                queue.put_nowait(update)

    def _fail(self, why: str) -> None:
        if self._shutdown_sent:
            return  # workers leaving during shutdown is expected
        logger.error(why)
        self.dead = why
        for queue in self.queues.values():
            queue.put_nowait(Fatal(why))
        self.queues.clear()
        if self._profile_replies is not None:
            self._profile_replies.put_nowait(Fatal(why))

    def close(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        for sock in self.outboxes:
            sock.close(linger=500)  # let a last Shutdown reach the workers
        self.inbox.close(linger=0)
        # term waits for every socket of the context. Twice in CI (stops 46 and 49), after a worker
        # failed to start, it never returned (found by stack dumps; the cause is not known): it is
        # bounded, so the server still exits, and what is still open is logged
        ending = threading.Thread(target=self.ctx.term, name="zmq-term", daemon=True)
        ending.start()
        ending.join(TERM_SECONDS)
        if ending.is_alive():
            still = [s for s in getattr(self.ctx, "_sockets", None) or () if not s.closed]
            logger.warning("the ZMQ context did not end within %g s; sockets still open: %s", TERM_SECONDS, still)


def _waiting_updates(update: TokenUpdate, queue: asyncio.Queue) -> tuple[list[TokenUpdate], object | None]:
    """``update`` and the token updates already queued behind it, up to the one that ends the
    request, so a consumer that fell behind (a busy front end at high concurrency) handles them as
    one piece and one stream chunk; and the first queued item it did not take (an error, an abort,
    a Fatal: handled on their own, as before) or None. Never waits."""
    batch = [update]
    while batch[-1].finish_reason is None and not queue.empty():
        item = queue.get_nowait()
        if not isinstance(item, TokenUpdate) or item.error is not None or item.finish_reason == "abort":
            return batch, item
        batch.append(item)
    return batch, None


def _text_ids(ids: list[int], reason: str | None, include_stop: bool = False) -> list[int]:
    """The tokens of an update that make text: a scheduler's "stop" is an EOS or stop token id,
    which ends the output but is not part of its text unless ``include_stop_str_in_output`` (as in vLLM)."""
    return ids[:-1] if reason == "stop" and ids and not include_stop else ids


@dataclass
class Piece:
    text: str
    token_ids: list[int]  # new tokens in this piece
    finish_reason: str | None = None
    cached_tokens: int = 0
    # with finish_reason "stop", as vLLM reports it: the stop string or stop token id that ended
    # the output (None for an end-of-sequence token)
    stop_reason: str | int | None = None
    logprobs: list | None = None  # one ``TokenLogprobs`` per token of ``token_ids``, when asked for
    prompt_logprobs: list | None = None  # with the first piece: per prompt token from the second on

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


async def generate(
    client: SchedulerClient,
    tokenizer: Tokenizer,
    metrics: Metrics,
    rid: str,
    prompt_ids: list[int],
    params: SamplingParams,
    bootstrap: Bootstrap | None = None,
) -> AsyncIterator[Piece]:
    """One choice: submit, then yield text pieces until a piece carries a ``finish_reason``.

    Closing the generator early (the client went away) aborts the request in the scheduler.
    """
    arrival = time.perf_counter()
    detok = IncrementalDetokenizer.for_request(tokenizer, params, prompt_ids)
    queue = client.submit(rid, prompt_ids, replace(params, stop=None), bootstrap)
    metrics.prompt_tokens.inc(len(prompt_ids))
    finished, last, held, last_id = False, None, None, None
    try:
        while True:
            if held is not None:
                item, held = held, None
            else:
                item = await queue.get()
            if isinstance(item, Fatal):
                raise SchedulerDied(item.message)
            assert isinstance(item, TokenUpdate)
            if item.error is not None:
                finished = True  # the scheduler has dropped it already
                metrics.aborted.inc()
                raise RequestFailed(item.error)
            batch, held = _waiting_updates(item, queue)
            # the batch's updates in order, as if they came one by one; a stop string ends it at the
            # update that completes it (the scheduler went on: later tokens are not the output)
            now, ids, text, cached, reason, prompt_logprobs = time.perf_counter(), [], "", 0, None, None
            logprobs = [] if params.logprobs is not None else None
            for update in batch:
                if update.new_token_ids:
                    metrics.generation_tokens.inc(len(update.new_token_ids))
                    if last is None:
                        metrics.ttft.observe(now - arrival)
                        metrics.prefix_cache_hit_tokens.inc(update.cached_tokens)
                    else:
                        metrics.itl.observe(now - last)  # 0 for the updates that were already waiting
                    last = now
                ids += update.new_token_ids
                if logprobs is not None and update.logprobs is not None:
                    logprobs += update.logprobs
                cached += update.cached_tokens
                if update.prompt_logprobs is not None:
                    prompt_logprobs = update.prompt_logprobs
                reason = update.finish_reason
                if detok.stop:  # only stop strings need the text update by update
                    text += detok.add(_text_ids(update.new_token_ids, reason, detok.include_stop))
                    if detok.stopped:
                        break
            if not detok.stop:
                text = detok.add(_text_ids(ids, reason, detok.include_stop))
            if detok.stopped and reason != "abort":  # a stop string, before any end in its update
                if reason is None:  # we are done, the scheduler is not
                    client.abort(rid)
                reason = "stop"
            last_id = ids[-1] if ids else last_id
            if reason is None:
                if text or ids:
                    yield Piece(text, ids, cached_tokens=cached, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
                continue
            finished = True
            text += detok.finish()
            if detok.stopped and reason != "abort":  # a stop string that ended in an unfinished character
                reason = "stop"
            ends = client.ready.eos_token_ids if client.ready is not None else frozenset()
            why = stop_reason(reason, detok, last_id, params, tokenizer.eos_token_id, ends)
            if reason == "abort":
                metrics.aborted.inc()
            else:
                metrics.request_success.labels(finished_reason=reason).inc()
                metrics.e2e.observe(now - arrival)
            yield Piece(text, ids, reason, cached, why, logprobs, prompt_logprobs)
            return
    finally:
        if not finished:
            client.abort(rid)
            metrics.aborted.inc()
        client.release(rid)
