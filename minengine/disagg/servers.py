"""The scheduler loop's side of prefill/decode disaggregation.

``PrefillDriver`` (``--disaggregation-mode prefill``) moves each request through three queues:

1. bootstrap: a ``KVSender`` waits for the decode server's metadata (its page ids, and how
   many prompt tokens it already holds);
2. waiting: the normal scheduler (chunked prefill, radix cache) with ``max_tokens`` forced to 1;
   after each step the prompt pages whose KV is complete are sent, page-aligned (a partial last
   page goes with the last chunk);
3. inflight: the finished request keeps its KV until every write has landed, then releases it
   (into the prefill radix cache) and hands the first token to the decode side.

``DecodeDriver`` (``--disaggregation-mode decode``) has two:

1. prealloc: match the prompt in the decode radix cache (when enabled), lock it, allocate pages
   for the rest of the prompt and ``--num-reserved-decode-tokens`` once the scheduler admits it
   (``Scheduler.preallocate``: ``--kv-admission``'s check; requests it preempted go first), and
   send that metadata;
2. transfer: when the KV and the first token have arrived the request joins the decode batch.
   On finish the scheduler caches the whole sequence, so the next turn asks only for new pages.
"""

from __future__ import annotations

import logging
from collections import deque

from minengine.disagg.transfer import DecodeTransfer, KVPoll, KVReceiver, KVSender, PrefillTransfer, grammar_start
from minengine.engine import Engine
from minengine.request import Request
from minengine.server.protocol import AddRequest, FailRoom, TokenUpdate
from minengine.server.scheduler_process import engine_updates

logger = logging.getLogger(__name__)


def _failed(rid: str, why: str) -> TokenUpdate:
    return TokenUpdate(rid, [], "abort", error=why)


