"""The front end's side of the ZMQ link to the scheduler process, and one choice's token stream.

``SchedulerClient`` sends requests and aborts, and a dispatcher task routes each ``TokenUpdate``
to its request's queue. ``generate`` turns one request's updates into text pieces: incremental
detokenization and stop strings happen here, in the front end, never in the scheduler loop.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import zmq
import zmq.asyncio

from minengine.detokenizer import IncrementalDetokenizer
from minengine.sampling_params import SamplingParams
from minengine.server.metrics import Metrics
from minengine.server.protocol import AbortRequest, AddRequest, Fatal, Ready, Shutdown, StepOutput, TokenUpdate
from minengine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class SchedulerDied(RuntimeError):
    pass


class SchedulerClient:
    def __init__(self, requests_addr: str, outputs_addr: str, metrics: Metrics):
        self.ctx = zmq.asyncio.Context()
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.bind(requests_addr)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(outputs_addr)
        self.metrics = metrics
        self.queues: dict[str, asyncio.Queue] = {}
        self.ready: Ready | None = None
        self.dead: str | None = None  # why the scheduler is gone
        self._dispatcher: asyncio.Task | None = None
        self._shutdown_sent = False

    async def start(self, is_alive, timeout: float = 600.0) -> Ready:
        """Wait for the scheduler's Ready (the model is loaded), then start routing updates."""
        deadline = time.monotonic() + timeout
        while self.ready is None:
            if await self.inbox.poll(200):
                msg = pickle.loads(await self.inbox.recv())
                if isinstance(msg, Fatal):
                    raise SchedulerDied(f"the scheduler failed to start:\n{msg.message}")
                if isinstance(msg, Ready):
                    self.ready = msg
            elif not is_alive():
                raise SchedulerDied("the scheduler process exited during start-up")
            elif time.monotonic() > deadline:
                raise SchedulerDied(f"the scheduler was not ready after {timeout:.0f} s")
        self._dispatcher = asyncio.create_task(self._dispatch(is_alive))
        return self.ready

    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        if self.dead:
            raise SchedulerDied(self.dead)
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = queue
        self.outbox.send(pickle.dumps(AddRequest(rid, prompt_ids, params)))
        return queue

    def abort(self, rid: str) -> None:
        if self.queues.pop(rid, None) is not None and not self.dead:
            self.outbox.send(pickle.dumps(AbortRequest(rid)))

    def release(self, rid: str) -> None:
        self.queues.pop(rid, None)

    def shutdown(self) -> None:
        """Ask the scheduler to abort everything and exit; the aborts come back as updates."""
        if not self.dead and not self._shutdown_sent:
            self._shutdown_sent = True
            self.outbox.send(pickle.dumps(Shutdown()))

    async def _dispatch(self, is_alive) -> None:
        while True:
            if await self.inbox.poll(500):
                msg = pickle.loads(await self.inbox.recv())
                if isinstance(msg, StepOutput):
                    self.metrics.set_gauges(msg.stats)
                    self.metrics.record_delayer(msg.delayer)
                    for update in msg.updates:
                        if (queue := self.queues.get(update.rid)) is not None:
                            queue.put_nowait(update)
                    continue
                if isinstance(msg, Fatal):
                    self._fail(f"the scheduler failed:\n{msg.message}")
                    return
            elif not is_alive():
                self._fail("the scheduler process exited")
                return

    def _fail(self, why: str) -> None:
        logger.error(why)
        self.dead = why
        for queue in self.queues.values():
            queue.put_nowait(Fatal(why))
        self.queues.clear()

    def close(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        self.outbox.close(linger=500)  # let a last Shutdown reach the scheduler
        self.inbox.close(linger=0)
        self.ctx.term()


@dataclass
class Piece:
    text: str
    num_tokens: int  # new tokens in this piece
    finish_reason: str | None = None
    cached_tokens: int = 0


async def generate(
    client: SchedulerClient,
    tokenizer: Tokenizer,
    metrics: Metrics,
    rid: str,
    prompt_ids: list[int],
    params: SamplingParams,
) -> AsyncIterator[Piece]:
    """One choice: submit, then yield text pieces until a piece carries a ``finish_reason``.

    Closing the generator early (the client went away) aborts the request in the scheduler.
    """
    arrival = time.perf_counter()
    detok = IncrementalDetokenizer(tokenizer, params.stop_strings)
    queue = client.submit(rid, prompt_ids, replace(params, stop=None))
    metrics.prompt_tokens.inc(len(prompt_ids))
    finished, last = False, None
    try:
        while True:
            update = await queue.get()
            if isinstance(update, Fatal):
                raise SchedulerDied(update.message)
            assert isinstance(update, TokenUpdate)
            now, n = time.perf_counter(), len(update.new_token_ids)
            if n:
                metrics.generation_tokens.inc(n)
                if last is None:
                    metrics.ttft.observe(now - arrival)
                    metrics.prefix_cache_hit_tokens.inc(update.cached_tokens)
                else:
                    metrics.itl.observe(now - last)
                last = now
            text = detok.add(update.new_token_ids)
            reason = update.finish_reason
            if reason is None and detok.stopped:  # a stop string: we are done, the scheduler may not be
                client.abort(rid)
                reason = "stop"
            if reason is None:
                if text or n:
                    yield Piece(text, n, cached_tokens=update.cached_tokens)
                continue
            finished = True
            text += detok.finish()
            if reason == "abort":
                metrics.aborted.inc()
            else:
                metrics.request_success.labels(finished_reason=reason).inc()
                metrics.e2e.observe(now - arrival)
            yield Piece(text, n, reason, update.cached_tokens)
            return
    finally:
        if not finished:
            client.abort(rid)
            metrics.aborted.inc()
        client.release(rid)
