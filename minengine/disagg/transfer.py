"""KV transfer between a prefill server and a decode server.

Interfaces as in SGLang: a ``KVSender`` per request on the prefill side (``init``, ``send``,
``poll``, ``abort``), a ``KVReceiver`` per request on the decode side (``init``,
``send_metadata``, ``poll``, ``abort``), both reporting ``KVPoll`` states. Requests are matched
by their ``bootstrap_room`` (a random id the router gives both sides).

Control plane (ZMQ): the prefill server binds a ROUTER on its bootstrap port; each decode server
connects one DEALER to it (identity: its agent name). Messages are JSON arrays, checked against
a schema on arrival (a malformed one is dropped, never executed or trusted):

    decode -> prefill   ("hello", agent, metadata, layout, backend)   on connecting, and on "who"
                        ("claim", room)   the decode half exists: wait for its metadata
                        ("meta", room, dst_pages, decode_prefix_len, prompt_digest, grammar_start)
                        ("abort", room), ("ping",)
                        ("status", room)  no word on an accepted room for a timeout: is it alive?
    prefill -> decode   ("accepted", room)  (also the answer to "status" while it runs)
                        ("done", room, first_token, pages, bytes, num_writes)
                        ("failed", room, reason), ("released", room, reason), ("pong",)
                        ("failing", room, reason)  failed, but a write to its pages has not ended:
                                          fail the request now, keep its pages until "released"
                        ("who", room)   metadata from a peer it does not know (it restarted)

A ROUTER drops what it sends to a peer that is reconnecting, so a final answer ("done",
"failed", "released") can be lost: the prefill side keeps it for a while and repeats it when the
decode side asks ("status"); a room it never heard of is "failed" (nothing of it can be writing).

Data plane: the prefill side WRITEs its pages straight into the decode pool with NIXL, one write
per sent run of pages, each carrying the notification ``room:i``. The decode side calls a
request's KV complete when the ``done`` message and every notification have arrived. The
``fake`` backend moves nothing (queue-logic tests, warm-up).

Safety rule: a side reports ``Failed`` (and so frees its pages) only once no write to or from
those pages can still be running: the prefill side waits for its writes to end, the decode side
for the prefill side's ``released`` / ``failed``. A decode side that gives up (a silent peer, a
room nobody takes) sends ``abort`` and still waits for that answer, at most one more timeout (a
dead peer writes nothing).
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch
import zmq

from minengine.server.protocol import DECODE_ABORTED

logger = logging.getLogger(__name__)
PING_SECONDS = 1.0
MAX_MESSAGE_BYTES = 64 << 20  # a control message (metadata of a huge prompt is ~ pages x 8 bytes)
MAX_PREFILL_PEERS = 256  # distinct bootstrap addresses one decode server talks to


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class TransferError(RuntimeError):
    pass


@dataclass(frozen=True)
class KVLayout:
    """Where a KV pool's pages are: one descriptor per (page, layer), K and V of a page contiguous."""

    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    base: int
    layer_stride: int  # bytes
    page_stride: int  # bytes
    page_bytes: int  # one layer's K and V of one page
    device_id: int
    mem_type: str  # "DRAM" | "VRAM"

    @classmethod
    def of(cls, kv: torch.Tensor) -> KVLayout:
        """The layout of a pool tensor ``[layers, pages, 2, page_size, kv_heads, head_dim]``."""
        if not kv.is_contiguous():
            raise ValueError("the KV pool must be contiguous to be registered for transfer")
        layers, pages, _, page_size, heads, dim = kv.shape
        item = kv.element_size()
        return cls(
            layers,
            pages,
            page_size,
            heads,
            dim,
            str(kv.dtype).removeprefix("torch."),
            kv.data_ptr(),
            kv.stride(0) * item,
            kv.stride(1) * item,
            kv.stride(1) * item,
            kv.device.index or 0,
            "VRAM" if kv.device.type == "cuda" else "DRAM",
        )

    @property
    def bytes_per_page(self) -> int:
        return self.page_bytes * self.num_layers

    def mismatch(self, other: KVLayout) -> str | None:
        """Why pages of ``other`` cannot be written into pages of this layout (None: they can)."""
        for name in ("num_layers", "page_size", "num_kv_heads", "head_dim", "dtype"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"the prefill and decode servers differ in {name} ({theirs} vs {mine})"
        return None

    def descs(self, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """One (address, bytes, device) row per run of consecutive pages and layer, run-major:
        a layer's pages are contiguous, so a run is one descriptor per layer."""
        p = np.asarray(starts, dtype=np.uint64)[:, None]
        layer = np.arange(self.num_layers, dtype=np.uint64)[None, :]
        out = np.empty((p.size * self.num_layers, 3), dtype=np.uint64)
        out[:, 0] = (self.base + layer * self.layer_stride + p * self.page_stride).reshape(-1)
        out[:, 1] = (
            (np.asarray(counts, dtype=np.uint64)[:, None] * np.uint64(self.page_bytes))
            .repeat(self.num_layers, axis=1)
            .reshape(-1)
        )
        out[:, 2] = self.device_id
        return out


def tcp_address(host: str, port: int) -> str:
    """A ZMQ TCP endpoint; an IPv6 literal (``::1``, as a URL's hostname gives it) in brackets."""
    return f"tcp://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{port}"


def page_runs(local: list[int], remote: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs over which both the local and the remote page ids go up by one:
    (local starts, remote starts, lengths). Fresh pools hand out consecutive pages, so a
    request's KV is usually a few runs, and a write a few descriptors per layer."""
    lo, re = np.asarray(local, dtype=np.int64), np.asarray(remote, dtype=np.int64)
    cut = np.flatnonzero((np.diff(lo) != 1) | (np.diff(re) != 1)) + 1
    starts, ends = np.concatenate(([0], cut)), np.concatenate((cut, [lo.size]))
    return lo[starts], re[starts], ends - starts


# --- control messages ----------------------------------------------------------------------------


def prompt_digest(prompt_ids: list[int]) -> str:
    """A prompt's 64-bit BLAKE2b digest: both halves of a request must compute the same prompt."""
    return hashlib.blake2b(np.asarray(prompt_ids, dtype=np.int64).tobytes(), digest_size=8).hexdigest()


def grammar_start(params) -> str:
    """Where a request's grammar starts (``SamplingParams.structured_outputs``), in words ("" for
    a request without one): the prefill server samples the first token under its grammar, so both
    servers must start it at the same place (a server's ``--reasoning-parser`` decides it)."""
    spec = params.structured_outputs
    if spec is None:
        return ""
    return {
        None: "at the first output token",
        "open": "after the reasoning",
        "may_open": "at the first output token, or after the reasoning if that is <think>",
    }[spec.reasoning]


_SCHEMA: dict[str, tuple] = {
    "hello": (str, bytes, KVLayout, str),  # agent name, NIXL agent metadata, pool layout, backend
    "claim": (int,),
    "meta": (int, list, int, str, str),  # room, decode page ids, decode_prefix_len, prompt_digest, grammar_start
    "abort": (int,),
    "ping": (),
    "status": (int,),
    "accepted": (int,),
    "done": (int, int, int, int, int),  # room, first token, pages, bytes, writes
    "failed": (int, str),
    "failing": (int, str),
    "released": (int, str),
    "pong": (),
    "who": (int,),
}


def encode(msg: tuple) -> bytes:
    def field(v):
        if isinstance(v, bytes):
            return {"bytes": base64.b64encode(v).decode()}
        if isinstance(v, KVLayout):
            return dataclasses.asdict(v)
        return v

    return json.dumps([msg[0], *(field(v) for v in msg[1:])]).encode()


def decode(raw: bytes) -> tuple | None:
    """The message, or None if it is not one of ours (wrong kind, arity or field types)."""
    try:
        data = json.loads(raw)
        kind, fields = data[0], data[1:]
        types = _SCHEMA[kind]
        if len(fields) != len(types):
            return None
        out = [kind]
        for value, typ in zip(fields, types, strict=True):
            if typ is bytes:
                value = base64.b64decode(value["bytes"], validate=True)
            elif typ is KVLayout:
                value = KVLayout(**value)
                for f in dataclasses.fields(value):
                    v = getattr(value, f.name)
                    ok = isinstance(v, str) if f.type == "str" else isinstance(v, int) and not isinstance(v, bool)
                    if not ok or (isinstance(v, int) and v < 0):
                        return None
            elif typ is list and not all(isinstance(p, int) and not isinstance(p, bool) for p in value):
                return None
            if not isinstance(value, typ) or isinstance(value, bool):
                return None
            out.append(value)
        return tuple(out)
    except Exception:  # anything unexpected (deep nesting, odd types) is just not our message
        return None


# --- data movers ---------------------------------------------------------------------------------


class FakeMover:
    """Moves no data: every write is done at once and no notification is expected."""

    name = "fake"
    notifies = False

    def __init__(self, kv: torch.Tensor, agent_name: str):
        self.agent_name = agent_name

    def metadata(self) -> bytes:
        return b""

    def add_peer(self, metadata: bytes) -> str:
        return ""

    def remove_peer(self, name: str) -> None:
        pass

    def write(self, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes):
        return None

    def state(self, handle) -> str:
        return "DONE"

    def release(self, handle) -> None:
        pass

    def notifs(self) -> list[bytes]:
        return []

    def close(self) -> None:
        pass


class NixlMover:
    """NIXL over UCX: registers the KV pool (host memory on CPU, device memory on GPU)."""

    name = "nixl"
    notifies = True

    def __init__(self, kv: torch.Tensor, agent_name: str):
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise TransferError(
                f"the nixl transfer backend needs the nixl package ({exc}); install it with "
                "`pip install nixl`, or use --disaggregation-transfer-backend fake"
            ) from None
        self.agent_name = agent_name
        # NOTE: no progress thread: NIXL's spins without pause (a core per agent, measured here);
        # the scheduler loop drives progress itself, every millisecond while a transfer is open
        self.agent = nixl_agent(agent_name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.mem_type = "VRAM" if kv.device.type == "cuda" else "DRAM"
        self._registered = self.agent.register_memory(kv)

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else name

    def remove_peer(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:  # (nothing of it is in use: a failure here only keeps its memory)
            logger.warning("could not drop the NIXL agent %s: %s", name, exc)

    def write(self, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes):
        src = self.agent.get_xfer_descs(local, self.mem_type)
        dst = self.agent.get_xfer_descs(remote, self.mem_type)
        handle = self.agent.initialize_xfer("WRITE", src, dst, peer, notif)
        if self.agent.transfer(handle) == "ERR":
            self.agent.release_xfer_handle(handle)
            raise TransferError(f"NIXL could not post a write to {peer}")
        return handle

    def state(self, handle) -> str:
        return self.agent.check_xfer_state(handle)

    def release(self, handle) -> None:
        self.agent.release_xfer_handle(handle)

    def notifs(self) -> list[bytes]:
        return [m for msgs in self.agent.get_new_notifs().values() for m in msgs]

    def close(self) -> None:
        self.agent.deregister_memory(self._registered)


def make_mover(backend: str, kv: torch.Tensor, role: str):
    name = f"minengine-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return (NixlMover if backend == "nixl" else FakeMover)(kv, name)


# --- prefill side --------------------------------------------------------------------------------


@dataclass
class _Peer:
    """A decode server connected to this prefill server."""

    agent: str
    layout: KVLayout
    error: str | None
    last_heard: float


class KVSender:
    """One request's KV on its way from this prefill server to a decode server."""

    def __init__(self, mgr: PrefillTransfer, room: int):
        self.mgr, self.room = mgr, room
        self.state = KVPoll.Bootstrapping
        self.created = time.monotonic()
        self.peer: bytes | None = None  # the decode server's identity once its metadata arrived
        self.dst_pages: list[int] = []
        self.decode_prefix_len = 0
        self.prompt_digest = ""  # the prompt's (``prompt_digest``): the decode side's must be the same
        self.grammar_start = ""  # where its grammar starts (``grammar_start``): the decode side's must be the same
        self.sent = 0  # pages sent so far (after the decode side's prefix)
        self.writes: list = []  # NIXL handles in flight, stuck ones too (held until they end)
        self.num_writes = 0
        self.bytes = 0
        self.first_token: int | None = None
        self.error: str | None = None
        self.reply = "failed"  # what the decode side hears when this fails ("released": it aborted)
        self.told_failing = False  # the decode side heard "failing" (failed, with writes still running)
        self.last_progress = self.created

    # SGLang's names: init, send, poll, abort
    def init(self, prompt_ids: list[int], grammar: str = "") -> None:
        self.num_prompt_pages = -(-len(prompt_ids) // self.mgr.layout.page_size)
        self.num_prompt_tokens, self.prompt_digest = len(prompt_ids), prompt_digest(prompt_ids)
        self.grammar_start = grammar

    @property
    def start_page(self) -> int:
        """The first prompt page the decode side lacks."""
        return self.decode_prefix_len // self.mgr.layout.page_size

    def send(self, pages: list[int]) -> None:
        """Write the next ``len(pages)`` prompt pages (local page ids) to the decode server."""
        if self.state not in (KVPoll.WaitingForInput, KVPoll.Transferring) or self.error is not None or not pages:
            return
        remote = self.dst_pages[self.sent : self.sent + len(pages)]
        if len(remote) != len(pages):
            self.fail(f"{self.sent + len(pages)} pages sent but the decode side allocated {len(self.dst_pages)}")
            return
        peer = self.mgr.peers[self.peer]
        if time.monotonic() - peer.last_heard > self.mgr.timeout:  # it may have given up and reused the pages
            self.fail(f"the decode server was silent for {self.mgr.timeout:g} s")
            return
        notif = f"{self.room}:{self.num_writes}".encode()
        mine, theirs, counts = page_runs(pages, remote)
        try:
            handle = self.mgr.mover.write(
                peer.agent, self.mgr.layout.descs(mine, counts), peer.layout.descs(theirs, counts), notif
            )
        except Exception as exc:  # NIXL raises its own errors: the request fails, the server goes on
            self.fail(f"a KV write could not be posted: {exc}")
            return
        self.writes.append(handle)
        self.num_writes += 1
        self.sent += len(pages)
        self.bytes += len(pages) * self.mgr.layout.bytes_per_page if self.mgr.mover.notifies else 0
        self.state = KVPoll.Transferring
        self.last_progress = time.monotonic()

    def finish(self, first_token: int) -> None:
        """Every prompt page has been sent: once the writes land, hand over the first token."""
        self.first_token = first_token

    def poll(self) -> KVPoll:
        return self.state

    def abort(self, why: str = "the request was aborted on the prefill server") -> None:
        self.fail(why)

    def fail(self, why: str) -> None:
        if self.state not in (KVPoll.Failed, KVPoll.Success) and self.error is None:
            self.error = why
            logger.info("room %d: %s", self.room, why)

    def _progress(self, now: float) -> None:
        mover = self.mgr.mover
        still = []
        for handle in self.writes:
            try:
                state = mover.state(handle)
            except Exception as exc:
                state = f"ERR: {exc}"
            if state == "PROC":
                still.append(handle)
                continue
            if not _release(mover, handle):
                still.append(handle)  # not released: keep polling it
                continue
            self.last_progress = now
            if state != "DONE":
                self.fail(f"a KV write to the decode server failed ({state})")
        self.writes = still
        if still and now - self.last_progress > self.mgr.timeout:
            self.fail(f"a KV write made no progress for {self.mgr.timeout:g} s")
            # no more writes, but the stuck ones are not released: NIXL's release of an active write
            # returns success without stopping it (UCX cannot cancel an RMA write), so only its
            # completion (DONE or an error) says that nothing can land any more. Until then this
            # room's pages stay held on both sides (the decode side hears "accepted" if it asks).
            self.last_progress = now
        if self.error is not None:
            if not self.writes and self.state is not KVPoll.Failed:  # nothing can land any more
                self.state = KVPoll.Failed
                if self.peer is not None:
                    self.mgr.send_final(self.peer, (self.reply, self.room, self.error))
            elif self.writes and self.peer is not None and self.reply == "failed" and not self.told_failing:
                # its client hears now, not when the write ends (a stuck one: maybe never); the
                # pages stay held on both sides until then
                self.told_failing = True
                self.mgr.send(self.peer, ("failing", self.room, self.error))
            return
        if self.first_token is not None and not self.writes and self.state is not KVPoll.Success:
            if self.sent != len(self.dst_pages):
                self.fail(f"sent {self.sent} pages but the decode side expects {len(self.dst_pages)}")
                return
            self.state = KVPoll.Success
            done = ("done", self.room, self.first_token, self.sent, self.bytes, self.num_writes)
            self.mgr.send_final(self.peer, done)
        elif self.state is KVPoll.Bootstrapping and now - self.created > self.mgr.timeout:
            claim = self.mgr.claims.get(self.room)  # a decode server holds it while it waits for KV space
            if claim is None or now - self.mgr.peers[claim[0]].last_heard > self.mgr.timeout:
                self.fail(f"no decode server asked for room {self.room} within {self.mgr.timeout:g} s")
        elif self.peer is not None and now - self.mgr.peers[self.peer].last_heard > self.mgr.timeout:
            self.fail(f"the decode server was silent for {self.mgr.timeout:g} s")


def _release(mover, handle) -> bool:
    """Release a write handle; False if NIXL refuses (the write may still be running)."""
    try:
        mover.release(handle)
        return True
    except Exception as exc:
        logger.warning("could not release a KV write: %s", exc)
        return False


class PrefillTransfer:
    """The prefill server's bootstrap endpoint and its senders."""

    def __init__(self, kv: torch.Tensor, backend: str, port: int, timeout: float):
        self.layout = KVLayout.of(kv)
        self.timeout = timeout
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # a decode server that closed an idle connection reconnects with the same identity, maybe
        # before we saw the old one go: without handover, the new connection's messages are dropped
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.sock.setsockopt(zmq.IPV6, 1)  # IPv4 peers too (dual stack, or IPv4 alone where there is no IPv6)
        try:
            self.sock.bind(f"tcp://*:{port}")
        except zmq.ZMQError as exc:
            self.sock.close()
            self.ctx.term()
            raise TransferError(
                f"cannot listen on bootstrap port {port} ({exc}); choose another with --disaggregation-bootstrap-port"
            ) from None
        self.mover = make_mover(backend, kv, "prefill")
        self.peers: dict[bytes, _Peer] = {}
        self.senders: dict[int, KVSender] = {}
        self.early: dict[int, tuple[bytes, list[int], int, str, str, float]] = {}  # metadata before the request
        # room -> (the decode server waiting to send its metadata, when it said so)
        self.claims: dict[int, tuple[bytes, float]] = {}
        self.dead_rooms: dict[int, tuple[str, float]] = {}  # failed or aborted before the metadata came
        self.answers: dict[int, tuple[bytes, tuple, float]] = {}  # room -> its final message, repeated on "status"

    def sender(self, room: int, prompt_ids: list[int], grammar: str = "") -> KVSender:
        """The sender of request ``room``; ``grammar``: where the grammar of its first token starts
        (``grammar_start``)."""
        if room in self.senders:
            raise ValueError(f"bootstrap_room {room} is already in use on this prefill server")
        s = self.senders[room] = KVSender(self, room)
        s.init(prompt_ids, grammar)
        if room in self.dead_rooms:
            s.fail(self.dead_rooms.pop(room)[0])
        elif room in self.early:
            self._attach(s, *self.early.pop(room)[:-1])
        return s

    def reject(self, room: int, why: str) -> None:
        """A request this server will not run: tell the decode side now or when it asks."""
        if room in self.early:
            peer = self.early.pop(room)[0]
            self.send(peer, ("failed", room, why))
            return
        if room in self.claims:  # its decode half waits for KV space: tell it now, not after a timeout
            self.send(self.claims.pop(room)[0], ("failed", room, why))
        self.dead_rooms[room] = (why, time.monotonic())  # (asked about later: the same answer)

    def forget(self, room: int) -> None:
        """Drop a finished sender; a failed one that never met its decode server is remembered, so
        metadata arriving later is answered with the reason."""
        self.claims.pop(room, None)
        s = self.senders.pop(room, None)
        if s is not None and s.state is KVPoll.Failed and s.peer is None:
            self.dead_rooms[room] = (s.error, time.monotonic())

    def send_final(self, peer: bytes, msg: tuple) -> None:
        """A room's last message ("done", "failed", "released"), kept to be repeated if lost."""
        self.answers.pop(msg[1], None)  # re-inserted at the end: the table stays in time order
        self.answers[msg[1]] = (peer, msg, time.monotonic())
        self.send(peer, msg)

    def send(self, peer: bytes, msg: tuple) -> None:
        try:
            self.sock.send_multipart([peer, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a peer gone or not reading: its own timeouts take over
            logger.warning("could not send %s to a decode server: %s", msg[0], exc)

    def busy(self) -> bool:
        return any(s.writes for s in self.senders.values())

    def poll(self) -> None:
        now = time.monotonic()
        while self.sock.poll(0):
            frames = self.sock.recv_multipart()
            msg = decode(frames[-1]) if len(frames) == 2 else None
            if msg is None:
                logger.warning("dropped a malformed message on the bootstrap port")
                continue
            self._handle(frames[0], msg, now)
        for s in list(self.senders.values()):
            s._progress(now)
        for table in (self.early, self.dead_rooms):
            for room in [r for r, v in table.items() if now - v[-1] > self.timeout]:
                entry = table.pop(room)
                if table is self.early:
                    self.send(entry[0], ("failed", room, f"the prefill server never received request room {room}"))
        # asked about after one timeout of silence, at most; kept in the order they were made, so
        # only the expired ones at the front are looked at (this runs every scheduler step)
        while self.answers and now - next(iter(self.answers.values()))[2] > 3 * self.timeout:
            del self.answers[next(iter(self.answers))]
        for room, (peer, at) in list(self.claims.items()):
            quiet = now - self.peers[peer].last_heard > self.timeout  # its decode server went quiet
            never_came = room not in self.senders and now - at > self.timeout  # the request never got here
            if quiet or never_came:
                del self.claims[room]
        self._drop_quiet_peers(now)

    def _drop_quiet_peers(self, now: float) -> None:
        """Forget a decode server silent for three timeouts that nothing here refers to, its NIXL
        agent too: one idle that long has closed its connection (its next one says hello again,
        and a message without one is answered "who"), and one restarted comes back under a new
        name, so without this every decode restart would leave an agent here for good."""
        stale = now - 3 * self.timeout
        if all(p.last_heard >= stale for p in self.peers.values()):
            return
        in_use = {s.peer for s in self.senders.values()}
        in_use.update(c[0] for c in self.claims.values())
        in_use.update(e[0] for e in self.early.values())
        in_use.update(a[0] for a in self.answers.values())
        for peer in [k for k, p in self.peers.items() if p.last_heard < stale and k not in in_use]:
            agent = self.peers.pop(peer).agent
            if agent:  # ("" for a peer whose hello failed)
                self.mover.remove_peer(agent)

    def _handle(self, peer: bytes, msg: tuple, now: float) -> None:
        kind = msg[0]
        if kind == "hello":
            _, agent, metadata, layout, backend = msg
            error = self.layout.mismatch(layout)
            if backend != self.mover.name:
                error = f"the prefill server uses the {self.mover.name} transfer backend, the decode server {backend}"
            name = ""
            if error is None:
                try:
                    name = self.mover.add_peer(metadata)
                except Exception as exc:  # a bad or unreachable agent: its requests fail
                    error = f"cannot connect to the decode server's NIXL agent: {exc}"
            self.peers[peer] = _Peer(name, layout, error, now)
            return
        if peer in self.peers:
            self.peers[peer].last_heard = now
        if kind in ("ping", "claim", "meta", "status") and peer not in self.peers:
            self.send(peer, ("who", msg[1] if len(msg) > 1 else -1))  # we restarted since its hello: it retries
        elif kind == "ping":
            self.send(peer, ("pong",))
        elif kind == "claim":
            room = msg[1]
            if room in self.dead_rooms:  # rejected here already: tell it now, keep nothing
                self.send(peer, ("failed", room, self.dead_rooms.pop(room)[0]))
            else:
                self.claims[room] = (peer, now)
        elif kind == "status":
            self._status(peer, msg[1])
        elif kind == "meta":
            _, room, dst_pages, decode_prefix_len, digest, grammar = msg
            bad = [p for p in dst_pages if not (isinstance(p, int) and 0 <= p < self.peers[peer].layout.num_pages)]
            if bad:
                self.send(peer, ("failed", room, f"page ids {bad[:4]} are outside the decode pool"))
            elif self.peers[peer].error is not None:
                self.send(peer, ("failed", room, self.peers[peer].error))
            elif room in self.dead_rooms:
                self.send(peer, ("failed", room, self.dead_rooms.pop(room)[0]))
            elif room in self.senders:
                self._attach(self.senders[room], peer, dst_pages, decode_prefix_len, digest, grammar)
            else:
                self.early[room] = (peer, dst_pages, decode_prefix_len, digest, grammar, now)
        elif kind == "abort":
            room = msg[1]
            self.claims.pop(room, None)
            if (s := self.senders.get(room)) is not None and s.state is not KVPoll.Failed:
                s.reply, s.peer = "released", s.peer or peer
                s.fail(DECODE_ABORTED)
            else:
                self.early.pop(room, None)
                self.dead_rooms[room] = (DECODE_ABORTED, now)
                self.send(peer, ("released", room, "aborted"))

    def _status(self, peer: bytes, room: int) -> None:
        """Answer a decode server that heard nothing about ``room`` for a timeout."""
        s = self.senders.get(room)
        if s is not None and s.peer == peer:
            if s.state not in (KVPoll.Failed, KVPoll.Success):  # still working on it, or on its last writes
                self.send(peer, ("accepted", room) if s.error is None else ("failing", room, s.error))
            elif room in self.answers:
                self.send(peer, self.answers[room][1])
        elif s is None and room in self.answers and self.answers[room][0] == peer:
            self.send(peer, self.answers[room][1])  # its final answer was lost
        elif s is None and room not in self.early:  # unknown here: nothing of it can be writing
            why = self.dead_rooms.pop(room)[0] if room in self.dead_rooms else f"no request room {room} here"
            self.send(peer, ("failed", room, why))

    def _attach(
        self, s: KVSender, peer: bytes, dst_pages: list[int], decode_prefix_len: int, digest: str, grammar: str
    ) -> None:
        if s.peer is not None:
            if s.peer == peer and s.dst_pages == list(dst_pages):
                return  # the same metadata again (re-sent after a "who"): nothing new
            self.send(peer, ("failed", s.room, f"room {s.room} already has a decode server"))
            return
        s.peer, s.dst_pages, s.decode_prefix_len = peer, list(dst_pages), decode_prefix_len
        if s.error is not None:
            if s.state is KVPoll.Failed:  # already final: tell the peer now
                self.send(peer, ("failed", s.room, s.error))
            return  # otherwise _progress tells the peer once the failure is final
        if digest != s.prompt_digest:  # (a different tokenizer or --chat-template: other KV)
            s.fail(
                f"the decode server's prompt differs from the prefill server's ({s.num_prompt_tokens} tokens here): "
                "start both with the same model, tokenizer and --chat-template"
            )
            return
        if grammar != s.grammar_start:  # (the first token, sampled here, must be what the decode side's grammar takes)
            s.fail(
                f"the decode server starts the request's grammar {grammar}, the prefill server "
                f"{s.grammar_start}: start both with the same --reasoning-parser"
            )
            return
        if s.start_page + len(s.dst_pages) != s.num_prompt_pages:
            s.fail(
                f"the decode server asked for {len(s.dst_pages)} pages after a {decode_prefix_len}-token prefix, "
                f"but the prompt has {s.num_prompt_pages} pages"
            )
            return
        s.state = KVPoll.WaitingForInput
        self.send(peer, ("accepted", s.room))

    def shut_down(self, why: str, seconds: float = 2.0) -> None:
        """This server is exiting: every room fails with ``why``, and each decode server that has a
        room here (its metadata came, it claimed the room, or its metadata came first) hears so
        before the port closes, instead of after a timeout of silence. A sender with writes in
        flight is waited for, ``seconds`` at most: until they end, the decode side must keep the
        pages they write (past that, its own timeout takes over). A sender whose every page is sent
        and whose first token is known succeeds instead, if its last writes land in that time."""
        for s in self.senders.values():
            if s.first_token is None:
                s.fail(why)
        deadline = time.monotonic() + seconds
        self.poll()  # (a failed sender with no write in flight tells its decode server here)
        while self.busy() and time.monotonic() < deadline:
            time.sleep(0.005)
            self.poll()
        for s in self.senders.values():  # (writes still in flight: no answer; the peer's timeout)
            s.fail(why)
        told = {room for room, s in self.senders.items() if s.peer is not None}
        for room, (peer, _) in self.claims.items():
            if room not in told:
                self.send(peer, ("failed", room, why))
        for room, entry in self.early.items():
            self.send(entry[0], ("failed", room, why))
        self.claims.clear()
        self.early.clear()

    def close(self) -> None:
        self.mover.close()
        self.sock.close(linger=500)  # (the last answers of a shutdown still go out)
        self.ctx.term()


# --- decode side ---------------------------------------------------------------------------------


class KVReceiver:
    """One request's KV on its way from a prefill server into this decode server's pool."""

    def __init__(self, mgr: DecodeTransfer, addr: str, room: int):
        self.mgr, self.addr, self.room = mgr, addr, room
        self.state = KVPoll.Bootstrapping
        self.error: str | None = None
        self.first_token: int | None = None
        self.pages = self.bytes = 0
        self.writes_expected: int | None = None
        self.writes_seen = 0
        self.meta: tuple | None = None  # the metadata message, once sent (re-sent if the peer restarted)
        self.meta_sent_at: float | None = None
        self.accepted = False
        self.aborting = False
        self.give_up_at: float | None = None  # aborting: when a silent peer is presumed dead
        self.done_at: float | None = None  # when the prefill side said every write had landed
        self.last_word = time.monotonic()  # when the prefill side last said something about this room
        self.seconds = 0.0

    @property
    def outstanding(self) -> bool:
        return self.state not in (KVPoll.Failed, KVPoll.Success)

    def init(self) -> None:
        """Tell the prefill server this request exists (it waits for our metadata while we wait
        for KV space, instead of timing out)."""
        if not any(r.addr == self.addr and r.outstanding for r in self.mgr.receivers.values() if r is not self):
            self.mgr.conns[self.addr].last_heard = time.monotonic()  # silence counts from now, not from idle time
        self.mgr._send(self.addr, ("claim", self.room))

    def send_metadata(
        self, page_indices: list[int], decode_prefix_len: int, prompt_ids: list[int], grammar: str = ""
    ) -> None:
        """Ask for the prompt pages after ``decode_prefix_len`` tokens, into ``page_indices``; the
        prefill server checks that ``prompt_ids`` are the ones it computes, and that it starts the
        request's grammar where this server does (``grammar``: ``grammar_start``)."""
        self.meta_sent_at = time.monotonic()
        self.state = KVPoll.WaitingForInput
        digest = prompt_digest(prompt_ids)
        self.meta = ("meta", self.room, list(page_indices), decode_prefix_len, digest, grammar)
        self.mgr._send(self.addr, self.meta)

    def poll(self) -> KVPoll:
        return self.state

    def abort(self, why: str = "aborted") -> None:
        """Stop the transfer; ``poll`` turns ``Failed`` once no write into our pages can land: the
        prefill side confirms, or falls silent for a timeout (while it answers pings, it is asked
        again every timeout: a write of the room that is stuck there can still land)."""
        if not self.outstanding or self.aborting:
            return
        self.aborting = True
        self.error = self.error or why
        self.mgr._send(self.addr, ("abort", self.room))
        if self.meta is None:  # no pages of ours were ever named to the prefill side
            self.state = KVPoll.Failed
        else:
            self.give_up_at = time.monotonic() + self.mgr.timeout

    def _final(self, why: str) -> None:
        """The prefill side says no write of this request can land any more."""
        if self.outstanding:
            self.error = self.error if self.aborting else why
            self.state = KVPoll.Failed

    def _check_done(self) -> None:
        if (
            self.first_token is not None
            and self.writes_expected is not None
            and self.writes_seen >= self.writes_expected
            and self.outstanding
        ):
            self.state = KVPoll.Success
            self.seconds = time.monotonic() - (self.meta_sent_at or time.monotonic())


@dataclass
class _Conn:
    sock: zmq.Socket
    last_heard: float
    last_ping: float
    last_used: float = 0.0  # when we last sent on it (idle connections are closed)


class DecodeTransfer:
    """The decode server's connections to prefill servers and its receivers."""

    def __init__(self, kv: torch.Tensor, backend: str, timeout: float, vocab_size: int):
        self.layout = KVLayout.of(kv)
        self.timeout = timeout
        self.vocab_size = vocab_size  # a first token from a peer must be a token
        self.ctx = zmq.Context()
        self.mover = make_mover(backend, kv, "decode")
        self.conns: dict[str, _Conn] = {}
        self.receivers: dict[int, KVReceiver] = {}
        self.notif_counts: dict[int, int] = {}

    def receiver(self, host: str, port: int, room: int) -> KVReceiver:
        """A receiver for ``room``, connected to its prefill server; ValueError if the room is
        taken or the address is unusable."""
        if room in self.receivers:
            raise ValueError(f"bootstrap_room {room} is already in use on this decode server")
        addr = tcp_address(host, port)
        self._connect(addr)
        r = self.receivers[room] = KVReceiver(self, addr, room)
        return r

    def forget(self, room: int) -> None:
        self.receivers.pop(room, None)
        self.notif_counts.pop(room, None)

    def abort_room(self, host: str, port: int, room: int) -> None:
        """Tell a prefill server to drop a room this server will not take."""
        addr = tcp_address(host, port)
        try:
            self._connect(addr)
        except ValueError as exc:
            logger.warning("cannot tell %s to drop room %d: %s", addr, room, exc)
            return
        self._send(addr, ("abort", room))

    def _hello(self, addr: str) -> None:
        hello = ("hello", self.mover.agent_name, self.mover.metadata(), self.layout, self.mover.name)
        self._send(addr, hello)

    def _connect(self, addr: str) -> None:
        if addr in self.conns:
            return
        if len(self.conns) >= MAX_PREFILL_PEERS:
            raise ValueError(f"already connected to {MAX_PREFILL_PEERS} prefill servers; {addr} is one too many")
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.mover.agent_name.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.connect(addr)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ValueError(f"cannot connect to the prefill server's bootstrap address {addr}: {exc}") from None
        now = time.monotonic()
        self.conns[addr] = _Conn(sock, now, now)
        self._hello(addr)

    def _send(self, addr: str, msg: tuple) -> None:
        self.conns[addr].last_used = time.monotonic()
        try:
            self.conns[addr].sock.send(encode(msg), flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # the peer is not reachable: its silence fails the request later
            logger.warning("could not send %s to %s", msg[0], addr)

    def busy(self) -> bool:
        return any(r.state in (KVPoll.WaitingForInput, KVPoll.Transferring) for r in self.receivers.values())

    def poll(self) -> None:
        now = time.monotonic()
        for addr, conn in self.conns.items():
            while conn.sock.poll(0):
                conn.last_heard = now
                if (msg := decode(conn.sock.recv())) is None:
                    logger.warning("dropped a malformed message from %s", addr)
                    continue
                self._handle(addr, msg)
        for msg in self.mover.notifs():
            try:
                room = int(msg.split(b":", 1)[0])
            except ValueError:
                logger.warning("dropped a malformed KV write notification")
                continue
            if room in self.receivers:
                self.notif_counts[room] = self.notif_counts.get(room, 0) + 1
                self.receivers[room].writes_seen = self.notif_counts[room]
                self.receivers[room].last_word = now
                self.receivers[room]._check_done()
        waiting = {r.addr for r in self.receivers.values() if r.outstanding}
        for addr in waiting:
            conn = self.conns[addr]
            if now - conn.last_ping > min(PING_SECONDS, self.timeout / 4):
                conn.last_ping = now
                self._send(addr, ("ping",))
        for r in self.receivers.values():
            if not r.outstanding:
                continue
            if r.aborting:
                if r.give_up_at is not None and now > r.give_up_at:
                    if now - self.conns[r.addr].last_heard > self.timeout:  # the peer is gone: nothing can land
                        r.state = KVPoll.Failed
                    else:  # alive (its pongs): it answers once the room's writes end, a stuck one too
                        r.give_up_at = now + self.timeout
                        self._send(r.addr, ("abort", r.room))  # (in case the first was lost)
            elif r.done_at is not None and now - r.done_at > self.timeout:  # its writes are over: safe
                r._final(f"{r.writes_expected - r.writes_seen} KV write notifications never arrived")
            elif now - self.conns[r.addr].last_heard > self.timeout:
                r.abort(f"the prefill server at {r.addr} was silent for {self.timeout:g} s")
            elif r.meta_sent_at is not None and not r.accepted and now - r.meta_sent_at > self.timeout:
                r.abort(f"the prefill server at {r.addr} did not take room {r.room} within {self.timeout:g} s")
            elif r.accepted and r.done_at is None and now - r.last_word > self.timeout:
                r.last_word = now  # its final answer may have been lost: ask (once per timeout)
                self._send(r.addr, ("status", r.room))
        in_use = {r.addr for r in self.receivers.values()}
        for addr in [a for a, c in self.conns.items() if a not in in_use and now - c.last_used > self.timeout]:
            self.conns.pop(addr).sock.close(linger=0)  # idle: a later request connects (and says hello) again

    def _handle(self, addr: str, msg: tuple) -> None:
        kind = msg[0]
        if kind == "pong":
            return
        if kind == "who":  # the prefill server restarted: introduce ourselves again, repeat what it lost
            self._hello(addr)
            for r in self.receivers.values():
                if r.addr != addr or not r.outstanding:
                    continue
                if r.aborting:
                    self._send(addr, ("abort", r.room))
                    continue
                self._send(addr, ("claim", r.room))
                if r.meta is not None:
                    self._send(addr, r.meta)
            return
        r = self.receivers.get(msg[1])
        if r is None:
            return
        r.last_word = time.monotonic()
        if kind == "accepted":
            r.accepted = True
            if r.state is KVPoll.WaitingForInput:
                r.state = KVPoll.Transferring
        elif kind == "done":  # every write has landed
            _, _, first_token, pages, nbytes, writes = msg
            expected = len(r.meta[2]) if r.meta is not None else -1
            if not 0 <= first_token < self.vocab_size or pages != expected or nbytes < 0 or writes < 0:
                r.abort(f"the prefill server's answer does not fit the request (token {first_token}, {pages} pages)")
                return
            r.first_token, r.pages, r.bytes = first_token, pages, nbytes
            r.accepted = True
            r.writes_expected = writes if self.mover.notifies else 0
            r.writes_seen = self.notif_counts.get(r.room, 0)
            r.done_at = time.monotonic()
            if r.aborting:
                r._final("aborted")
            else:
                r._check_done()
        elif kind == "failed":
            r._final(f"the prefill server failed the request: {msg[2]}")
        elif kind == "failing":  # a write into our pages may still land: fail the request, keep the pages
            r.abort(f"the prefill server failed the request: {msg[2]}")
        elif kind == "released":
            r._final("aborted")

    def close(self) -> None:
        self.mover.close()
        for conn in self.conns.values():
            conn.sock.close(linger=0)
        self.ctx.term()
