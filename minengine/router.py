"""``python -m minengine.router``: one OpenAI endpoint in front of prefill and decode servers.

    python -m minengine.router --prefill http://127.0.0.1:30000 8998 --decode http://127.0.0.1:30001 --port 8000

Per request it picks a prefill server and a decode server, adds ``bootstrap_host`` /
``bootstrap_port`` (the prefill server's KV handshake endpoint) and a random ``bootstrap_room``,
sends the request to both, and answers with the decode server's response (streamed when asked).
The prefill half runs with ``stream`` off and one token; if it fails before the decode half
answers (streamed: before the decode server streams output, which shows that the KV has landed),
its error is the answer. A client that goes away cancels both halves. A server that
refuses the connection never saw the request, and one that answers 503 (shutting down) ran none
of it, so the request goes to another pair (both halves again, with a new room) while another
server of that kind is up, up to ``MAX_ATTEMPTS`` pairs.
A streamed answer is held back until it carries output, so a rejection or a failure before the
first token is the same error (and status) streamed or not. With SGLang's router's flags: a server
that sends a request nothing for ``--request-timeout-secs`` fails it (504), and servers whose
``/health`` fails ``--health-failure-threshold`` periodic checks in a row are passed over until
they pass ``--health-success-threshold`` in a row.

Routing is prefix-aware: each server remembers the (hashed, 16-character) prefixes of the
prompts it was sent (their first 64 Ki characters), and a request goes to the server that
shares the longest prefix with it, so the turns of a conversation meet their own KV in the
decode server's radix cache. A prefix counts when it covers over 30% of the request's blocks (as
SGLang's router's cache_threshold) or a whole earlier prompt of that server (a conversation's next
turn). With no such prefix, or when that server is much busier than the others, the least busy
one is used.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import secrets
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.background import BackgroundTask

from minengine.serve import LOG_LEVELS, OneLineParser
from minengine.server.access import add_access_control, add_access_flags, check_access_flags
from minengine.server.api import APIError, error_response, load_json_object, openai_errors

logger = logging.getLogger("minengine.router")
BLOCK_CHARS = 16  # prefix granularity of the routing table
MAX_PREFIXES = 1 << 18  # remembered prefix blocks per server (least recently used go first)
# blocks of a prompt that decide its route (64 Ki characters): a longer prompt would take more time
# on the event loop, and flush other prompts' prefixes from the table, than its tail can gain
MAX_KEY_BLOCKS = 1 << 12
IMBALANCE = 8  # prefer the prefix match unless its server has this many more requests in flight
# a match counts only past this fraction of the prompt's blocks (SGLang's router's cache_threshold and
# its default), or where it covers a whole earlier prompt of that server (a conversation's next turn,
# whose answer and question may be longer than its history): requests that only share a short
# opening (an instruction, a chat's first role) still spread by load
CACHE_THRESHOLD = 0.3
PREFILL_GRACE_SECONDS = 2.0  # how long a failed decode half waits for the prefill half's answer
# a server that refused a connection, or is in the wrong role, gets no new requests for this long (unless all do)
DOWN_SECONDS = 5.0
ROLE_CHECK_SECONDS = 2.0  # for a server's /server_info, asked before its first request
CONNECT_SECONDS = 10.0  # to open a connection to a server (answers may take as long as generation does)
DISCONNECT_POLL_SECONDS = 0.25  # how often a request not yet answered checks that its client is still there
PENDING_CHECK_SECONDS = 5.0  # how often a server that has not passed a health check yet is checked (if sooner)
TOKENIZE_SECONDS = 60.0  # for /tokenize and /detokenize (no side effects: a silent server is passed for the next)
CLIENT_POOLS = 16  # connection pools the calls to the servers are spread over (see Router.__init__)
MAX_ATTEMPTS = 3  # pairs a request may be sent to when servers refuse connections
# connection failures where the server never saw the request: a refusal, or no answer to the connect
# (a host that drops packets), which httpx does not count as a ConnectError
NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout)


@dataclass
class Backend:
    url: str
    bootstrap_port: int | None = None  # prefill servers only
    in_flight: int = 0
    # its prompts' block hashes, least recently used first; True for a prompt's last block (its whole key)
    prefixes: OrderedDict = field(default_factory=OrderedDict)
    down_until: float = 0.0  # monotonic time: it refused a connection (or its role), so it is passed over until then
    wrong_role: bool = False  # the reason for down_until is its role (a /health it passes does not clear it)
    role_checked: bool = False  # its /server_info matched its role here (until it next refuses a connection)
    # by the periodic health checks (``Router.check_health``): pending until the first one passes
    healthy: bool = False
    pending: bool = True
    streak: int = 0  # health checks in a row whose answer differs from ``healthy``
    probe: asyncio.Future | None = field(default=None, repr=False, compare=False)  # (``Router._probe``)

    def unreachable(self, exc: BaseException | None) -> None:
        """Note a failed call: a connection error takes the server out of picking for a while
        (a server that is down fails fast, so by load alone it would get most requests), and its
        role is checked again (it may come back with other flags)."""
        if isinstance(exc, NEVER_SENT):
            self.pass_over()
            self.role_checked = False

    def pass_over(self, wrong_role: bool = False) -> None:
        """No new requests for ``DOWN_SECONDS`` (unless every server of its kind is passed over)."""
        self.down_until, self.wrong_role = time.monotonic() + DOWN_SECONDS, wrong_role

    def role_fits(self) -> None:
        """Its /server_info matches its role here: not asked again, and no longer passed over for it."""
        self.role_checked = True
        if self.wrong_role:
            self.down_until, self.wrong_role = 0.0, False

    def answers(self) -> None:
        """It passed a /health: a refusal before no longer passes it over (its role still does)."""
        if not self.wrong_role:
            self.down_until = 0.0

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    def matched_blocks(self, chain: list[int]) -> int:
        n = 0
        while n < len(chain) and chain[n] in self.prefixes:
            n += 1
        return n

    def remember(self, chain: list[int]) -> None:
        for h in chain:
            self.prefixes[h] = self.prefixes.get(h, False)
            self.prefixes.move_to_end(h)
        if chain:
            self.prefixes[chain[-1]] = True
        while len(self.prefixes) > MAX_PREFIXES:
            self.prefixes.popitem(last=False)


def prefix_chain(key: str) -> list[int]:
    """Chained hashes of the key's whole 16-character blocks, the first ``MAX_KEY_BLOCKS`` of
    them: equal leading entries, equal prefixes."""
    chain, h = [], 0
    for i in range(0, min(len(key), MAX_KEY_BLOCKS * BLOCK_CHARS) - BLOCK_CHARS + 1, BLOCK_CHARS):
        h = hash((h, key[i : i + BLOCK_CHARS]))
        chain.append(h)
    return chain


class Picker:
    def __init__(self, backends: list[Backend]):
        self.backends = backends
        self._next = 0

    def any_up(self) -> bool:
        """Whether a server is not passed over for a refusal (or a 503, or its role)."""
        now = time.monotonic()
        return any(b.down_until <= now for b in self.backends)

    def candidates(self, now: float) -> list[Backend]:
        """The servers to pick from, best tier first: those that pass their health checks and
        have not refused a connection lately; else those that pass them but refused one (the
        request probes them first: one may be back); else those that have not refused one (with
        no server passing its checks, as while they all start, a refusal still turns a request
        to another); else all (probed too; their errors are the answers)."""
        live = [b for b in self.backends if b.down_until <= now]
        healthy = [b for b in self.backends if b.healthy and not b.wrong_role]
        return [b for b in live if b.healthy] or healthy or live or self.backends

    def pick(self, key: str, among: list[Backend] | None = None) -> Backend:
        """By shared prefix (over ``CACHE_THRESHOLD`` of the key's blocks, or a whole earlier key of
        that server's), else the least busy; from ``candidates``, or ``among``."""
        chain = prefix_chain(key)
        now = time.monotonic()
        up = among or self.candidates(now)
        least = min(b.in_flight for b in up)
        best, best_n, floor = None, 0, int(CACHE_THRESHOLD * len(chain))
        for b in up:
            n = b.matched_blocks(chain)
            if n > best_n and (n > floor or b.prefixes[chain[n - 1]]) and b.in_flight <= least + IMBALANCE:
                best, best_n = b, n
        if best is None:  # no shared prefix: the least busy, round-robin among equals
            order = self.backends[self._next :] + self.backends[: self._next]
            best = min((b for b in order if b in up), key=lambda b: b.in_flight)
            self._next = (self.backends.index(best) + 1) % len(self.backends)
        best.remember(chain)
        return best


def routing_key(body: dict) -> str:
    """The text whose prefix decides where a request goes ("" for a body the server will reject)."""
    try:
        return _routing_key(body)
    except (TypeError, AttributeError, ValueError):
        return ""


def _routing_key(body: dict) -> str:
    if "messages" in body:
        parts = []
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else m
            text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
            parts.append(f"{m.get('role') if isinstance(m, dict) else ''}\x00{text}\x01")
        return "".join(parts)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


@dataclass
class HealthChecks:
    """The periodic ``/health`` checks of every server (SGLang's router's flags and defaults)."""

    interval: float = 60.0  # seconds between rounds
    timeout: float = 5.0  # for one answer
    failure_threshold: int = 3  # failures in a row that make a healthy server unhealthy
    success_threshold: int = 2  # passes in a row that make an unhealthy server healthy (a pending one: 1)


class Router:
    def __init__(
        self,
        prefills: list[Backend],
        decodes: list[Backend],
        timeout: float | None = None,
        api_key: str | None = None,
        health_checks: HealthChecks | None = None,
    ):
        """``timeout``: the seconds a server may send nothing (its answer, or a stream's next
        piece) before its request fails; None: no limit."""
        self.prefill, self.decode = Picker(prefills), Picker(decodes)
        self.timeout, self.health_checks = timeout, health_checks or HealthChecks()
        # calls take the pools in turn (``client``): httpcore's pool scans its connections for each
        # idle one whenever a request comes or goes (quadratic in its connections); with one pool,
        # 256 fake streams cost the router 30% more CPU and their TTFT 60% more
        tls = httpx.create_ssl_context()  # (one for all: each client would load the CA bundle again)
        self.clients = [
            httpx.AsyncClient(
                timeout=httpx.Timeout(timeout, connect=CONNECT_SECONDS),
                limits=httpx.Limits(max_connections=None),
                verify=tls,
                # the servers' key is the router's own (one --api-key for the whole deployment)
                headers={"authorization": f"Bearer {api_key}"} if api_key is not None else None,
            )
            for _ in range(CLIENT_POOLS)
        ]
        self._next_client = 0
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "minengine_router:requests",
            "requests sent to a pair (a retried one: once per pair)",
            ["prefill", "decode"],
            registry=r,
        )
        self.failures = Counter(
            "minengine_router:failures", "requests answered with a server error (5xx)", ["server"], registry=r
        )
        self.retries = Counter(
            "minengine_router:retries",
            "requests sent to another pair: a server refused them or answered 503",
            ["server"],
            registry=r,
        )
        self.healthy = Gauge(
            "minengine_router:server_healthy", "1 while a server passes its health checks", ["server"], registry=r
        )
        for b in (*prefills, *decodes):
            self.healthy.labels(server=b.url).set(0)
        self._background: set[asyncio.Task] = set()

    @property
    def client(self) -> httpx.AsyncClient:
        """The next of the connection pools, in turn."""
        self._next_client = (self._next_client + 1) % len(self.clients)
        return self.clients[self._next_client]

    @client.setter
    def client(self, client: httpx.AsyncClient) -> None:  # (one client for every call: tests)
        self.clients, self._next_client = [client], 0

    async def forward(self, path: str, raw: Request) -> Response:
        try:
            body = load_json_object(await raw.body())
        except APIError as exc:
            return error_response(exc.status, exc.message)
        if (request_id := raw.headers.get("x-request-id")) is not None:  # (as the servers read it)
            body["request_id"] = request_id
        key = routing_key(body)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                return await self._send(path, raw, body, key, retry=attempt < MAX_ATTEMPTS)
            except _Refused as refused:
                logger.warning("%s turned the request away (attempt %d): sending it to another pair", refused, attempt)
                self.retries.labels(server=str(refused)).inc()
        raise AssertionError("unreachable: the last attempt answers")

    async def wrong_role(self, server: Backend, role: str) -> str | None:
        """Why ``server`` cannot be this router's ``role`` ("prefill" or "decode") server, from
        its ``/server_info``: another disaggregation mode, or (a prefill server) another bootstrap
        port than the router was given, either of which would leave each request waiting out a
        bootstrap timeout. None when it fits, and when it cannot tell (no answer, or a server
        without the endpoint: the request itself then meets whatever is wrong). A server that
        fits is not asked again until it refuses a connection."""
        if server.role_checked:
            return None
        try:
            resp = await self.client.get(server.url + "/server_info", timeout=ROLE_CHECK_SECONDS)
            info = resp.json() if resp.status_code == 200 else None
        except Exception:  # (only a hint: any failure to ask is "cannot tell", and asked again next time)
            return None
        if resp.status_code == 404:  # a server without it: nothing to check, ever
            server.role_fits()
            return None
        mode = info.get("disaggregation_mode") if isinstance(info, dict) else None
        if mode is None:
            return None
        if mode != role:
            what = "not a disaggregated server" if mode == "null" else f"a {mode} server"
            return f"{server.url} is {what} (--disaggregation-mode {mode}), but the router has it as a {role} server"
        port = info.get("disaggregation_bootstrap_port")
        if role == "prefill" and port != server.bootstrap_port:
            return (
                f"the prefill server {server.url} has --disaggregation-bootstrap-port {port}, but the router "
                f"was given {server.bootstrap_port}: give it as --prefill {server.url} {port}"
            )
        server.role_fits()
        return None

    async def wrong_roles(self) -> list[str]:
        """``wrong_role`` of every server."""
        roles = [(b, "prefill") for b in self.prefill.backends] + [(b, "decode") for b in self.decode.backends]
        return [w for w in await asyncio.gather(*(self.wrong_role(b, r) for b, r in roles)) if w is not None]

    async def _send(self, path: str, raw: Request, body: dict, key: str, retry: bool) -> Response:
        """One attempt on a new pair; raises ``_Refused`` (the other half cancelled) when ``retry``
        and a server refused the connection or answered 503 while another of its kind is up."""
        p, d = self.prefill.pick(key), self.decode.pick(key)
        for kind, picker, server in (("prefill", self.prefill, p), ("decode", self.decode, d)):
            if server.down_until <= time.monotonic():
                continue
            # picked though it turned requests away lately: every server of its kind that passes its
            # health checks did. Nothing is sent to one that does not answer now (the other half would
            # hold its KV pages for the bootstrap timeout waiting for it): the first of them to pass a
            # probe is taken, else one that did not turn requests away, if any
            if (chosen := await self._answering(picker, key)) is None:
                self.failures.labels(server=server.url).inc()
                why = f"turned requests away in the last {DOWN_SECONDS:g} s and none passes /health now"
                return error_response(503, f"no {kind} server is up: {', '.join(b.url for b in picker.backends)} {why}")
            p, d = (chosen, d) if kind == "prefill" else (p, chosen)
        roles = (None, None)
        if not (p.role_checked and d.role_checked):  # (once per server: later requests pass straight on)
            roles = await asyncio.gather(self.wrong_role(p, "prefill"), self.wrong_role(d, "decode"))
        if (why := roles[0] or roles[1]) is not None:
            logger.error("%s", why)
            server, picker = (p, self.prefill) if roles[0] else (d, self.decode)
            server.pass_over(wrong_role=True)  # (asked again after)
            if retry and picker.any_up():  # (nothing was sent: the request goes to another pair)
                raise _Refused(server.url)
            self.failures.labels(server=server.url).inc()
            return error_response(502, why)
        self.requests.labels(prefill=p.url, decode=d.url).inc()
        boot = {"bootstrap_host": p.host, "bootstrap_port": p.bootstrap_port, "bootstrap_room": secrets.randbits(63)}
        prefill_body = {**body, **boot, "stream": False}
        prefill_body.pop("stream_options", None)
        decode_body = {**body, **boot}
        p.in_flight += 1
        d.in_flight += 1
        prefill = asyncio.create_task(self.client.post(p.url + path, json=prefill_body))
        prefill.add_done_callback(lambda t: _prefill_ended(t, p))
        try:
            if body.get("stream"):
                return await self._stream(path, raw, d, decode_body, prefill, p, retry)
            return await self._unary(path, raw, d, decode_body, prefill, p, retry)
        except BaseException:
            prefill.cancel()
            raise

    async def _answering(self, picker: Picker, key: str) -> Backend | None:
        """Probe the ``/health`` of each server of ``picker`` passed over for turning requests away
        (not for its role), and, where a server of the kind passes its health checks, of those that
        do not (one may be stalled: a request sent there would wait out the request timeout). The
        first to pass is taken, else one not passed over (as usual; where a server of the kind
        passes its health checks, only such a one), else one passed over for its role (asked
        again: a 502 if it is still wrong), else None. Probes still out when one passes go on in
        the background (``_probe``)."""
        now = time.monotonic()
        some_healthy = any(b.healthy for b in picker.backends)
        probes = {
            self._probe(b): b
            for b in picker.backends
            if not b.wrong_role and (b.down_until > now or (some_healthy and not b.healthy))
        }
        waiting, passed = set(probes), []
        while waiting and not passed:
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            passed = [probes[t] for t in done if _passed(t)]
        if passed:
            return passed[0]
        now = time.monotonic()
        live = [b for b in picker.backends if b.down_until <= now]
        usable = [b for b in live if b.healthy] or ([] if some_healthy else live)
        usable = usable or [b for b in picker.backends if b.wrong_role]
        return picker.pick(key, among=usable) if usable else None

    def _probe(self, b: Backend) -> asyncio.Future:
        """The ``/health`` probe of ``b`` under way, else a new one: requests at once share it (an
        outage does not send a probe per request). Its result counts once, as it ends, unless a
        check, a probe or a role check marked ``b`` since it began."""
        if b.probe is not None and not b.probe.done():
            return b.probe
        marked = b.down_until

        def counted(probe: asyncio.Future) -> None:
            if b.down_until != marked:
                return
            if _passed(probe):
                b.answers()
            else:
                b.pass_over()  # (probed again after)

        b.probe = probe = asyncio.ensure_future(self._passes(b.url, ROLE_CHECK_SECONDS))
        probe.add_done_callback(counted)  # (first: before any request waiting on it reads it)
        self._background.add(probe)
        probe.add_done_callback(self._background.discard)
        return probe

    @staticmethod
    def _refused(retry: bool, exc: BaseException | None, server: Backend, picker: Picker) -> bool:
        """Whether the request may go to another pair: ``server`` refused the connection (so it
        never saw the request) and another server of its kind is up."""
        if not (retry and isinstance(exc, NEVER_SENT)):
            return False
        server.unreachable(exc)
        return picker.any_up()

    @staticmethod
    def _turned_away(retry: bool, status: int, server: Backend, picker: Picker) -> bool:
        """Whether the request may go to another pair: ``server`` answered 503 (it is shutting
        down: it ran nothing of the request) and another server of its kind is up. It is passed
        over for a while either way."""
        if status != 503:
            return False
        server.pass_over()
        return retry and picker.any_up()

    async def _unary(self, path, raw, d: Backend, body, prefill: asyncio.Task, p: Backend, retry: bool) -> Response:
        decode = asyncio.create_task(self.client.post(d.url + path, json=body))
        decode.add_done_callback(_retrieved)  # (cancelled with its request, at a shutdown)
        try:
            while not decode.done():
                await asyncio.wait({decode, prefill} if not prefill.done() else {decode}, timeout=0.05)
                failed = self._prefill_failure(prefill, p)
                if failed is not None and not decode.done():
                    decode.cancel()
                    return self._prefill_failed(prefill, p, d, failed, retry)
                if not decode.done() and await raw.is_disconnected():
                    decode.cancel()
                    prefill.cancel()
                    return Response(status_code=499)
        except BaseException:
            decode.cancel()
            raise
        finally:
            d.in_flight -= 1
        refused = False
        try:
            resp = decode.result()
            answer = Response(resp.content, status_code=resp.status_code, media_type="application/json")
        except httpx.HTTPError as exc:
            if self._refused(retry, exc, d, self.decode):
                prefill.cancel()  # its server must not wait for this pairing
                raise _Refused(d.url) from None
            d.unreachable(exc)
            refused = isinstance(exc, NEVER_SENT)
            answer = self._failed("decode", d, exc)
        if answer.status_code == 200:
            self._finish_in_background(prefill)  # it ends on its own once its KV has landed
            return answer
        if self._turned_away(retry, answer.status_code, d, self.decode):
            prefill.cancel()
            raise _Refused(d.url)
        # the decode half failed. A 4xx is the client's error (the decode server checks more: the
        # whole max_tokens); otherwise a failed (or silent: a 504) prefill half may be the cause,
        # so it gets a moment to say so (not when the decode server refused the connection: it
        # never saw the request, so the prefill half can only wait for it). Either way the
        # prefill half can never hand its KV over, so it is stopped.
        if answer.status_code in (500, 502, 504):  # (a 503, shutting down, is the decode server's own)
            if not refused:
                await asyncio.wait({prefill}, timeout=PREFILL_GRACE_SECONDS)  # (raises nothing of its own)
            if (failed := self._prefill_failure(prefill, p)) is not None:
                return self._prefill_failed(prefill, p, d, failed, retry=False)
        prefill.cancel()
        self._count_failure(d, answer.status_code)
        return answer

    async def _stream(
        self, path, raw: Request, d: Backend, body, prefill: asyncio.Task, p: Backend, retry: bool
    ) -> Response:
        http = self.client
        request = http.build_request("POST", d.url + path, json=body)
        headers = asyncio.ensure_future(http.send(request, stream=True))
        # the decode server answers once the request is admitted; a failed prefill half ends the wait
        failed, gone = None, False
        try:
            while not headers.done():
                waits = {headers} if prefill.done() else {headers, prefill}
                await asyncio.wait(waits, timeout=DISCONNECT_POLL_SECONDS, return_when="FIRST_COMPLETED")
                if headers.done():
                    break
                if (failed := self._prefill_failure(prefill, p)) is not None or (gone := await raw.is_disconnected()):
                    headers.cancel()
                    (late,) = await asyncio.gather(headers, return_exceptions=True)
                    if isinstance(late, httpx.Response):  # (it came while the disconnect was checked)
                        await late.aclose()
                    break
        except BaseException:  # cancelled: no decode request left behind
            headers.cancel()
            self._close_if_answered(headers)
            d.in_flight -= 1
            raise
        if failed is not None or gone:
            d.in_flight -= 1
            if gone:
                prefill.cancel()
                return Response(status_code=499)
            return self._prefill_failed(prefill, p, d, failed, retry)
        try:
            resp = headers.result()
        except httpx.HTTPError as exc:
            d.in_flight -= 1
            prefill.cancel()
            if self._refused(retry, exc, d, self.decode):
                raise _Refused(d.url) from None
            d.unreachable(exc)
            self.failures.labels(server=d.url).inc()
            return self._failed("decode", d, exc)
        if resp.status_code != 200:
            try:
                content = await resp.aread()
                await resp.aclose()
            finally:
                d.in_flight -= 1
                prefill.cancel()
            if self._turned_away(retry, resp.status_code, d, self.decode):
                raise _Refused(d.url)
            self._count_failure(d, resp.status_code)
            return Response(content, status_code=resp.status_code, media_type="application/json")

        # Until the decode server streams output (the KV and the first token have landed) or the
        # prefill half succeeds, a failed prefill half is the cause of whatever the decode server
        # says next, and the answer. The events before (a chat stream's role) are held back, so a
        # rejection is the same error, with its status, as unstreamed, and a refusal is retried.
        # The stream is held until its first output even after the prefill half succeeded: one that
        # ends (or breaks) before any output is answered as unstreamed too, its error event's code
        # (or the decode server's failure) as the status.
        chunks, head, output = resp.aiter_raw().__aiter__(), [], _OutputWatch()
        nxt: asyncio.Future | None = None  # the next piece, asked for and not yet passed on
        handed, prefill_seen = False, False
        try:
            while not output.began:
                if prefill.done() and not prefill_seen:
                    if (failed := self._prefill_failure(prefill, p)) is not None:
                        return self._prefill_failed(prefill, p, d, failed, retry)
                    prefill_seen = True  # its KV is on its way (or the decode server ended the pairing)
                if nxt is not None and nxt.done():  # the stream ended or broke first: the prefill half may say why
                    if not prefill.done():
                        await asyncio.wait({prefill}, timeout=PREFILL_GRACE_SECONDS)
                        if prefill.done():
                            continue
                    if (error := self._ended_early(nxt, head, d)) is not None:
                        prefill.cancel()  # (it can never hand its KV over)
                        return error
                    break
                nxt = nxt or asyncio.ensure_future(chunks.__anext__())
                waits = {nxt} if prefill.done() else {nxt, prefill}
                await asyncio.wait(waits, timeout=DISCONNECT_POLL_SECONDS, return_when="FIRST_COMPLETED")
                if nxt.done():
                    if nxt.exception() is None:
                        head.append(nxt.result())
                        output.feed(head[-1])
                        nxt = None
                elif await raw.is_disconnected():
                    prefill.cancel()
                    return Response(status_code=499)
            handed = True
        finally:
            if not handed:  # failed, refused, the client went away, or cancelled
                try:
                    if nxt is not None:
                        nxt.cancel()
                        nxt.add_done_callback(_retrieved)
                    await resp.aclose()
                finally:
                    d.in_flight -= 1

        closed = False

        async def cleanup() -> None:  # idempotent: the relay's end, or the response's background task
            nonlocal closed
            if not closed:
                closed = True
                await resp.aclose()  # the decode server sees the disconnect and aborts
                d.in_flight -= 1
                self._finish_in_background(prefill)  # (after output it no longer matters)

        async def relay():
            nonlocal nxt
            try:
                for chunk in head:
                    yield chunk
                while True:
                    nxt = nxt or asyncio.ensure_future(chunks.__anext__())
                    # (not ``await nxt``: cancelling the relay, as a client that goes away does, would
                    # cancel the read inside httpcore's close of the connection, and leave it open:
                    # the decode server would never see the disconnect)
                    await asyncio.wait({nxt})
                    try:
                        chunk = nxt.result()
                    except StopAsyncIteration:
                        return
                    except httpx.HTTPError as exc:  # the decode server went away mid-stream, or went silent
                        self.failures.labels(server=d.url).inc()
                        yield _event(self._failed("decode", d, exc))
                        return
                    nxt = None
                    yield chunk
            finally:
                if nxt is not None:
                    nxt.cancel()
                    nxt.add_done_callback(_retrieved)
                await cleanup()

        return StreamingResponse(relay(), media_type="text/event-stream", background=BackgroundTask(cleanup))

    def _ended_early(self, nxt: asyncio.Future, head: list[bytes], d: Backend) -> Response | None:
        """The answer for a decode stream that ended (``nxt`` raised) before any output: its
        failure, or its last error event as an error response; None for a stream that ended
        without an error (its events are passed on)."""
        exc = nxt.exception()
        if isinstance(exc, httpx.HTTPError):
            self.failures.labels(server=d.url).inc()
            return self._failed("decode", d, exc)
        for event in reversed(b"".join(head).split(b"\n\n")):
            body = _event_json(event)
            error = body.get("error") if isinstance(body, dict) else None
            if not isinstance(error, dict):
                continue
            status = error.get("code")
            status = status if isinstance(status, int) and 400 <= status < 600 else 500
            self._count_failure(d, status)
            return Response(json.dumps({"error": error}), status_code=status, media_type="application/json")
        return None

    def _count_failure(self, server: Backend, status: int) -> None:
        """A request answered with ``server``'s error: counted when it is a server error (a 4xx is
        the client's)."""
        if status >= 500:
            self.failures.labels(server=server.url).inc()

    def _failed(self, kind: str, server: Backend, exc: BaseException) -> Response:
        """The answer for a call to the ``kind`` ("prefill" or "decode") server that raised ``exc``:
        a 504 when it sent nothing for the request timeout, else a 502."""
        if isinstance(exc, httpx.ReadTimeout) and self.timeout is not None:
            why = f"sent nothing for {self.timeout:g} s (--request-timeout-secs)"
            return error_response(504, f"the {kind} server {server.url} {why}")
        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            return error_response(504, f"the {kind} server {server.url} timed out: {exc!r}")
        return error_response(502, f"the {kind} server {server.url} failed: {exc!r}")

    def _prefill_failure(self, task: asyncio.Task, p: Backend) -> Response | None:
        """The prefill half's error response, or None if it succeeded (or is not done, or its
        server says the decode server ended the request: a 499, whose cause the decode half tells)."""
        if not task.done() or task.cancelled():
            return None
        if (exc := task.exception()) is not None:
            return self._failed("prefill", p, exc)
        resp = task.result()
        if resp.status_code == 499:  # the decode server ended the pairing: its own answer is the one
            return None
        if resp.status_code != 200:
            return Response(resp.content, status_code=resp.status_code, media_type="application/json")
        # a half its server aborted (it is shutting down) hands no KV over: the decode half cannot go on.
        # (This runs every 50 ms while the decode half runs: the body, which may echo a long prompt, is
        # parsed only when "abort" is in it.)
        aborted = False
        if b'"abort"' in resp.content:
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                aborted = any(c.get("finish_reason") == "abort" for c in resp.json()["choices"])
        if aborted:
            return error_response(503, f"the prefill server {p.url} aborted the request (it may be shutting down)")
        return None

    def _prefill_failed(self, prefill: asyncio.Task, p: Backend, d: Backend, failed: Response, retry: bool) -> Response:
        """``failed``, the prefill half's error, as the answer (its decode half, on ``d``, already
        let go); a server error also names ``d`` (a decode server that never asked for the KV
        fails the prefill half, which cannot tell which server that was). Raises ``_Refused``
        instead when the prefill server refused the connection, or turned the request away
        (503: shutting down), and another is up."""
        exc = prefill.exception()
        if self._refused(retry, exc, p, self.prefill) or self._turned_away(retry, failed.status_code, p, self.prefill):
            raise _Refused(p.url)
        self._count_failure(p, failed.status_code)
        if failed.status_code < 500 or exc is not None:  # (its own error: no KV handshake was the cause)
            return failed
        try:
            error = json.loads(failed.body)["error"]
            message = f"{error['message']} (the request's decode half went to {d.url})"
        except (ValueError, KeyError, TypeError):
            return failed
        return error_response(failed.status_code, message, error.get("param"))

    def _close_if_answered(self, task: asyncio.Future) -> None:
        """Close the streamed response ``task`` ends with, if any (its request was given up)."""

        def done(t: asyncio.Future) -> None:
            if not t.cancelled() and t.exception() is None:
                closing = asyncio.ensure_future(t.result().aclose())
                self._background.add(closing)
                closing.add_done_callback(self._background.discard)

        task.add_done_callback(done)

    def _finish_in_background(self, task: asyncio.Task) -> None:
        """Let the prefill half end on its own (cancelling it would abort a finished transfer)."""
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # errors are logged by the server
        if task.done():
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _passes(self, url: str, timeout: float) -> bool:
        """Whether the server at ``url`` answers its ``/health`` with a 200 within ``timeout``."""
        try:
            return (await self.client.get(url + "/health", timeout=timeout)).status_code == 200
        except httpx.HTTPError:
            return False

    async def check_health(self, pending_only: bool = False) -> None:
        """One round of health checks. A server is pending until it first passes one (it may
        still be loading its model, or be stalled since before the router started): until then
        it is passed over while another of its kind passes. After that, a server that fails
        ``failure_threshold`` in a row is passed over until it passes ``success_threshold`` in a
        row. A server that stalls (stopped, or its event loop stuck) also accepts connections, so
        only its ``/health`` shows that it is gone. ``pending_only``: check the pending ones only."""
        roles = [(b, "prefill") for b in self.prefill.backends] + [(b, "decode") for b in self.decode.backends]
        # each answer counts as it comes (a server that answers nothing holds up no other)
        await asyncio.gather(*(self._check(b, role) for b, role in roles if b.pending or not pending_only))

    async def _check(self, b: Backend, role: str) -> None:
        cfg = self.health_checks
        ok = await self._passes(b.url, cfg.timeout)
        if ok:  # (it answers now: a refusal before this no longer passes it over)
            b.answers()
        if b.pending:  # (no failure of its own to outweigh: one pass is enough)
            if ok:
                b.pending, b.healthy = False, True
                self.healthy.labels(server=b.url).set(1)
                logger.info("the %s server %s passes its first health check", role, b.url)
            return
        b.streak = 0 if ok == b.healthy else b.streak + 1
        if b.streak < (cfg.success_threshold if ok else cfg.failure_threshold):
            return
        b.healthy, b.streak = ok, 0
        self.healthy.labels(server=b.url).set(int(ok))
        if ok:
            logger.warning("the %s server %s passes its health checks again", role, b.url)
        else:
            logger.error(
                "the %s server %s failed %d health checks in a row: passed over until it passes %d",
                role,
                b.url,
                cfg.failure_threshold,
                cfg.success_threshold,
            )

    async def watch_health(self) -> None:
        """``check_health`` every ``interval`` seconds, from now on; in between, every
        ``PENDING_CHECK_SECONDS``, the servers still pending (a server that has loaded its model
        joins within seconds, not at the next round)."""
        interval = self.health_checks.interval
        next_round = time.monotonic()
        while True:
            started = time.monotonic()
            whole = started >= next_round
            if whole:
                next_round = started + interval
            try:
                await self.check_health(pending_only=not whole)
            except Exception:  # (a bug here must not end the checks for good)
                logger.exception("a round of health checks failed")
            wait = next_round - time.monotonic()
            if any(b.pending for b in (*self.prefill.backends, *self.decode.backends)):
                wait = min(wait, started + PENDING_CHECK_SECONDS - time.monotonic())  # (from start to start)
            await asyncio.sleep(max(wait, 0.0))

    async def health(self) -> Response:
        servers = [b.url for b in (*self.prefill.backends, *self.decode.backends)]
        states = await asyncio.gather(*(self._passes(u, 2) for u in servers))
        down = [u for u, up in zip(servers, states, strict=True) if not up]
        if down:
            return error_response(503, f"not healthy: {', '.join(down)}")
        if wrong := await self.wrong_roles():
            return error_response(503, f"misconfigured: {'; '.join(wrong)}")
        return Response(status_code=200)

    async def any_decode(self, path: str, body: bytes | None = None) -> Response:
        """``path`` (a GET; with a ``body``, a POST) answered by the first decode server that
        answers without a 5xx (those not passed over first, of them those that pass their health
        checks): all serve one model and tokenizer.
        A POST goes to the next server only when one refused it, answered a 5xx or sent nothing
        for ``TOKENIZE_SECONDS`` (it has no side effects)."""
        now = time.monotonic()
        order = sorted(self.decode.backends, key=lambda b: (b.down_until > now, not b.healthy))
        errors, answer = [], None
        tokenize = min(TOKENIZE_SECONDS, self.timeout or TOKENIZE_SECONDS)
        limit = httpx.Timeout(5.0) if body is None else httpx.Timeout(tokenize, connect=CONNECT_SECONDS)
        for d in order:
            try:
                if body is None:
                    resp = await self.client.get(d.url + path, timeout=limit)
                else:
                    headers = {"content-type": "application/json"}
                    resp = await self.client.post(d.url + path, content=body, headers=headers, timeout=limit)
            except httpx.HTTPError as exc:
                d.unreachable(exc)
                if isinstance(exc, httpx.ReadTimeout):  # a stalled server: the next one may answer
                    errors.append(f"the decode server {d.url} sent nothing for {limit.read:g} s")
                    continue
                errors.append(f"the decode server {d.url} failed: {exc!r}")
                if body is not None and not isinstance(exc, NEVER_SENT):
                    break  # it had the request
                continue
            answer = Response(resp.content, status_code=resp.status_code, media_type="application/json")
            if resp.status_code < 500:  # a failing server (shutting down: 503) leaves it to the next
                return answer
        return answer or error_response(502, "; ".join(errors))

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        for client in self.clients:
            await client.aclose()