class PrefillDriver:
    def __init__(self, engine: Engine):
        cfg = engine.config
        self.engine = engine
        self.xfer = PrefillTransfer(
            engine.runner.pool.kv,
            cfg.disaggregation_transfer_backend,
            cfg.disaggregation_bootstrap_port,
            cfg.disaggregation_bootstrap_timeout,
        )
        self.bootstrap: dict[str, tuple[KVSender, AddRequest]] = {}
        self.live: dict[str, tuple[Request, KVSender]] = {}  # waiting, running or inflight
        # aborted here: the request is dropped and the decode side told once no write reads its KV
        self.closing: list[tuple[Request | None, KVSender]] = []
        self.pages_sent = 0

    def add(self, msg: AddRequest) -> list[TokenUpdate]:
        room = msg.bootstrap.room
        try:
            sender = self.xfer.sender(room, msg.prompt_ids, grammar_start(msg.params))
        except ValueError as exc:
            return [_failed(msg.rid, str(exc))]
        try:
            self.engine.check_request(msg.prompt_ids, msg.params.first_token_only())
        except ValueError as exc:
            sender.fail(f"rejected by the prefill server: {exc}")
            self.closing.append((None, sender))
            return [_failed(msg.rid, str(exc))]
        self.bootstrap[msg.rid] = (sender, msg)
        return []

    def abort(self, rid: str) -> list[TokenUpdate]:
        if rid in self.bootstrap:
            (sender, _), req = self.bootstrap.pop(rid), None
        elif rid in self.live:
            req, sender = self.live.pop(rid)
        else:
            return []
        sender.abort()  # no more writes; the engine drops the request once the last one ended
        self.closing.append((req, sender))
        return [TokenUpdate(rid, [], "abort")]

    def abort_all(self) -> list[TokenUpdate]:
        """Shutdown: every request ends, and the decode servers waiting on them are told why (one
        whose KV is all on its way and lands meanwhile ends as it would have: sent)."""
        self.xfer.shut_down("the prefill server is shutting down")
        updates = []
        for rid, (req, sender) in list(self.live.items()):
            if sender.poll() is KVPoll.Success:
                del self.live[rid]
                updates.append(self._sent(rid, req, sender))
        return updates + [u for rid in [*self.bootstrap, *self.live] for u in self.abort(rid)]

    def fail_room(self, msg: FailRoom) -> None:
        self.xfer.reject(msg.bootstrap.room, f"rejected by the prefill server: {msg.reason}")

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def pending(self) -> bool:
        return bool(self.bootstrap or self.closing or self.engine.scheduler.held)

    def queued(self) -> int:
        """Requests waiting outside the engine (for their decode server's metadata)."""
        return len(self.bootstrap)

    def sockets(self) -> list:
        return [self.xfer.sock]

    def step(self) -> list[TokenUpdate]:
        updates: list[TokenUpdate] = []
        self.xfer.poll()
        for rid, (sender, msg) in list(self.bootstrap.items()):
            state = sender.poll()
            if state is KVPoll.WaitingForInput:  # the decode side is ready: compute
                params = msg.params.first_token_only()
                self.live[rid] = (self.engine.add_request(msg.prompt_ids, params), sender)
                del self.bootstrap[rid]
            elif state is KVPoll.Failed:
                del self.bootstrap[rid]
                self.xfer.forget(sender.room)
                updates.append(_failed(rid, sender.error))

        if self.engine.has_unfinished():
            self.engine.step()  # the first token is read from the request once its KV has landed
            self.xfer.poll()  # aborts that came in during the step stop its writes before they start
            senders = {id(req): sender for req, sender in self.live.values()}
            ps = self.engine.config.page_size
            for req, upto in self.engine.kv_ready:
                if (sender := senders.get(id(req))) is None or req.finish_reason == "abort":
                    continue
                prompt_len = len(req.prompt_ids)
                end = -(-prompt_len // ps) if upto >= prompt_len else upto // ps  # partial page: at the end
                first = sender.start_page + sender.sent
                if end > first:
                    sender.send(req.pages[first:end])
                if upto >= prompt_len and req.finished:
                    sender.finish(req.token_ids[-1])
            self.xfer.poll()

        for rid, (req, sender) in list(self.live.items()):
            state = sender.poll()
            if state is KVPoll.Success:
                del self.live[rid]
                updates.append(self._sent(rid, req, sender))
            elif state is KVPoll.Failed:
                del self.live[rid]
                self.engine.abort(req)
                self.xfer.forget(sender.room)
                updates.append(_failed(rid, sender.error))
            elif sender.error is not None:  # failed, with writes still running: its client hears now
                del self.live[rid]
                self.closing.append((req, sender))  # its pages stay held until the writes end
                updates.append(_failed(rid, sender.error))
        for req, sender in list(self.closing):
            if sender.poll() is KVPoll.Failed:
                self.closing.remove((req, sender))
                self.xfer.forget(sender.room)
                if req is not None:
                    self.engine.abort(req)
        return updates

    def _sent(self, rid: str, req, sender) -> TokenUpdate:
        """A request whose KV has all landed on its decode server: release it, report its token."""
        self.engine.scheduler.release_held(req)
        self.xfer.forget(sender.room)
        self.pages_sent += sender.sent
        return TokenUpdate(rid, [req.token_ids[-1]], "length", req.cached_tokens)

    def drain_transfer_stats(self) -> tuple[list, int]:
        sent, self.pages_sent = self.pages_sent, 0
        return [], sent

    def close(self) -> None:
        self.xfer.close()


class DecodeDriver:
    def __init__(self, engine: Engine):
        cfg = engine.config
        self.engine = engine
        self.reserved = cfg.num_reserved_decode_tokens
        self.xfer = DecodeTransfer(
            engine.runner.pool.kv,
            cfg.disaggregation_transfer_backend,
            cfg.disaggregation_bootstrap_timeout,
            engine.model_config.vocab_size,
        )
        self.prealloc: deque[tuple[str, Request, KVReceiver]] = deque()
        # KV allocated, metadata held back until the step in flight at allocation is done: that step
        # may still write KV of a request that finished meanwhile into pages now ours
        self.allocated: list[tuple[str, Request, KVReceiver, object]] = []
        self.transfer: dict[str, tuple[Request, KVReceiver]] = {}
        self.live: dict[str, Request] = {}  # decoding
        self.closing: list[tuple[Request, KVReceiver]] = []  # aborted mid-transfer: pages wait for the peer
        self.received: list[tuple[int, int, float]] = []

    def add(self, msg: AddRequest) -> list[TokenUpdate]:
        b = msg.bootstrap
        try:
            req = self.engine.new_request(msg.prompt_ids, msg.params)
        except ValueError as exc:
            self.fail_room(FailRoom(b, str(exc)))  # its prefill half must not wait for us
            return [_failed(msg.rid, str(exc))]
        try:
            receiver = self.xfer.receiver(b.host, b.port, b.room)
        except ValueError as exc:  # a room in use (by another live request) or an unusable address
            return [_failed(msg.rid, str(exc))]
        receiver.init()
        self.prealloc.append((msg.rid, req, receiver))
        return []

    def abort(self, rid: str) -> list[TokenUpdate]:
        for entry in self.prealloc:
            if entry[0] == rid:
                self.prealloc.remove(entry)
                entry[2].abort()
                self.xfer.forget(entry[2].room)
                return [TokenUpdate(rid, [], "abort")]
        allocated = next((e for e in self.allocated if e[0] == rid), None)
        if allocated is not None:  # no metadata sent: nothing can land, free now
            self.allocated.remove(allocated)
            allocated[2].abort()
            self.xfer.forget(allocated[2].room)
            self.engine.scheduler.drop_receiving(allocated[1])
        elif rid in self.transfer:
            req, receiver = self.transfer.pop(rid)
            receiver.abort()
            self.closing.append((req, receiver))
        elif rid in self.live:
            self.engine.abort(self.live.pop(rid))
        else:
            return []
        return [TokenUpdate(rid, [], "abort")]

    def abort_all(self) -> list[TokenUpdate]:
        rids = [e[0] for e in (*self.prealloc, *self.allocated)] + list(self.transfer) + list(self.live)
        return [u for rid in rids for u in self.abort(rid)]

    def fail_room(self, msg: FailRoom) -> None:
        """A request this server will not run: tell its prefill server to drop it."""
        self.xfer.abort_room(msg.bootstrap.host, msg.bootstrap.port, msg.bootstrap.room)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def pending(self) -> bool:
        return bool(self.prealloc or self.allocated or self.transfer or self.closing)

    def queued(self) -> int:
        """Requests waiting outside the engine: for KV space, or for their KV to arrive (vLLM
        counts its WAITING_FOR_REMOTE_KVS requests as waiting too)."""
        return len(self.prealloc) + len(self.allocated) + len(self.transfer)

    def sockets(self) -> list:
        return [conn.sock for conn in self.xfer.conns.values()]

    def step(self) -> list[TokenUpdate]:
        updates: list[TokenUpdate] = []
        sched, ps = self.engine.scheduler, self.engine.config.page_size
        self.xfer.poll()
        for entry in [e for e in self.prealloc if e[2].poll() is KVPoll.Failed]:  # e.g. rejected by prefill
            self.prealloc.remove(entry)
            self.xfer.forget(entry[2].room)
            updates.append(_failed(entry[0], entry[2].error))
        while self.prealloc:
            rid, req, receiver = self.prealloc[0]
            if not sched.preallocate(req, self.reserved):
                break  # first come, first served: wait for KV to free up
            self.prealloc.popleft()
            self.allocated.append((rid, req, receiver, self.engine.in_flight_event()))
        for entry in list(self.allocated):
            rid, req, receiver, event = entry
            if receiver.poll() is KVPoll.Failed:  # e.g. rejected by the prefill side meanwhile
                self.allocated.remove(entry)
                self.xfer.forget(receiver.room)
                sched.drop_receiving(req)
                updates.append(_failed(rid, receiver.error))
            elif event is None or event.query():
                self.allocated.remove(entry)
                prompt_pages = sched.pages_for(len(req.prompt_ids))
                receiver.send_metadata(
                    req.pages[req.cached_pages : prompt_pages],
                    req.cached_pages * ps,
                    req.prompt_ids,
                    grammar_start(req.params),
                )
                self.transfer[rid] = (req, receiver)

        for rid, (req, receiver) in list(self.transfer.items()):
            state = receiver.poll()
            if state is KVPoll.Success:
                del self.transfer[rid]
                self.xfer.forget(receiver.room)
                self.received.append((receiver.pages, receiver.bytes, receiver.seconds))
                sched.activate(req, receiver.first_token)
                self.engine.runner.token_buffer[req.slot] = receiver.first_token  # the next decode's input
                self.engine.sampler.skip(req, self.engine.model_config.vocab_size)  # the prefill side drew one
                reason = self.engine.stop_reason(req)
                if reason is not None:
                    sched.finish(req, reason)
                else:
                    self.live[rid] = req
                updates.append(TokenUpdate(rid, [receiver.first_token], reason, req.cached_tokens))
            elif state is KVPoll.Failed:
                del self.transfer[rid]
                self.xfer.forget(receiver.room)
                sched.drop_receiving(req)
                updates.append(_failed(rid, receiver.error))
            elif receiver.aborting:  # gave up (a silent peer): fail now, free once nothing can land
                del self.transfer[rid]
                self.closing.append((req, receiver))
                updates.append(_failed(rid, receiver.error))
        for req, receiver in list(self.closing):
            if receiver.poll() in (KVPoll.Failed, KVPoll.Success):  # nothing can land in its pages now
                self.closing.remove((req, receiver))
                self.xfer.forget(receiver.room)
                if req in sched.receiving:
                    sched.drop_receiving(req)

        if self.engine.has_unfinished():
            updates += engine_updates(self.engine, self.live)
        return updates

    def drain_transfer_stats(self) -> tuple[list, int]:
        received, self.received = self.received, []
        return received, 0

    def close(self) -> None:
        self.xfer.close()
