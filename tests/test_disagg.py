"""Prefill/decode disaggregation, in one process: a prefill and a decode scheduler driver, each
with its own engine and KV pool, talk over real ZMQ sockets and move KV with NIXL (host memory)
or the fake backend. Stepping both by hand makes every failure scenario deterministic."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

pytest.importorskip("nixl")  # before the imports below, which need the server stack (pyzmq) too

from checkpoints import build_checkpoint, doubled_letter

from minengine import LLM, SamplingParams
from minengine.config import EngineConfig
from minengine.disagg import transfer
from minengine.disagg.servers import DecodeDriver, PrefillDriver
from minengine.engine import Engine
from minengine.models import load_tokenizer
from minengine.server.protocol import AddRequest, Bootstrap, FailRoom
from minengine.server.workers import free_port
from minengine.structured import THINK_TAGS, StructuredOutputs

PS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(build_checkpoint(tmp_path_factory.mktemp("ck") / "qwen3", "qwen3"))


@pytest.fixture(scope="module")
def reference(ckpt):
    llm = LLM(ckpt, device="cpu", page_size=PS, disable_radix_cache=True)

    def run(prompts, params=GREEDY):
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    return run


class Pair:
    """A prefill driver and a decode driver on a free bootstrap port."""

    def __init__(self, ckpt, backend="nixl", decode_radix=True, prefill=None, decode=None, timeout=5.0):
        self.port = free_port()
        common = dict(
            model=ckpt,
            device="cpu",
            page_size=PS,
            max_total_tokens=1024,
            chunked_prefill_size=12,
            disaggregation_transfer_backend=backend,
            disaggregation_bootstrap_port=self.port,
            disaggregation_bootstrap_timeout=timeout,
        )
        pcfg = EngineConfig(**{**common, "disaggregation_mode": "prefill", **(prefill or {})})
        dcfg = EngineConfig(
            **{
                **common,
                "disaggregation_mode": "decode",
                "disaggregation_decode_enable_radix_cache": decode_radix,
                "num_reserved_decode_tokens": 2,
                **(decode or {}),
            }
        )
        for attempt in range(5):  # a free port can be taken before the bind (an ephemeral one of a connection)
            try:
                self.p = PrefillDriver(Engine(pcfg, detokenize=False))
                break
            except transfer.TransferError as exc:
                if "cannot listen" not in str(exc) or attempt == 4:
                    raise
                self.port = free_port()
                pcfg = replace(pcfg, disaggregation_bootstrap_port=self.port)
        dcfg = replace(dcfg, disaggregation_bootstrap_port=self.port)
        self.d = DecodeDriver(Engine(dcfg, detokenize=False))
        self.rooms = iter(range(1000, 10**6))
        self.out: dict[str, dict] = {}

    def bootstrap(self, room=None):
        return Bootstrap("127.0.0.1", self.port, next(self.rooms) if room is None else room)

    def submit(self, rid, prompt, params=GREEDY, to=("p", "d"), room=None):
        b = self.bootstrap(room)
        for side in to:
            driver = self.p if side == "p" else self.d
            self._record(side, driver.add(AddRequest(rid, list(prompt), params, b)))
        return b

    def _record(self, side, updates):
        for u in updates:
            entry = self.out.setdefault(f"{side}:{u.rid}", {"tokens": [], "reason": None, "error": None})
            entry["tokens"] += u.new_token_ids
            entry["reason"] = u.finish_reason or entry["reason"]
            entry["error"] = u.error or entry["error"]
            entry["cached"] = entry.get("cached", 0) + u.cached_tokens

    def step(self, sides="pd"):
        if "p" in sides:
            self._record("p", self.p.step())
        if "d" in sides:
            self._record("d", self.d.step())

    def run_until(self, cond, timeout=30.0, sides="pd"):
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"timed out; outputs so far: {self.out}"
            self.step(sides)
            time.sleep(0.001)

    def done(self, *keys):
        return lambda: all(self.out.get(k, {}).get("reason") for k in keys)

    def idle(self):
        """Both sides hold no KV for requests and nothing is pending."""
        return (
            self.p.engine.stats()["kv_pages_in_use"] == 0
            and self.d.engine.stats()["kv_pages_in_use"] == 0
            and not self.p.pending()
            and not self.d.pending()
            and not self.p.xfer.senders
            and not self.d.xfer.receivers
        )

    def received(self):
        return self.d.drain_transfer_stats()[0]

    def close(self):
        self.p.close()
        self.d.close()


@pytest.fixture
def pair(ckpt):
    pairs = []

    def make(**kwargs):
        pairs.append(Pair(ckpt, **kwargs))
        return pairs[-1]

    yield make
    for p in pairs:
        p.close()


PROMPTS = [[(7 * i + 3 * j) % 300 + 5 for j in range(n)] for i, n in enumerate((3, 4, 9, 17, 26))]


@pytest.mark.parametrize("decode_radix", [False, True])
def test_nixl_outputs_equal_a_single_server(pair, reference, decode_radix):
    """Chunked prefills (chunk 12, page 4: partial last pages, prompts over several chunks), KV
    moved by NIXL: greedy tokens equal one engine's, both pools end with no request pages."""
    pd = pair(decode_radix=decode_radix)
    for i, p in enumerate(PROMPTS):
        # odd requests reach the decode server first: their metadata waits for the prefill half
        if i % 2:
            b = pd.submit(f"r{i}", p, to=("d",))
            pd.step("d")
            time.sleep(0.05)
            pd.p.xfer.poll()
            assert b.room in pd.p.xfer.early
            pd.submit(f"r{i}", p, to=("p",), room=b.room)
        else:
            pd.submit(f"r{i}", p)
    keys = [f"d:r{i}" for i in range(len(PROMPTS))]
    pd.run_until(pd.done(*keys, *[f"p:r{i}" for i in range(len(PROMPTS))]))
    assert [pd.out[k]["tokens"] for k in keys] == reference(PROMPTS)
    assert all(pd.out[k]["reason"] == "length" for k in keys)
    # the prefill side's answer is the first token alone
    assert [pd.out[f"p:r{i}"]["tokens"] for i in range(len(PROMPTS))] == [r[:1] for r in reference(PROMPTS)]
    got = pd.received()
    assert sorted(pages for pages, _, _ in got) == sorted(-(-len(p) // PS) for p in PROMPTS)
    per_page = pd.d.xfer.layout.bytes_per_page
    assert all(nbytes == pages * per_page and seconds > 0 for pages, nbytes, seconds in got)
    pd.run_until(pd.idle)


def test_adjusted_logits_across_the_pair_equal_a_single_server(pair, reference, ckpt):
    """Penalties, logit_bias, min_tokens and bad words: the prefill side adjusts the first token
    (its end banned by min_tokens), the decode side counts that token in before its own, and its
    output tail starts with it (a bad word of that token twice bans it at once)."""
    eos = 1  # the test checkpoint's
    letter, token = doubled_letter(load_tokenizer(ckpt))
    params = [
        SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.6, frequency_penalty=1.0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0, min_tokens=4, logit_bias={eos: 100.0}),
        SamplingParams(max_tokens=8, temperature=0.9, seed=7, presence_penalty=1.5, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0, min_tokens=1, logit_bias={eos: 100.0}),
        SamplingParams(max_tokens=8, temperature=0, bad_words=[letter * 2], logit_bias={token: 100.0}, ignore_eos=True),
    ]
    prompts = PROMPTS
    pd = pair()
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        pd.submit(f"r{i}", prompt, p)
    keys = [f"d:r{i}" for i in range(len(prompts))]
    pd.run_until(pd.done(*keys))
    want = reference(prompts, params)
    assert [pd.out[k]["tokens"] for k in keys] == want
    assert want[1] == want[1][:4] + [eos] and want[3][1:] == [eos]
    assert want[4][::2] == [token] * 4 and token not in want[4][1::2]
    pd.run_until(pd.idle)


def test_fake_backend_runs_the_queues_without_moving_data(pair, reference):
    pd = pair(backend="fake", decode_radix=False)
    for i, p in enumerate(PROMPTS):
        pd.submit(f"r{i}", p)
    keys = [f"d:r{i}" for i in range(len(PROMPTS))]
    pd.run_until(pd.done(*keys))
    outputs = [pd.out[k]["tokens"] for k in keys]
    assert all(len(o) == GREEDY.max_tokens for o in outputs)
    # the first token comes from the prefill side; later ones read a KV that never arrived
    assert [o[0] for o in outputs] == [r[0] for r in reference(PROMPTS)]
    assert outputs != reference(PROMPTS)
    assert all(nbytes == 0 for _, nbytes, _ in pd.received())
    pd.run_until(pd.idle)


def test_decode_radix_cache_asks_only_for_new_pages(pair, reference):
    """A 3-turn conversation: with the decode radix cache on, turns 2 and 3 transfer only the
    pages after what the decode server holds; with it off, every turn transfers every page."""
    pages = {}
    for radix in (False, True):
        pd = pair(decode_radix=radix)
        history, moved, prev_history = list(PROMPTS[3]), [], []
        for turn in range(3):
            pd.submit(f"t{turn}", history)
            pd.run_until(pd.done(f"d:t{turn}"))
            tokens = pd.out[f"d:t{turn}"]["tokens"]
            assert tokens == reference([history])[0]
            moved.append(sum(p for p, _, _ in pd.received()))
            if radix and turn:
                # the decode server cached the previous turn's whole pages (prompt + computed output)
                held = (len(prev_history) + GREEDY.max_tokens - 1) // PS
                assert pd.out[f"d:t{turn}"]["cached"] == held * PS
                assert moved[-1] == -(-len(history) // PS) - held
            prev_history = list(history)
            history = history + tokens + [11, 12, 13, 14, 15]
        pages[radix] = moved
        pd.run_until(pd.idle)
    assert pages[True][0] == pages[False][0]
    assert all(on < off for on, off in zip(pages[True][1:], pages[False][1:], strict=True))


def test_a_cache_salt_keeps_its_own_pages_on_both_servers(pair, reference):
    """vLLM's cache_salt across disaggregation: the decode radix cache serves a prompt only to a
    request of the same salt, and the prefill server's cache too; the outputs are the same."""
    pd = pair(decode_radix=True)
    want = reference([PROMPTS[4]])[0]
    for i, salt in enumerate(["a", "a", "b", None]):
        pd.submit(f"s{i}", PROMPTS[4], replace(GREEDY, cache_salt=salt))
        pd.run_until(pd.done(f"d:s{i}", f"p:s{i}"))
        assert pd.out[f"d:s{i}"]["tokens"] == want
    held = len(PROMPTS[4]) // PS * PS  # the first request's whole prompt pages
    assert [pd.out[f"d:s{i}"]["cached"] for i in range(4)] == [0, held, 0, 0]
    assert [pd.out[f"p:s{i}"]["cached"] for i in range(4)] == [0, held, 0, 0]
    pd.run_until(pd.idle)


# --- failures: every one ends with a clear error and no KV held on either side ------------------


def test_halves_with_different_prompts_fail_with_the_reason(pair):
    """The two halves of a request must compute one prompt (two servers with different chat
    templates or tokenizers would not): a prompt of the same length but other tokens would take
    the wrong KV, so the request fails on both servers, saying why, and nothing is held."""
    pd = pair()
    other = [t + 1 for t in PROMPTS[4]]
    b = pd.submit("x", PROMPTS[4], to=("p",))
    pd.submit("x", other, to=("d",), room=b.room)
    pd.run_until(pd.done("d:x", "p:x"))
    for side in ("d", "p"):
        assert "the decode server's prompt differs from the prefill server's" in pd.out[f"{side}:x"]["error"]
    pd.run_until(pd.idle)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    """A checkpoint whose tokenizer has <think> and </think> as tokens, and a single server of it."""
    path = str(build_checkpoint(tmp_path_factory.mktemp("thinker") / "qwen3", "qwen3", added_tokens=THINK_TAGS))
    llm = LLM(path, device="cpu", page_size=PS, disable_radix_cache=True)
    yield path, llm
    llm.shutdown()


def test_a_grammar_runs_across_the_pair_and_both_must_start_it_alike(thinker):
    """The prefill server samples the first token under the request's grammar, the decode
    server's grammar takes it first: the outputs follow the grammar and equal a single server's,
    also when the grammar starts after the reasoning and the first token is </think>. Servers
    that start a grammar at different places (different --reasoning-parser) fail the request on
    both, saying so, and hold nothing."""
    path, llm = thinker
    end = llm.engine.tokenizer.backend.token_to_id("</think>")
    choice = ["red", "green"]
    specs = [StructuredOutputs(choice=choice), StructuredOutputs(choice=choice, reasoning="open")]
    params = [
        SamplingParams(max_tokens=8, temperature=0, structured_outputs=specs[0]),
        SamplingParams(max_tokens=8, temperature=0, structured_outputs=specs[1], logit_bias={end: 100}),
    ]
    want = [o.outputs[0].token_ids for o in llm.generate([PROMPTS[3]] * 2, params, use_tqdm=False)]
    assert want[1][0] == end
    pd = Pair(path)
    try:
        for i, p in enumerate(params):
            pd.submit(f"r{i}", PROMPTS[3], p)
        pd.run_until(pd.done("d:r0", "d:r1", "p:r0", "p:r1"))
        assert [pd.out[f"d:r{i}"]["tokens"] for i in range(2)] == want
        assert [pd.out[f"d:r{i}"]["reason"] for i in range(2)] == ["stop", "stop"]
        b = pd.submit("x", PROMPTS[3], params[1], to=("p",))
        pd.submit("x", PROMPTS[3], replace(params[1], structured_outputs=specs[0]), to=("d",), room=b.room)
        pd.run_until(pd.done("d:x", "p:x"))
        for side in ("d", "p"):
            assert pd.out[f"{side}:x"]["error"].endswith(
                "the decode server starts the request's grammar at the first output token, the prefill server "
                "after the reasoning: start both with the same --reasoning-parser"
            )
        pd.run_until(pd.idle)
    finally:
        pd.close()


def test_requests_queued_outside_the_engine_count_as_waiting(pair):
    """The waiting gauge counts what the disaggregation queues hold: decode requests waiting for KV
    space or for their KV (as vLLM counts its requests waiting for remote KV), prefill requests
    waiting for their decode server's metadata."""
    pd = pair(decode={"max_total_tokens": 40, "kv_admission": "reserve"}, decode_radix=False)
    for i, p in enumerate([PROMPTS[3], PROMPTS[4], PROMPTS[3]]):
        pd.submit(f"r{i}", p)
    pd.step()
    pd.step()
    assert pd.d.queued() == 3 and pd.p.queued() >= 1  # (the prefill side hears of them one by one)
    pd.run_until(pd.done("d:r0", "d:r1", "d:r2"))
    pd.run_until(pd.idle)
    assert pd.d.queued() == 0 and pd.p.queued() == 0


def test_prefill_rejection_fails_the_decode_side(pair):
    pd = pair(prefill={"max_total_tokens": 16})  # the prefill pool cannot hold a 26-token prompt
    pd.submit("big", PROMPTS[4])
    pd.run_until(pd.done("d:big", "p:big"))
    assert "exceeds the KV cache capacity" in pd.out["p:big"]["error"]
    assert "prefill server" in pd.out["d:big"]["error"] and "KV cache capacity" in pd.out["d:big"]["error"]
    pd.run_until(pd.idle)


def test_logprobs_are_refused_on_both_sides(pair):
    """Neither engine takes a request for logprobs (the decode side never sees the first token's)."""
    pd = pair()
    pd.submit("lp", PROMPTS[2], params=replace(GREEDY, logprobs=1))
    pd.run_until(pd.done("d:lp", "p:lp"))
    for side in "pd":
        assert "with prefill/decode disaggregation allowed: None" in pd.out[f"{side}:lp"]["error"]
    pd.run_until(pd.idle)


def test_front_end_rejection_reaches_the_prefill_side(pair):
    pd = pair()
    b = pd.submit("r", PROMPTS[2], to=("p",))
    pd.d.fail_room(FailRoom(b, "bad sampling parameters"))  # what the decode API does on a 400
    pd.run_until(pd.done("p:r"))
    assert "aborted by the decode server" in pd.out["p:r"]["error"]
    pd.run_until(pd.idle)


def test_a_prefill_rejection_reaches_a_decode_half_queued_for_kv_at_once(pair, monkeypatch):
    """The prefill server's front end refuses a request (a 400 there) whose decode half waits for
    KV space and has claimed the room: the decode half fails now, while the request ahead of it
    still decodes (it heard only once it had the KV space and sent its metadata, or after a
    timeout of silence)."""
    # reserve: r0's whole sequence (247 tokens) is held for it, so r1 waits in the decode server's queue
    pd = pair(timeout=10.0, decode_radix=False, decode={"max_total_tokens": 256, "kv_admission": "reserve"})
    real_step = pd.d.engine.step  # r0's 230 steps take 1.2 s or more, however fast the machine
    monkeypatch.setattr(pd.d.engine, "step", lambda: time.sleep(0.005) or real_step())
    pd.submit("r0", PROMPTS[3], SamplingParams(max_tokens=230, temperature=0, ignore_eos=True))
    b = pd.submit("r1", PROMPTS[2], to=("d",))
    pd.run_until(lambda: len(pd.d.prealloc) == 1 and b.room in pd.p.xfer.claims)
    pd.p.fail_room(FailRoom(b, "bad sampling parameters"))  # what the prefill API does on a 400
    pd.run_until(lambda: pd.done("d:r1")() or pd.done("d:r0")())
    assert pd.out.get("d:r0", {}).get("reason") is None
    assert "rejected by the prefill server: bad sampling parameters" in pd.out["d:r1"]["error"]
    pd._record("d", pd.d.abort("r0"))
    pd.run_until(pd.idle)


def test_transfer_failure_fails_both_sides(pair, monkeypatch):
    pd = pair()

    def broken(*args, **kwargs):
        raise transfer.TransferError("injected write failure")

    monkeypatch.setattr(pd.p.xfer.mover, "write", broken)
    pd.submit("r", PROMPTS[3])
    pd.run_until(pd.done("d:r", "p:r"))
    assert "injected write failure" in pd.out["p:r"]["error"]
    assert "injected write failure" in pd.out["d:r"]["error"]
    pd.run_until(pd.idle)


@pytest.mark.parametrize("how", ["failing", "failing lost", "abort"])
def test_a_stuck_write_holds_its_room_until_it_ends(pair, reference, how):
    """A KV write with no progress for the timeout fails its request on both servers at once, but
    the room and its pages stay held on both sides until the write ends, also when the decode side
    aborted first: NIXL's release of an active write returns without stopping it (UCX cannot
    cancel an RMA write), so a write given up on could land later, in pages the decode side had
    handed to another request and cached. The mover here holds the writes back and accepts their
    release, as UCX does. A lost "failing" message is repeated when the decode side asks."""
    pd = pair(timeout=1.0)
    abort = how == "abort"
    if how == "failing lost":  # (a ROUTER drops what it sends to a peer that is reconnecting)
        send, dropped = pd.p.xfer.send, []
        pd.p.xfer.send = lambda peer, msg: (
            dropped.append(msg) if msg[0] == "failing" and not dropped else send(peer, msg)
        )
    mover = pd.p.xfer.mover
    write, state, release = mover.write, mover.state, mover.release
    held, landed = {}, {}  # a handle held back -> its arguments; let go -> the real handle

    def held_write(*args):
        held[handle := object()] = args
        return handle

    def hold(seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            pd.step()
            time.sleep(0.001)

    def pages_in_use():
        return pd.p.engine.stats()["kv_pages_in_use"], pd.d.engine.stats()["kv_pages_in_use"]

    mover.write = held_write
    mover.state = lambda h: "PROC" if h in held else state(landed.get(h, h))
    mover.release = lambda h: None if h in held else release(landed.pop(h, h))
    pd.submit("a", PROMPTS[4])
    pd.run_until(lambda: held)
    if abort:
        pd._record("d", pd.d.abort("a"))
        assert pd.out["d:a"]["reason"] == "abort" and pd.out["d:a"]["error"] is None
    else:  # both clients hear of the failure once the write made no progress for the timeout
        pd.run_until(pd.done("d:a", "p:a"))
        assert "made no progress" in pd.out["p:a"]["error"] and "made no progress" in pd.out["d:a"]["error"]
        assert how == "failing" or len(dropped) == 1
    hold(3.0)  # three timeouts more
    assert "p:a" in pd.out and all(pages_in_use()), pages_in_use()
    assert abort or "made no progress" in pd.out["p:a"]["error"]
    mover.write = write
    for handle, args in list(held.items()):  # the writes go on and end
        landed[handle] = write(*args)
        del held[handle]
    pd.run_until(pd.idle)
    pd.submit("b", PROMPTS[3])
    pd.run_until(pd.done("d:b"))
    assert pd.out["d:b"]["tokens"] == reference([PROMPTS[3]])[0]


@pytest.mark.parametrize("when", ["before_prefill", "mid_prefill", "after_prefill"])
def test_decode_abort_stops_the_prefill_side(pair, when):
    pd = pair()
    pd.submit("r", PROMPTS[4])  # 26 tokens: three chunks of 12
    if when == "mid_prefill":
        pd.run_until(lambda: any(s.sent for s in pd.p.xfer.senders.values()))
    elif when == "after_prefill":
        pd.run_until(pd.done("p:r"), sides="p")  # sent, but the decode side has not looked yet
    else:
        pd.step("d")  # the decode side has asked for the KV
    pd._record("d", pd.d.abort("r"))
    pd.run_until(pd.idle)
    if when != "after_prefill":
        assert "aborted by the decode server" in pd.out["p:r"]["error"]
    assert pd.out["d:r"]["reason"] == "abort"


def test_prefill_abort_fails_the_decode_side(pair):
    pd = pair()
    pd.submit("r", PROMPTS[4])
    pd.run_until(lambda: any(s.sent for s in pd.p.xfer.senders.values()))
    pd._record("p", pd.p.abort("r"))  # e.g. the router's connection to the prefill server closed
    pd.run_until(pd.done("d:r"))
    assert "aborted on the prefill server" in pd.out["d:r"]["error"]
    pd.run_until(pd.idle)


def _shut_down_prefill(pd) -> None:
    """What the prefill server's scheduler does on Shutdown: abort everything (it waits a moment
    for writes in flight, which land only while the decode server runs: another thread here, as
    it is another process in a deployment), close."""
    stop = threading.Event()

    def decode_server():
        while not stop.is_set():
            pd.step("d")
            time.sleep(0.001)

    thread = threading.Thread(target=decode_server)
    thread.start()
    try:
        pd._record("p", pd.p.abort_all())
    finally:
        stop.set()
        thread.join()
    pd.p.close()
    pd.p.close = lambda: None  # (the fixture's teardown)


def test_a_prefill_shutdown_tells_its_decode_servers_at_once(pair):
    """A prefill server that shuts down tells each decode server with a room there, mid-transfer
    or queued for decode KV (its claim), instead of leaving them a timeout of silence (10 s here);
    the request already decoding goes on, and the decode pool ends empty."""
    pd = pair(timeout=10.0)
    pd.submit("r", PROMPTS[4])
    pd.run_until(lambda: any(s.sent for s in pd.p.xfer.senders.values()))
    _shut_down_prefill(pd)
    pd.run_until(pd.done("d:r"), timeout=3, sides="d")
    assert "the prefill server is shutting down" in pd.out["d:r"]["error"]
    pd.run_until(lambda: pd.d.engine.stats()["kv_pages_in_use"] == 0 and not pd.d.pending(), timeout=3, sides="d")

    # reserve: r0's whole sequence (247 tokens) is held for it, so r1 waits in the decode server's queue
    pd = pair(timeout=10.0, decode_radix=False, decode={"max_total_tokens": 256, "kv_admission": "reserve"})
    pd.submit("r0", PROMPTS[3], SamplingParams(max_tokens=230, temperature=0, ignore_eos=True))
    pd.submit("r1", PROMPTS[3])
    pd.run_until(lambda: len(pd.d.prealloc) == 1 and pd.out.get("d:r0") and pd.p.xfer.claims)
    _shut_down_prefill(pd)
    pd.run_until(pd.done("d:r1"), timeout=3, sides="d")
    assert "the prefill server is shutting down" in pd.out["d:r1"]["error"]
    pd.run_until(pd.done("d:r0"), sides="d")
    assert pd.out["d:r0"]["error"] is None and len(pd.out["d:r0"]["tokens"]) == 230
    pd.run_until(lambda: pd.d.engine.stats()["kv_pages_in_use"] == 0 and not pd.d.pending(), timeout=3, sides="d")


def test_a_prefill_shutdown_lets_a_request_whose_kv_is_on_its_way_finish(pair, reference):
    """Every page sent and the first token known, the last writes still in flight when the prefill
    server shuts down: the request succeeds on both sides (it would have a moment later)."""
    pd = pair(timeout=10.0)
    pd.submit("r", PROMPTS[4])

    def landing():
        return any(s.first_token is not None and s.writes for s in pd.p.xfer.senders.values())

    pd.run_until(lambda: any(s.peer is not None for s in pd.p.xfer.senders.values()))  # its metadata came
    pd.run_until(lambda: landing() or pd.done("p:r")(), sides="p")  # (the decode side lands nothing now)
    assert landing(), "the writes landed before the decode side ran"
    _shut_down_prefill(pd)
    assert pd.out["p:r"]["reason"] == "length" and pd.out["p:r"]["error"] is None
    pd.run_until(pd.done("d:r"), sides="d")
    assert pd.out["d:r"]["error"] is None and pd.out["d:r"]["tokens"] == reference([PROMPTS[4]], GREEDY)[0]


def test_bootstrap_timeouts(pair):
    pd = pair(timeout=0.5)
    pd.submit("lonely_prefill", PROMPTS[1], to=("p",))
    pd.submit("lonely_decode", PROMPTS[1], to=("d",))
    pd.run_until(pd.done("p:lonely_prefill", "d:lonely_decode"))
    assert "no decode server asked" in pd.out["p:lonely_prefill"]["error"]
    err = pd.out["d:lonely_decode"]["error"]
    assert "never received" in err or "did not take" in err
    pd.run_until(pd.idle)


def test_dead_prefill_server_does_not_hang_the_decode_side(pair):
    pd = pair(timeout=1.0)  # both sides step in this one thread: a slow step must not look like death
    pd.submit("r", PROMPTS[4])
    pd.run_until(lambda: any(s.sent for s in pd.p.xfer.senders.values()))
    pd.p.xfer.sock.close(linger=0)  # the prefill server is gone: no answers, no pongs
    pd.run_until(pd.done("d:r"), sides="d")
    assert "was silent" in pd.out["d:r"]["error"]
    # its pages wait one more timeout for an answer to the abort (a live peer might still write)
    assert pd.d.engine.stats()["kv_pages_in_use"] > 0
    pd.run_until(lambda: pd.d.engine.stats()["kv_pages_in_use"] == 0 and not pd.d.pending(), timeout=10, sides="d")


def test_failure_after_a_decode_cache_hit_frees_only_the_new_pages(pair):
    """A request whose prompt is partly in the decode radix cache fails: the cached pages stay
    the cache's (no double free), the rest go back to the allocator."""
    pd = pair(prefill={"max_total_tokens": 24})
    pd.submit("warm", PROMPTS[3])  # 17 tokens: fits the prefill pool
    pd.run_until(pd.done("d:warm"))
    longer = PROMPTS[3] + [9] * 12  # 29 tokens: the prefill server rejects it, the decode side had a hit
    pd.submit("hit", longer)
    pd.run_until(pd.done("d:hit"))
    assert "KV cache capacity" in pd.out["d:hit"]["error"]
    pd.run_until(pd.idle)
    acc = pd.d.engine.scheduler.accounting()
    assert acc["free"] + acc["held_only_by_cache"] == acc["total"]


def test_a_late_prefill_half_cannot_write_into_reused_pages(pair, reference):
    """The decode side gives up on a room whose prefill half is late; its pages go to another
    request only after the prefill side has dropped the room, so the late half writes nothing."""
    pd = pair(timeout=1.0, decode_radix=False)
    late = pd.submit("late", PROMPTS[4], to=("d",))
    pd.run_until(pd.done("d:late"), sides="d")  # the prefill server is busy elsewhere: not polled
    assert "did not take" in pd.out["d:late"]["error"] or "silent" in pd.out["d:late"]["error"]
    other = [(11 * j) % 290 + 7 for j in range(26)]
    pd.run_until(lambda: pd.d.engine.stats()["kv_pages_in_use"] == 0, sides="pd")
    pd.submit("other", other)
    pd.submit("late", PROMPTS[4], to=("p",), room=late.room)  # the late half arrives at last
    pd.run_until(pd.done("d:other", "p:late"))
    assert "aborted by the decode server" in pd.out["p:late"]["error"]
    assert pd.out["d:other"]["tokens"] == reference([other])[0]
    pd.run_until(pd.idle)


def test_a_restarted_prefill_server_is_greeted_again(pair, reference):
    pd = pair(timeout=2.0)
    pd.submit("a", PROMPTS[2])
    pd.run_until(pd.done("d:a"))
    engine = pd.p.engine
    pd.p.close()  # the prefill server goes away and comes back on the same port
    time.sleep(0.2)
    pd.p = PrefillDriver(engine)
    for i in range(2):
        pd.submit(f"b{i}", PROMPTS[2])
        pd.run_until(pd.done(f"d:b{i}", f"p:b{i}"))
        assert pd.out[f"d:b{i}"]["error"] is None
        assert pd.out[f"d:b{i}"]["tokens"] == reference([PROMPTS[2]])[0]
    pd.run_until(pd.idle)


def test_a_request_queued_for_decode_kv_does_not_time_out(pair, monkeypatch):
    """The decode pool is full for longer than the timeout; the prefill half of the queued request
    waits (its decode server claimed the room) instead of failing."""
    # Both sides step in this one thread, and pings go every timeout / 4: a timeout of 1 s leaves
    # 0.75 s for one loop turn (about 0.15 s at most here, under load), where 0.5 s left too little.
    # reserve: r0's whole sequence (233 tokens) is held for it, so r1 waits in the prealloc queue
    pd = pair(timeout=1.0, decode_radix=False, decode={"max_total_tokens": 256, "kv_admission": "reserve"})
    # r0 must outlast the timeout however fast the machine: 230 decode steps of 5 ms or more (unslowed,
    # a fast 2-core machine decoded them in 0.85-0.95 s, and the test failed)
    real_step = pd.d.engine.step
    monkeypatch.setattr(pd.d.engine, "step", lambda: time.sleep(0.005) or real_step())
    pd.submit("r0", PROMPTS[3], SamplingParams(max_tokens=230, temperature=0, ignore_eos=True))
    pd.submit("r1", PROMPTS[3])
    pd.run_until(lambda: len(pd.d.prealloc) == 1 and pd.out.get("d:r0"))
    queued = time.monotonic()
    pd.run_until(lambda: pd.out["d:r0"]["reason"] or time.monotonic() - queued > 3.0, timeout=60)
    if not pd.out["d:r0"]["reason"]:  # held long enough: make room
        pd._record("d", pd.d.abort("r0"))
    waited = time.monotonic() - queued
    assert waited > 1.0 and pd.out.get("d:r1", {}).get("reason") is None  # over a timeout, and not failed
    pd.run_until(pd.done("d:r1", "p:r1"), timeout=60)
    assert pd.out["d:r1"]["error"] is None and pd.out["p:r1"]["error"] is None
    pd.run_until(pd.idle)


@pytest.mark.parametrize("lost", ["done", "failed"])
def test_a_lost_final_answer_is_asked_for_again(pair, reference, monkeypatch, lost):
    """The prefill side's ROUTER drops a message to a peer that is reconnecting. A decode side that
    hears nothing about an accepted room for a timeout asks, and gets the answer again."""
    pd = pair(timeout=0.5)
    send, dropped = pd.p.xfer.send, []

    def lossy(peer, msg):
        if msg[0] == lost and not dropped:
            dropped.append(msg)
            return
        send(peer, msg)

    monkeypatch.setattr(pd.p.xfer, "send", lossy)
    if lost == "failed":
        monkeypatch.setattr(pd.p.xfer.mover, "write", lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
    pd.submit("r", PROMPTS[3])
    pd.run_until(pd.done("d:r", "p:r"), timeout=20)
    assert dropped and dropped[0][0] == lost
    if lost == "done":
        assert pd.out["d:r"]["error"] is None and pd.out["d:r"]["tokens"] == reference([PROMPTS[3]])[0]
    else:
        assert "injected" in pd.out["d:r"]["error"]
    pd.run_until(pd.idle)
    # a room the prefill side never heard of is failed at once: nothing of it can be writing
    pd.p.xfer.answers.clear()
    r = pd.d.xfer.receiver("127.0.0.1", pd.port, 4242)
    r.accepted, r.meta = True, ("meta", 4242, [], 0, "", "")
    # as ``init`` does: silence counts from now (waiting for idle above may take over a timeout)
    pd.d.xfer.conns[r.addr].last_heard = time.monotonic()
    pd.d.xfer._send(r.addr, ("status", 4242))
    pd.run_until(lambda: not r.outstanding, timeout=5)
    assert "no request room 4242" in r.error
    pd.d.xfer.forget(4242)


def test_claims_do_not_pile_up_on_the_prefill_side(pair):
    pd = pair(timeout=0.5, prefill={"max_total_tokens": 16})
    for i in range(3):  # rejected by the prefill side: a claim for each arrives after, or before
        pd.submit(f"big{i}", PROMPTS[4])
    pd.submit("lonely", PROMPTS[1], to=("d",))  # its prefill half never comes
    pd.run_until(pd.done("d:big0", "d:big1", "d:big2", "d:lonely"), timeout=20)
    pd.run_until(lambda: pd.idle() and not pd.p.xfer.claims, timeout=10)


def test_a_reconnect_with_the_same_identity_is_heard(pair, reference):
    """The decode side closes an idle connection and reconnects with the same identity, maybe
    before the prefill side has seen the old one go (it was busy): the new one must be heard."""
    pd = pair(timeout=0.5)  # (0.3 s: one CI run's stall of a step went past it)
    one = SamplingParams(max_tokens=1, temperature=0)
    for i in range(16):  # without ROUTER_HANDOVER about one in five reconnects went unheard here
        pd.submit(f"r{i}", PROMPTS[1], one)
        pd.run_until(pd.done(f"d:r{i}", f"p:r{i}"))
        assert pd.out[f"d:r{i}"]["error"] is None, f"reconnect {i}: {pd.out[f'd:r{i}']['error']}"
        pd.run_until(lambda: not pd.d.xfer.conns)  # idle: closed; the next request reconnects at once
    pd.run_until(pd.idle)


def test_a_quiet_decode_server_is_forgotten_with_its_nixl_agent(pair, reference, monkeypatch):
    """A decode server silent for three timeouts, with nothing on the prefill side, is dropped
    there, NIXL agent and all (each decode restart has a new name: they would pile up); one that
    comes back says hello again and is served."""
    pd = pair(timeout=0.3)
    removed = []
    remove = pd.p.xfer.mover.remove_peer
    monkeypatch.setattr(pd.p.xfer.mover, "remove_peer", lambda name: (removed.append(name), remove(name)))
    for rid in ("first", "again"):
        pd.submit(rid, PROMPTS[2])
        pd.run_until(pd.done(f"d:{rid}", f"p:{rid}"))
        assert pd.out[f"d:{rid}"]["error"] is None
        assert pd.out[f"d:{rid}"]["tokens"] == reference([PROMPTS[2]])[0]
        assert list(pd.p.xfer.peers) == [pd.d.xfer.mover.agent_name.encode()]
        pd.run_until(lambda: not pd.p.xfer.peers, timeout=10)
    assert removed == [pd.d.xfer.mover.agent_name] * 2
    pd.run_until(pd.idle)


def test_metadata_outside_the_decode_pool_fails_the_request(pair, monkeypatch):
    pd = pair(decode_radix=False)
    send = transfer.KVReceiver.send_metadata
    monkeypatch.setattr(
        transfer.KVReceiver, "send_metadata", lambda self, pages, *rest: send(self, [p + 10**5 for p in pages], *rest)
    )
    pd.submit("r", PROMPTS[2])
    pd.run_until(pd.done("d:r", "p:r"))
    assert "outside the decode pool" in pd.out["d:r"]["error"]
    pd.run_until(pd.idle)


def test_an_idle_connection_is_not_a_silent_peer(pair, reference):
    """Silence counts only while a request waits: a pair idle past the timeout still works."""
    pd = pair(timeout=1.0)
    pd.submit("first", PROMPTS[1])
    pd.run_until(pd.done("d:first"))
    time.sleep(1.5)
    pd.submit("second", PROMPTS[2])
    pd.run_until(pd.done("d:second", "p:second"))
    assert pd.out["d:second"]["error"] is None
    assert pd.out["d:second"]["tokens"] == reference([PROMPTS[2]])[0]
    pd.run_until(pd.idle)


def test_no_prefill_server_at_the_address(pair, ckpt):
    pd = pair(timeout=0.5)
    b = Bootstrap("127.0.0.1", free_port(), 5)
    pd._record("d", pd.d.add(AddRequest("r", PROMPTS[1], GREEDY, b)))
    pd.run_until(pd.done("d:r"), sides="d")
    assert "was silent" in pd.out["d:r"]["error"]
    pd.run_until(lambda: pd.d.engine.stats()["kv_pages_in_use"] == 0 and not pd.d.pending(), timeout=10, sides="d")


def test_mismatched_servers_and_duplicate_rooms(pair):
    pd = pair(decode={"page_size": 8})
    pd.submit("r", PROMPTS[2])
    pd.run_until(pd.done("d:r", "p:r"))
    assert "differ in page_size" in pd.out["d:r"]["error"]
    pd.run_until(pd.idle)

    pd = pair()
    pd.submit("a", PROMPTS[2], room=7, to=("p",))
    pd.submit("b", PROMPTS[2], room=7, to=("p",))
    assert "bootstrap_room 7 is already in use" in pd.out["p:b"]["error"]
    pd.p.abort("a")
    pd.run_until(pd.idle)


@pytest.mark.parametrize("admission", ["preempt", "reserve"])
def test_decode_admission_waits_for_kv(pair, reference, admission):
    """A decode pool with room for one request at a time (10 pages) serves a queue of them in
    order; each waits in the prealloc queue until the KV of the one before is freed."""
    pd = pair(decode={"max_total_tokens": 40, "kv_admission": admission}, decode_radix=False)
    prompts = [PROMPTS[3], PROMPTS[4], PROMPTS[3]]  # 6, 8 and 6 pages at their longest
    for i, p in enumerate(prompts):
        pd.submit(f"r{i}", p)
    pd.step()
    pd.step()
    assert len(pd.d.prealloc) == 2  # only the first fits
    pd.run_until(pd.done("d:r0", "d:r1", "d:r2"))
    assert [pd.out[f"d:r{i}"]["tokens"] for i in range(3)] == reference(prompts)
    pd.run_until(pd.idle)


@pytest.mark.parametrize("decode_radix", [False, True])
def test_decode_server_preempts_by_recompute(pair, reference, decode_radix):
    """Preempt mode on the decode server admits on the KV a request takes now (its prompt and the
    reserved tokens), not its whole max_tokens: three requests that need 8 pages each at their
    longest share a 10-page pool. When decodes run out of pages the newest is preempted and recomputes its
    prompt and output locally (from the decode radix cache when on); tokens equal one engine's,
    and no request is admitted while a preempted one waits."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = [PROMPTS[2], PROMPTS[2][::-1], PROMPTS[3][:9]]  # 9 prompt tokens each: 3 pages with 2 reserved
    runs = {}
    for admission in ("reserve", "preempt"):
        pd = pair(decode={"max_total_tokens": 40, "kv_admission": admission}, decode_radix=decode_radix)
        sched = pd.d.engine.scheduler
        preallocate = sched.preallocate

        def first_the_preempted(req, reserved, sched=sched, preallocate=preallocate):
            queued = bool(sched.waiting)
            admitted = preallocate(req, reserved)
            assert not (queued and admitted), "admitted while a preempted request waits"
            return admitted

        sched.preallocate = first_the_preempted
        for i, p in enumerate(prompts):
            pd.submit(f"r{i}", p, params)
        most = 0
        while not pd.done(*[f"d:r{i}" for i in range(3)])():
            pd.step()
            most = max(most, len(sched.running) + len(sched.receiving))
            acc = sched.accounting()
            assert acc["free"] + acc["held_by_requests"] + acc["held_only_by_cache"] == acc["total"]
        assert [pd.out[f"d:r{i}"]["tokens"] for i in range(3)] == reference(prompts, params)
        runs[admission] = (most, sched.num_preemptions)
        pd.run_until(pd.idle)
    assert runs["reserve"] == (1, 0)  # one at a time
    most, preempted = runs["preempt"]
    assert most >= 2 and preempted > 0


@pytest.mark.gpu
def test_nixl_moves_device_memory(pair, ckpt):
    """On a GPU the pools are device memory (NIXL VRAM): outputs equal one GPU engine's."""
    gpu = {"device": "cuda", "dtype": "float32", "max_total_tokens": 1024}
    pd = pair(prefill=gpu, decode=gpu)
    assert pd.p.xfer.layout.mem_type == "VRAM"
    for i, p in enumerate(PROMPTS):
        pd.submit(f"r{i}", p)
    keys = [f"d:r{i}" for i in range(len(PROMPTS))]
    pd.run_until(pd.done(*keys), timeout=120)
    llm = LLM(ckpt, page_size=PS, disable_radix_cache=True, **gpu)
    want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert [pd.out[k]["tokens"] for k in keys] == want
    pd.run_until(pd.idle)
    # a 10-page decode pool: requests preempted there recompute on the GPU (CUDA graphs, overlap)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    pd = pair(prefill=gpu, decode={**gpu, "max_total_tokens": 40})
    for i, p in enumerate(PROMPTS[:4]):
        pd.submit(f"s{i}", p[:9], params)
    pd.run_until(pd.done(*[f"d:s{i}" for i in range(4)]), timeout=120)
    want = [o.token_ids for o in llm.generate([p[:9] for p in PROMPTS[:4]], params, use_tqdm=False)]
    assert [pd.out[f"d:s{i}"]["tokens"] for i in range(4)] == want
    assert pd.d.engine.scheduler.num_preemptions > 0
    pd.run_until(pd.idle)


def test_a_prefill_restart_mid_transfer_fails_the_request_cleanly(pair):
    """The prefill server restarts after taking a room: the decode side's pings get "who", it
    repeats its metadata, the new server never gets the request, and the room fails."""
    pd = pair(timeout=1.0)
    b = pd.submit("r", PROMPTS[4], to=("d",))
    pd.submit("r", PROMPTS[4], to=("p",), room=b.room)
    pd.run_until(lambda: any(r.accepted for r in pd.d.xfer.receivers.values()), sides="pd")
    engine = pd.p.engine
    pd.p.close()
    engine.abort(pd.p.live["r"][0])
    pd.p = PrefillDriver(engine)
    pd.run_until(pd.done("d:r"), timeout=20)
    assert "never received request" in pd.out["d:r"]["error"]
    pd.run_until(pd.idle)


def test_malformed_messages_and_addresses_are_dropped(pair, reference):
    import zmq

    pd = pair()
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.connect(f"tcp://127.0.0.1:{pd.port}")
    for junk in (b"\x80\x04garbage", b'["hello", "x"]', b'["claim"]', b'["meta", 1, ["a"], 0]', b"[]"):
        rogue.send(junk)
    time.sleep(0.1)
    pd.step("p")  # dropped with a warning, the server goes on
    rogue.close(linger=0)
    ctx.term()
    bad = Bootstrap("no such host!", pd.port, 99)
    pd._record("d", pd.d.add(AddRequest("bad", PROMPTS[1], GREEDY, bad)))
    assert "cannot connect to the prefill server" in pd.out["d:bad"]["error"]
    pd.submit("ok", PROMPTS[2])
    pd.run_until(pd.done("d:ok"))
    assert pd.out["d:ok"]["tokens"] == reference([PROMPTS[2]])[0]
    pd.run_until(pd.idle)


def test_a_hostile_prefill_peer_cannot_crash_the_decode_server(pair, monkeypatch):
    """A "prefill server" that answers with junk: deep nesting, a first token outside the
    vocabulary, bad notifications. The request fails, the decode server goes on."""
    import zmq

    pd = pair(timeout=1.0)
    ctx = zmq.Context()
    rogue, port = ctx.socket(zmq.ROUTER), free_port()
    rogue.bind(f"tcp://127.0.0.1:{port}")
    pd._record("d", pd.d.add(AddRequest("r", PROMPTS[2], GREEDY, Bootstrap("127.0.0.1", port, 5))))
    notifs = iter([[b"junk"], [b"5:x:y", b"\xff"]])
    monkeypatch.setattr(pd.d.xfer.mover, "notifs", lambda: next(notifs, []))
    peer, kinds = None, []
    deadline = time.monotonic() + 20
    # the request fails at once; its pages wait for the peer's "released"
    while not pd.out.get("d:r", {}).get("reason") or pd.d.pending():
        assert time.monotonic() < deadline
        pd.step("d")
        while rogue.poll(10):
            peer, raw = rogue.recv_multipart()
            msg = transfer.decode(raw)
            kinds.append(msg[0])
            if msg[0] == "meta":
                rogue.send_multipart([peer, b"[" * 100000])  # deep nesting: not a message
                rogue.send_multipart([peer, transfer.encode(("accepted", 5))])
                rogue.send_multipart([peer, transfer.encode(("done", 5, 10**9, len(msg[2]), 0, 0))])
            elif msg[0] == "abort":
                rogue.send_multipart([peer, transfer.encode(("released", 5, "ok"))])
    rogue.close(linger=0)
    ctx.term()
    assert kinds[:3] == ["hello", "claim", "meta"] and "abort" in kinds
    assert "does not fit the request (token 1000000000" in pd.out["d:r"]["error"]
    assert pd.d.engine.stats()["kv_pages_in_use"] == 0 and not pd.d.pending()
    time.sleep(1.1)
    pd.step("d")  # an idle connection is closed after the timeout (no cap on peers over time)
    assert f"tcp://127.0.0.1:{port}" not in pd.d.xfer.conns


def test_seeded_sampling_equals_a_single_server(pair, reference):
    """The prefill side samples the first token; the decode side skips that draw of the seeded
    generator, so every token equals one server's."""
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    pd = pair()
    pd.submit("s", PROMPTS[3], seeded)
    pd.run_until(pd.done("d:s"))
    assert pd.out["d:s"]["tokens"] == reference([PROMPTS[3]], seeded)[0]
    pd.run_until(pd.idle)


def test_config_and_start_up_errors(ckpt):
    with pytest.raises(ValueError, match="dp_size is 2 with disaggregation_mode 'prefill'; allowed: dp_size 1"):
        EngineConfig(disaggregation_mode="prefill", dp_size=2)
    with pytest.raises(ValueError, match="disaggregation_mode is 'bogus'; allowed: null, prefill, decode"):
        EngineConfig(disaggregation_mode="bogus")
    with pytest.raises(ValueError, match="disaggregation_bootstrap_port is 70000; allowed: 1..65535"):
        EngineConfig(disaggregation_bootstrap_port=70000)
    with pytest.raises(ValueError, match="disaggregation_bootstrap_timeout is 0; allowed"):
        EngineConfig(disaggregation_bootstrap_timeout=0)
    with pytest.raises(ValueError, match="LLM runs whole requests"):
        LLM("tiny", device="cpu", disaggregation_mode="decode")
    port = free_port()
    cfg = EngineConfig(model=ckpt, device="cpu", disaggregation_mode="prefill", disaggregation_bootstrap_port=port)
    first = PrefillDriver(Engine(cfg, detokenize=False))
    try:
        with pytest.raises(transfer.TransferError, match=f"cannot listen on bootstrap port {port}"):
            PrefillDriver(Engine(cfg, detokenize=False))
    finally:
        first.close()


def test_a_server_whose_bootstrap_port_is_taken_fails_to_start():
    """The prefill driver binds its bootstrap port before the scheduler reports ready: a port in use
    ends the start-up with exit code 1 and the reason (the server used to open its port, then
    answer every request 500 with its scheduler gone)."""
    import socket
    import sys

    from test_server import run_cli

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "minengine.serve", "--port", str(free_port()), "--disaggregation-mode", "prefill"]
        r = run_cli([*cmd, "--disaggregation-bootstrap-port", str(port), "--log-level", "info"], timeout=60)
    assert r.returncode == 1, r.stderr
    assert f"error: scheduler 0 failed to start: minengine.disagg.transfer.TransferError: cannot listen on " \
        f"bootstrap port {port}" in r.stderr, r.stderr  # fmt: skip
    assert "serving tiny" not in r.stderr


def test_page_runs_and_descriptors():
    import numpy as np
    import torch

    kv = torch.zeros((3, 10, 2, 4, 2, 8))  # layers, pages, K/V, page size, heads, dim
    layout = transfer.KVLayout.of(kv)
    mine, theirs, counts = transfer.page_runs([4, 5, 6, 9, 2, 3], [0, 1, 2, 3, 7, 9])
    assert mine.tolist() == [4, 9, 2, 3] and theirs.tolist() == [0, 3, 7, 9] and counts.tolist() == [3, 1, 1, 1]
    descs = layout.descs(mine, counts)
    assert descs.shape == (4 * 3, 3)
    page_bytes = 2 * 4 * 2 * 8 * 4
    base = kv.data_ptr()
    for (start, n), rows in zip(zip(mine, counts, strict=True), descs.reshape(4, 3, 3), strict=True):
        for layer, (addr, size, dev) in enumerate(rows):
            assert addr == kv[layer, start].data_ptr() and size == n * page_bytes and dev == 0
            # the run's bytes are exactly those pages of that layer
            assert addr + size == base + (layer * 10 + start + n) * page_bytes
    assert np.array_equal(transfer.page_runs([1], [5])[2], [1])


@pytest.mark.parametrize("host", ["::1", "localhost"])
def test_bootstrap_hosts_other_than_an_ipv4_literal(pair, reference, host):
    """An IPv6 literal (the router passes a URL's hostname, ``::1`` for ``http://[::1]:p``) and a
    name reach the prefill server's bootstrap socket as ``127.0.0.1`` does."""
    import socket

    assert transfer.tcp_address("::1", 5) == "tcp://[::1]:5"
    assert transfer.tcp_address("10.0.0.1", 5) == "tcp://10.0.0.1:5"
    if host == "::1":
        try:
            socket.socket(socket.AF_INET6).close()
        except OSError:
            pytest.skip("no IPv6 on this machine")
    pd = pair()
    b = Bootstrap(host, pd.port, 77)
    for side, driver in (("p", pd.p), ("d", pd.d)):
        pd._record(side, driver.add(AddRequest("r", list(PROMPTS[3]), GREEDY, b)))
    pd.run_until(pd.done("d:r", "p:r"))
    assert pd.out["d:r"]["error"] is None and pd.out["d:r"]["tokens"] == reference(PROMPTS[3:4])[0]
    pd.run_until(pd.idle)