class _Refused(Exception):
    """A server refused a request's connection, or turned it away (503); it goes to another pair
    (the message: the server)."""


class _OutputWatch:
    """Whether a decode server's event stream has carried output yet: a choice with text,
    reasoning or tool calls, or a finish reason (a first token that decodes to nothing). Only the
    events up to the first such one are parsed; a chat stream's opening role events are not
    output."""

    def __init__(self):
        self.began, self._buffer = False, b""

    def feed(self, chunk: bytes) -> None:
        if self.began:
            return
        *events, self._buffer = (self._buffer + chunk).split(b"\n\n")
        self.began = any(_is_output(e) for e in events)
        if self.began:
            self._buffer = b""


def _event_json(event: bytes) -> object:
    """What an event stream's event carries in its data lines, parsed; None for [DONE] or what is
    not JSON."""
    data = b"".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
    try:
        return json.loads(data)
    except ValueError:
        return None


def _is_output(event: bytes) -> bool:
    body = _event_json(event)
    choices = body.get("choices") if isinstance(body, dict) else None  # (an error object has none)
    if not isinstance(choices, list):
        return False
    for c in choices:
        if not isinstance(c, dict):
            continue
        delta = c.get("delta")
        if isinstance(delta, dict):
            text = delta.get("content") or delta.get("tool_calls") or delta.get("reasoning")
        else:
            text = c.get("text")
        if text or c.get("finish_reason") is not None:
            return True
    return False


def _retrieved(future: asyncio.Future) -> None:
    """Take a future's exception, if any: one left unread is logged as never retrieved."""
    if not future.cancelled():
        future.exception()


def _passed(probe: asyncio.Future) -> bool:
    """Whether a ``_probe`` that ended found its server answering."""
    return not probe.cancelled() and probe.exception() is None and probe.result()


def _prefill_ended(task: asyncio.Task, p: Backend) -> None:
    p.in_flight -= 1
    if not task.cancelled():
        p.unreachable(task.exception())


def _event(response: Response) -> bytes:
    """An error response as the last events of a stream (vLLM ends an errored stream the same way)."""
    return b"data: " + bytes(response.body) + b"\n\ndata: [DONE]\n\n"


def build_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        async def check() -> None:  # (servers still starting are checked at their first request)
            for why in await router.wrong_roles():
                logger.error("%s", why)

        checking = asyncio.create_task(check())
        watching = asyncio.create_task(router.watch_health())
        yield
        checking.cancel()
        watching.cancel()
        await router.close()

    app = FastAPI(title="minengine router", docs_url=None, redoc_url=None, lifespan=lifespan)
    openai_errors(app)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await router.forward("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await router.forward("/v1/chat/completions", raw)

    @app.get("/v1/models")
    async def models() -> Response:
        return await router.any_decode("/v1/models")

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        return await router.any_decode("/tokenize", await raw.body())

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        return await router.any_decode("/detokenize", await raw.body())

    @app.get("/version")
    async def version() -> Response:
        return await router.any_decode("/version")

    @app.get("/health")
    async def health() -> Response:
        return await router.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    return app


LIMIT_FLAGS = (  # (flag, default, what it does): SGLang's router's names and defaults
    ("--request-timeout-secs", 1800, "a request fails (504) when a server sends it nothing for this long"),
    ("--health-check-interval-secs", 60, "seconds between rounds of /health checks of every server"),
    ("--health-check-timeout-secs", 5, "a /health check fails when it takes longer"),
    ("--health-failure-threshold", 3, "failed checks in a row that pass a server over"),
    ("--health-success-threshold", 2, "passed checks in a row that take a server back"),
)


def parse_args(argv: list[str] | None = None):
    parser = OneLineParser(prog="python -m minengine.router", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        required=True,
        metavar="URL [BOOTSTRAP_PORT]",
        help="a prefill server and its --disaggregation-bootstrap-port (default 8998); repeatable",
    )
    parser.add_argument("--decode", action="append", required=True, metavar="URL", help="a decode server; repeatable")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    limits = parser.add_argument_group("timeouts and health checks (as SGLang's router's flags)")
    for flag, default, what in LIMIT_FLAGS:
        limits.add_argument(flag, type=int, default=default, metavar="N", help=f"{what} (default {default})")
    limits.add_argument(
        "--shutdown-grace-period-secs",
        type=int,
        default=180,
        metavar="N",
        help="on SIGTERM or Ctrl-C: no new connections, and the requests in flight get this long to end before "
        "they are cut (which aborts them on the servers) (default 180)",
    )
    add_access_flags(parser)
    args = parser.parse_args(argv)
    check_access_flags(parser, args)
    for flag, _, _ in LIMIT_FLAGS:
        if (value := getattr(args, flag[2:].replace("-", "_"))) < 1:
            parser.error(f"argument {flag}: {value}; allowed: an integer >= 1")
    if args.shutdown_grace_period_secs < 0:
        parser.error(
            f"argument --shutdown-grace-period-secs: {args.shutdown_grace_period_secs}; allowed: an integer >= 0"
        )
    prefills = []
    for spec in args.prefill:
        if len(spec) > 2:
            given = " ".join(spec)
            parser.error(f"argument --prefill: {given!r} has {len(spec)} values; allowed: URL [BOOTSTRAP_PORT]")
        port = 8998
        if len(spec) == 2:
            if not spec[1].isdigit() or not 1 <= int(spec[1]) <= 65535:
                parser.error(f"argument --prefill: bootstrap port {spec[1]!r}; allowed: 1..65535")
            port = int(spec[1])
        prefills.append(Backend(_url(parser, "--prefill", spec[0]), port))
    decodes = [Backend(_url(parser, "--decode", u)) for u in args.decode]
    if not 1 <= args.port <= 65535:
        parser.error(f"argument --port: {args.port} is out of range; allowed: 1..65535")
    return args, prefills, decodes


def _url(parser: argparse.ArgumentParser, flag: str, url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        parser.error(f"argument {flag}: {url!r} is not an http(s) URL")
    return url.rstrip("/")


def main(argv: list[str] | None = None) -> int:
    args, prefills, decodes = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (a line per upstream call and health check)
    checks = HealthChecks(
        args.health_check_interval_secs,
        args.health_check_timeout_secs,
        args.health_failure_threshold,
        args.health_success_threshold,
    )
    router = Router(prefills, decodes, args.request_timeout_secs, args.api_key, checks)
    logger.info(
        "routing http://%s:%d to prefill %s and decode %s",
        args.host,
        args.port,
        [p.url for p in prefills],
        [d.url for d in decodes],
    )
    app = build_app(router)
    add_access_control(app, args)
    grace = args.shutdown_grace_period_secs
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=grace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
