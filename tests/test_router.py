"""Prefill server + decode server + router as real processes on CPU, KV over NIXL (host memory),
checked against a single server with the same checkpoint."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from checkpoints import build_checkpoint
from test_server import free_port, metrics, start_server, stop_server, wait_for

pytest.importorskip("nixl")
PS = 4
GREEDY = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


def start_router(*flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "minengine.router", "--port", str(port), "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    assert wait_for(lambda: _up(url, proc), timeout=60), "router did not start"
    return proc, url


def _up(url: str, proc: subprocess.Popen) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"router exited: {proc.stdout.read()}")
    try:
        httpx.get(url + "/metrics", timeout=1)
        return True
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ckpt = str(build_checkpoint(tmp_path_factory.mktemp("ck") / "qwen3", "qwen3"))
    boot = free_port()
    common = ["--model", ckpt, "--device", "cpu", "--page-size", str(PS), "--disaggregation-bootstrap-timeout", "3"]
    tools = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # (the decode server's to use)
    procs = []
    try:
        single, single_url = start_server(*common[:6], "--disable-radix-cache", *tools)
        procs.append(single)
        prefill, prefill_url = start_server(
            *common,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(boot),
            "--max-total-tokens",
            "256",
        )
        procs.append(prefill)
        decode, decode_url = start_server(
            *common, "--disaggregation-mode", "decode", "--disaggregation-decode-enable-radix-cache", *tools
        )
        procs.append(decode)
        router, router_url = start_router("--prefill", prefill_url, str(boot), "--decode", decode_url)
        procs.append(router)
        yield {
            "single": single_url,
            "prefill": prefill_url,
            "boot": boot,
            "decode": decode_url,
            "router": router_url,
            "decode_flags": [*common, "--disaggregation-mode", "decode"],
        }
    finally:
        for proc in procs:
            stop_server(proc)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def idle(*urls: str) -> bool:
    return all(metrics(u).get("minengine:kv_pages_in_use") == 0 for u in urls)


@pytest.mark.parametrize(("grace", "ending"), [(0, None), (60, "length")])
def test_sigterm_gives_streams_in_flight_the_grace_period_then_cuts_them(cluster, grace, ending):
    """As SGLang's router's --shutdown-grace-period-secs: after SIGTERM the router waits that long
    for the streams in flight (one of about 2 s ends with 60, and the router exits then, not at the
    end of the period), then cuts them and exits (it used to wait for every stream, however long);
    the servers see a cut as a disconnect and free the request's KV."""
    import signal

    proc, url = start_router(
        "--prefill", cluster["prefill"], str(cluster["boot"]), "--decode", cluster["decode"],
        "--shutdown-grace-period-secs", str(grace),
    )  # fmt: skip
    lines: list[str] = []
    flowing = threading.Event()

    def stream() -> None:
        body = {"prompt": "a long answer", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with (
            contextlib.suppress(httpx.HTTPError),
            httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    lines.append(line)
                    flowing.set()

    reader = threading.Thread(target=stream)
    try:
        reader.start()
        assert flowing.wait(60)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        proc.wait(30)  # (uvicorn raises the signal again once shut down: exit code -15)
        assert time.monotonic() - signalled < 20
        reader.join(10)
        assert not reader.is_alive()
        assert json.loads(lines[-1][6:])["choices"][0]["finish_reason"] == ending  # cut (None), or finished
        assert wait_for(lambda: idle(cluster["prefill"], cluster["decode"]), 30)
    finally:
        stop_server(proc)


def test_multi_turn_chat_through_the_router_equals_one_server(cluster):
    """Three turns of a conversation; from turn 2 on, the decode server holds the conversation
    so far in its radix cache and receives only the new pages."""
    via, ref = client(cluster["router"]), client(cluster["single"])
    model = ref.models.list().data[0].id
    assert [m.id for m in via.models.list().data] == [model]
    messages = [{"role": "user", "content": "Paged attention keeps the KV cache in pages."}]
    before, prev_prompt = metrics(cluster["decode"]), 0
    for turn in range(3):
        got = via.chat.completions.create(model=model, messages=messages, **GREEDY)
        want = ref.chat.completions.create(model=model, messages=messages, **GREEDY)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage.completion_tokens == 8
        after = metrics(cluster["decode"])
        moved = after["minengine:kv_transfer_pages_total"] - before["minengine:kv_transfer_pages_total"]
        cached = got.usage.prompt_tokens_details.cached_tokens
        assert moved == -(-got.usage.prompt_tokens // PS) - cached // PS
        if turn:
            # at least the previous prompt's whole pages (the reply is re-tokenized by the template)
            assert cached >= PS * (prev_prompt // PS) > 0
        before, prev_prompt = after, got.usage.prompt_tokens
        messages += [{"role": "assistant", "content": got.choices[0].message.content}]
        messages += [{"role": "user", "content": f"And turn {turn + 2}?"}]
    streamed = via.chat.completions.create(model=model, messages=messages, stream=True, **GREEDY)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == ref.chat.completions.create(model=model, messages=messages, **GREEDY).choices[0].message.content
    # vLLM's chat template fields reach both halves: the answer goes on with the last message
    extra = {"ignore_eos": True, "continue_final_message": True, "echo": True}
    partial = [*messages, {"role": "assistant", "content": "The"}]
    kwargs = dict(model=model, messages=partial, temperature=0, max_tokens=8, extra_body=extra)
    got = via.chat.completions.create(**kwargs, extra_headers={"X-Request-Id": "through-the-router"})
    assert got.id == "chatcmpl-through-the-router"
    assert got.choices[0].message.content.startswith("The") and got.usage.completion_tokens == 8
    assert got.choices[0].message.content == ref.chat.completions.create(**kwargs).choices[0].message.content
    streamed = via.chat.completions.create(**kwargs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == got.choices[0].message.content
    # tools: the prefill server, started without the tool flags, checks only tool_choice; the
    # decode server finds the calls (the random model writes none: its text is the answer)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    kwargs = dict(model=model, messages=messages, tools=[weather], **GREEDY)
    got = via.chat.completions.create(**kwargs)
    assert got.choices[0].message.content == ref.chat.completions.create(**kwargs).choices[0].message.content
    streamed = via.chat.completions.create(**kwargs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == got.choices[0].message.content
    # forced calls: the prefill server samples the first token under the grammar, the decode
    # server the rest (its grammar takes that first token first): as one server
    forced = kwargs | {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 24}
    got = via.chat.completions.create(**forced).choices[0].message
    want = ref.chat.completions.create(**forced).choices[0].message
    assert (got.content, got.tool_calls and got.tool_calls[0].function.arguments) == (
        want.content,
        want.tool_calls and want.tool_calls[0].function.arguments,
    )
    assert (got.content or got.tool_calls[0].function.arguments).startswith("{")
    # /tokenize, /detokenize and /version: a decode server's answer
    for path in ("/tokenize", "/detokenize"):
        body = {"prompt": "hi"} if path == "/tokenize" else {"tokens": [1, 2]}
        got, want = (httpx.post(cluster[k] + path, json=body) for k in ("router", "decode"))
        assert got.status_code == 200 and got.json() == want.json()
    assert httpx.get(cluster["router"] + "/version").json() == httpx.get(cluster["single"] + "/version").json()
    m = metrics(cluster["decode"])
    assert m["minengine:kv_transfer_bytes_total"] > 0 and m["minengine:kv_transfer_seconds_count"] >= 4
    assert metrics(cluster["prefill"])["minengine:kv_transfer_pages_sent_total"] > 0
    assert "minengine_router:requests_total" in httpx.get(cluster["router"] + "/metrics").text
    assert httpx.get(cluster["router"] + "/health").status_code == 200
    assert wait_for(lambda: idle(cluster["prefill"], cluster["decode"]))


def test_completions_and_concurrency_through_the_router(cluster):
    via, ref = client(cluster["router"]), client(cluster["single"])
    prompts = [f"request {i}: the quick brown fox" for i in range(6)]
    results = [None] * len(prompts)
    # the model name is checked by both servers
    with pytest.raises(openai.NotFoundError):
        via.completions.create(model="x", prompt="hi", max_tokens=2)
    model = ref.models.list().data[0].id

    def run_ok(i):
        results[i] = via.completions.create(model=model, prompt=prompts[i], **GREEDY).choices[0].text

    threads = [threading.Thread(target=run_ok, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [ref.completions.create(model=model, prompt=p, **GREEDY).choices[0].text for p in prompts]
    assert wait_for(lambda: idle(cluster["prefill"], cluster["decode"]))


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_prefill_rejection_through_the_router(cluster, stream, chat):
    """The prefill server (256 KV tokens) cannot take this prompt; the decode server can. The
    client gets the prefill server's 400 streamed or not (a stream is held back until it has
    output), and its message counts the one token the prefill server computes, not max_tokens."""
    via = client(cluster["router"])
    model = via.models.list().data[0].id
    for _ in range(3):  # (the decode server admits the stream at once: the race went either way)
        with pytest.raises(openai.BadRequestError, match="KV cache capacity") as err:
            if chat:
                messages = [{"role": "user", "content": "word " * 56}]
                via.chat.completions.create(model=model, messages=messages, max_tokens=4, stream=stream)
            else:
                via.completions.create(model=model, prompt=list(range(5, 305)), max_tokens=4, stream=stream)
        message = err.value.body["message"]
        assert "first output token (this prefill server's part)" in message and "max_tokens" not in message
    assert wait_for(lambda: idle(cluster["prefill"], cluster["decode"]))


def test_decode_side_rejection_through_the_router(cluster):
    """max_tokens past the context: only the decode server checks it; its 400 is the answer and
    the prefill half is stopped."""
    via = client(cluster["router"])
    model = via.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="exceeds the context length"):
        via.completions.create(model=model, prompt="hello", max_tokens=10**6)
    assert wait_for(lambda: idle(cluster["prefill"], cluster["decode"]))
    # the halves by hand: the prefill half ends 499, the decode server's abort (not a 500 in its log)
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": cluster["boot"], "bootstrap_room": 7}
    body = {"model": model, "prompt": "hello", "max_tokens": 10**6, **boot}
    prefill, url = [], cluster["prefill"] + "/v1/completions"
    thread = threading.Thread(target=lambda: prefill.append(httpx.post(url, json=body, timeout=30)))
    thread.start()
    time.sleep(0.5)
    assert httpx.post(cluster["decode"] + "/v1/completions", json=body).status_code == 400
    thread.join()
    assert prefill[0].status_code == 499 and "aborted by the decode server" in prefill[0].text
    assert wait_for(lambda: idle(cluster["prefill"], cluster["decode"]))


def test_logprobs_are_refused_with_disaggregation(cluster):
    """The prefill server samples the first token, so the decode server cannot report its
    logprobs: a 400 that names the field, and both halves let go."""
    via = client(cluster["router"])
    model = via.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="logprobs is requested on a .* server") as err:
        via.completions.create(model=model, prompt="hello", max_tokens=4, logprobs=1)
    assert err.value.body["param"] == "logprobs"
    assert wait_for(lambda: idle(cluster["prefill"], cluster["decode"]))


def test_client_disconnect_mid_stream_frees_both_sides(cluster):
    model = client(cluster["single"]).models.list().data[0].id
    body = {"model": model, "prompt": "a long story", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", cluster["router"] + "/v1/completions", json=body, timeout=60) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i > 6:
                break
    assert wait_for(lambda: idle(cluster["prefill"], cluster["decode"]), timeout=20)


def test_servers_reject_requests_without_a_pairing(cluster):
    r = httpx.post(cluster["decode"] + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and "bootstrap_room is required" in r.json()["error"]["message"]
    r = httpx.post(cluster["single"] + "/v1/completions", json={"prompt": "hi", "bootstrap_room": 3})
    assert r.status_code == 400 and "only accepted by a server in --disaggregation-mode" in r.json()["error"]["message"]
    body = {"prompt": "hi", "bootstrap_room": 3, "bootstrap_port": 70000, "bootstrap_host": "h"}
    r = httpx.post(cluster["decode"] + "/v1/completions", json=body)
    assert r.status_code == 400 and "bootstrap_port is 70000; allowed: 1..65535" in r.json()["error"]["message"]


@pytest.mark.parametrize("mistake", ["swapped", "single as decode", "bootstrap port"])
def test_a_router_over_misconfigured_servers_says_so_at_once(cluster, mistake):
    """A server in the wrong role, or a prefill server given with another bootstrap port than
    its own, would leave every request waiting out a bootstrap timeout: the router asks each
    server's /server_info first, and answers 502 naming the server and the fix."""
    prefill, port, decode = cluster["prefill"], str(cluster["boot"]), cluster["decode"]
    flags, message = {
        "swapped": (
            ("--prefill", decode, port, "--decode", prefill),
            f"{decode} is a decode server (--disaggregation-mode decode), but the router has it as a prefill server",
        ),
        "single as decode": (
            ("--prefill", prefill, port, "--decode", cluster["single"]),
            f"{cluster['single']} is not a disaggregated server (--disaggregation-mode null), but the router",
        ),
        "bootstrap port": (
            ("--prefill", prefill, "1", "--decode", decode),
            f"has --disaggregation-bootstrap-port {port}, but the router was given 1: "
            f"give it as --prefill {prefill} {port}",
        ),
    }[mistake]
    info = httpx.get(prefill + "/server_info").json()
    assert info["disaggregation_mode"] == "prefill" and info["disaggregation_bootstrap_port"] == cluster["boot"]
    assert httpx.get(decode + "/server_info").json()["disaggregation_bootstrap_port"] is None
    proc, url = start_router(*flags)
    try:
        start = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 502 and message in r.json()["error"]["message"], r.text
        assert time.monotonic() - start < 2
        r = httpx.get(url + "/health", timeout=30)
        assert r.status_code == 503 and message in r.json()["error"]["message"]
    finally:
        stop_server(proc)
    assert message in proc.stdout.read()  # (logged at start too)
    assert idle(prefill, decode)


def test_dead_prefill_server(cluster):
    """A router whose prefill server is gone answers with an error at once, and the decode
    server frees the request's KV (its prefill peer never answers)."""
    dead = f"http://127.0.0.1:{free_port()}"
    proc, url = start_router("--prefill", dead, str(free_port()), "--decode", cluster["decode"])
    try:
        model = client(cluster["single"]).models.list().data[0].id
        start = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4}, timeout=30)
        assert r.status_code == 502 and "prefill server" in r.json()["error"]["message"]
        assert time.monotonic() - start < 10
        # streaming: the prefill error, not after the decode timeout (a 502 before the stream starts)
        start, body = time.monotonic(), {"model": model, "prompt": "hello", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
            text = resp.read().decode()  # a 502 before the stream starts, or an error event in it
        assert "prefill server" in text and '"error"' in text
        assert time.monotonic() - start < 10
        assert httpx.get(url + "/health").status_code == 503
        assert wait_for(lambda: idle(cluster["decode"]), timeout=20)
    finally:
        stop_server(proc)


def test_a_dead_prefill_server_beside_a_live_one_fails_no_request(cluster):
    """Real processes. A server that never came up never passes a health check, so it gets no
    requests. One that passed its checks and then died is tried (round robin), refuses, and the
    request goes to the live pair: every request is answered."""
    never = f"http://127.0.0.1:{free_port()}"
    boot = free_port()
    gone, gone_url = start_server(
        *cluster["decode_flags"][:-2], "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot)
    )
    live = ["--prefill", cluster["prefill"], str(cluster["boot"])]
    proc, url = start_router(
        "--prefill", never, str(free_port()), "--prefill", gone_url, str(boot), *live, "--decode", cluster["decode"]
    )
    try:
        healthy = f'minengine_router:server_healthy{{server="{gone_url}"}} 1.0'
        assert wait_for(lambda: healthy in httpx.get(url + "/metrics").text, 20)
        stop_server(gone)
        via, ref = client(url), client(cluster["single"])
        model = ref.models.list().data[0].id
        prompts = [f"retry {i}: the quick brown fox" for i in range(3)]
        got = [via.completions.create(model=model, prompt=p, **GREEDY).choices[0].text for p in prompts[:2]]
        stream = via.completions.create(model=model, prompt=prompts[2], stream=True, **GREEDY)
        got.append("".join(c.choices[0].text for c in stream if c.choices))
        assert got == [ref.completions.create(model=model, prompt=p, **GREEDY).choices[0].text for p in prompts]
        # once, unless a request came over 5 s after the refusal (a slow machine): at most once each
        text = httpx.get(url + "/metrics").text

        def retries(server: str) -> float:
            line = f'minengine_router:retries_total{{server="{server}"}} '
            return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))

        assert 1 <= retries(gone_url) <= len(prompts) and retries(never) == 0
        assert f'minengine_router:server_healthy{{server="{never}"}} 0.0' in text
        assert wait_for(lambda: idle(cluster["prefill"], cluster["decode"]))
    finally:
        stop_server(proc)
        stop_server(gone)


def test_a_stopped_decode_server_times_out_its_request_and_is_passed_over(cluster):
    """Real processes: a decode server stopped (SIGSTOP: it still accepts connections) holds its
    request only for the prefill server's bootstrap timeout (3 s here; or --request-timeout-secs,
    5 s), whose error names it; after its failed health checks the router sends every request to
    the other decode server; once it runs again, it frees the request's KV."""
    import signal

    extra, extra_url = start_server(*cluster["decode_flags"])
    checks = [
        "--health-check-interval-secs",
        "1",
        "--health-failure-threshold",
        "2",
        "--health-check-timeout-secs",
        "1",
    ]
    pair = ["--prefill", cluster["prefill"], str(cluster["boot"]), "--decode", cluster["decode"], "--decode", extra_url]
    proc, url = start_router(*pair, "--request-timeout-secs", "5", "--health-check-timeout-secs", "1", *checks)
    try:
        model = client(cluster["single"]).models.list().data[0].id
        extra.send_signal(signal.SIGSTOP)
        start, answers = time.monotonic(), []

        def ask(i: int) -> None:
            body = {"model": model, "prompt": f"stopped {i}: the quick brown fox", "max_tokens": 4}
            answers.append(httpx.post(url + "/v1/completions", json=body, timeout=60))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]  # (one to each decode server)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(r.status_code for r in answers)[0] == 200 and time.monotonic() - start < 10
        failed = [r for r in answers if r.status_code != 200]
        assert len(failed) == 1 and failed[0].status_code in (500, 504), failed[0].text
        assert extra_url in failed[0].json()["error"]["message"]
        assert wait_for(lambda: f'server_healthy{{server="{extra_url}"}} 0.0' in httpx.get(url + "/metrics").text, 10)
        for i in range(4):
            ask(10 + i)
        assert [r.status_code for r in answers[2:]] == [200] * 4
        extra.send_signal(signal.SIGCONT)
        assert wait_for(lambda: idle(cluster["prefill"], cluster["decode"], extra_url), timeout=20)
    finally:
        extra.send_signal(signal.SIGCONT)
        stop_server(proc)
        stop_server(extra)


def test_router_flags_fail_in_one_line():
    for args, needle in [
        (["--decode", "http://x:1"], "--prefill"),
        (["--prefill", "http://x:1", "99999", "--decode", "http://x:2"], "bootstrap port '99999'"),
        (["--prefill", "ftp://x", "--decode", "http://x:2"], "not an http(s) URL"),
        (["--prefill", "http://x:1", "--decode", "http://x:2", "--request-timeout-secs", "0"], "allowed: an integer"),
        (["--prefill", "http://x:1", "--decode", "http://x:2", "--health-failure-threshold", "-1"], "integer >= 1"),
        (["--prefill", "http://x:1", "--decode", "http://x:2", "--shutdown-grace-period-secs", "-1"], "integer >= 0"),
    ]:
        out = subprocess.run([sys.executable, "-m", "minengine.router", *args], capture_output=True, text=True)
        assert out.returncode == 2 and needle in out.stderr and len(out.stderr.strip().splitlines()) <= 2, out.stderr


def test_prefix_aware_picking():
    from minengine.router import IMBALANCE, Backend, Picker, routing_key

    picker = Picker([Backend("http://a"), Backend("http://b")])
    system = "You are a careful assistant. " * 4
    convo = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "first question"}]}
    first = picker.pick(routing_key(convo))
    first.in_flight += 1
    other = picker.pick("an unrelated prompt " * 8)
    assert other is not first  # no shared prefix: the least busy
    later = dict(convo, messages=convo["messages"] + [{"role": "assistant", "content": "answer"}])
    assert picker.pick(routing_key(later)) is first  # the same conversation, the same server
    first.in_flight += IMBALANCE + 1
    assert picker.pick(routing_key(later)) is other  # unless that server is far busier
    assert routing_key({"prompt": [1, 2]}) == "[1, 2]"


def test_a_conversations_next_turn_follows_it_whatever_its_answers_length():
    """A turn whose prompt holds the whole previous one follows it to its server, though the answer
    and the new question outweigh the history (under CACHE_THRESHOLD of the blocks matched)."""
    from minengine.router import CACHE_THRESHOLD, Backend, Picker, prefix_chain, routing_key

    picker = Picker([Backend("http://a"), Backend("http://b")])
    messages = [{"role": "user", "content": "What does paged attention keep in its pages, and why?"}]
    first = picker.pick(routing_key({"messages": messages}))
    for turn in range(3):
        first.in_flight += 1  # (busier than the other, within IMBALANCE)
        messages += [{"role": "assistant", "content": f"answer {turn}: " + "x" * 400}]
        messages += [{"role": "user", "content": f"question {turn + 1}: " + "y" * 60}]
        key = routing_key({"messages": messages})
        if turn == 0:
            history = routing_key({"messages": messages[:1]})
            assert len(prefix_chain(history)) <= CACHE_THRESHOLD * len(prefix_chain(key))
        assert picker.pick(key) is first, turn


def test_a_short_shared_opening_does_not_pin_the_requests_to_one_server():
    """A match counts only over CACHE_THRESHOLD of a prompt's blocks (as SGLang's router's
    cache_threshold): prompts that share an instruction of a block or two, then differ, spread by
    load; one that shares most of its text with an earlier one follows it."""
    import random

    from minengine.router import BLOCK_CHARS, CACHE_THRESHOLD, Backend, Picker, prefix_chain

    picker = Picker([Backend("http://a"), Backend("http://b")])
    rng = random.Random(0)
    prompts = ["Answer briefly: " + "".join(rng.choices("abcdefgh ", k=300)) for _ in range(8)]
    picked = []
    for prompt in prompts:
        picked.append(picker.pick(prompt))
        picked[-1].in_flight += 1
    assert {b.url for b in picked} == {"http://a", "http://b"}
    assert [b.url for b in picked].count("http://a") == 4
    # past the threshold: the same server, busier or not (within IMBALANCE)
    blocks = len(prefix_chain(prompts[0]))
    shared = prompts[0][: (int(CACHE_THRESHOLD * blocks) + 1) * BLOCK_CHARS]
    follower = shared + "".join(rng.choices("xyz", k=len(prompts[0]) - len(shared)))
    assert len(prefix_chain(follower)) == blocks
    assert picker.pick(follower) is picked[0]
    # at it: by load
    half = prompts[1][: int(CACHE_THRESHOLD * blocks) * BLOCK_CHARS]
    other = half + "".join(rng.choices("xyz", k=len(prompts[1]) - len(half)))
    picked[1].in_flight += 1
    assert picker.pick(other) is not picked[1]


def test_a_huge_prompt_does_not_flush_the_routing_table():
    """Only a prompt's first MAX_KEY_BLOCKS blocks decide its route: a huge prompt takes no
    longer to pick for, and leaves the other prompts' prefixes in the table."""
    from minengine.router import MAX_KEY_BLOCKS, MAX_PREFIXES, Backend, Picker, prefix_chain

    picker = Picker([Backend("http://a"), Backend("http://b")])
    convo = "a conversation's system prompt " * 20
    first = picker.pick(convo)
    huge = "z" * (16 * MAX_PREFIXES + 100)
    assert len(prefix_chain(huge)) == MAX_KEY_BLOCKS
    for i in range(2):  # (one to each server)
        picker.pick(f"{i}{huge}")
    assert picker.pick(convo + "the next turn") is first


def test_a_server_that_refuses_connections_is_passed_over():
    """A dead server fails fast, so by load alone it would get most requests: a connection error
    takes it out of picking for a while, unless every server is down."""
    from minengine.router import Backend, Picker, routing_key

    a, b = Backend("http://a"), Backend("http://b")
    picker = Picker([a, b])
    a.unreachable(httpx.ReadTimeout("slow"))  # not a refusal: still picked
    assert {picker.pick("x").url for _ in range(4)} == {"http://a", "http://b"}
    a.unreachable(httpx.ConnectError("refused"))
    assert all(picker.pick(f"prompt {i}" * 9) is b for i in range(6))
    b.unreachable(httpx.ConnectError("refused"))
    assert picker.pick("y") in (a, b)  # all down: still answer (with their error)
    assert routing_key({"messages": 5}) == ""  # a body the server rejects is routed, not a 500


def _no_server_info(handler):
    """``handler`` behind servers without /server_info (a 404: the router checks no roles)."""

    async def handle(request):
        if request.url.path == "/server_info":
            return httpx.Response(404, json={"error": {"message": "Not Found", "code": 404}})
        answer = handler(request)
        return await answer if inspect.isawaitable(answer) else answer

    return handle


def test_server_roles_are_asked_once_and_again_after_a_refusal():
    """The router asks each server's /server_info before its first request, not after; a wrong
    role is a 502 naming it; one that was right is asked again only once it refused a connection
    (it may have come back with other flags); a server that cannot answer is used as is."""
    import asyncio

    from minengine.router import Backend, Router, build_app

    asked, posts = [], []
    modes = {"p": ("prefill", 1), "d": ("decode", None)}

    async def handler(request):
        host = request.url.host
        if request.url.path == "/server_info":
            asked.append(host)
            if modes[host] is None:
                raise httpx.ReadTimeout("no answer")
            mode, port = modes[host]
            return httpx.Response(200, json={"disaggregation_mode": mode, "disaggregation_bootstrap_port": port})
        if request.url.path == "/health":  # (a probe of a server passed over: it answers)
            return httpx.Response(200)
        posts.append(host)
        if host == "d" and len(posts) == 6:
            raise httpx.ConnectError("connection refused")
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]})

    async def run(expect: int) -> str:
        r = await http.post("/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == expect, r.text
        return r.json()["error"]["message"] if expect != 200 else ""

    async def main():
        await run(200)
        await run(200)
        assert sorted(asked) == ["d", "p"] and posts == ["p", "d", "p", "d"]
        await run(502)  # the decode server refused: a 502 (one pair), and it is asked again
        modes["d"] = ("prefill", 7)
        assert "http://d is a prefill server (--disaggregation-mode prefill), but the router has it" in await run(502)
        assert posts == ["p", "d", "p", "d", "p", "d"]  # (nothing sent to either half)
        modes["d"] = None  # cannot tell: used as is
        await run(200)
        assert sorted(asked) == ["d", "d", "d", "p"]

    router = Router([Backend("http://p", 1)], [Backend("http://d")])
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(router)), base_url="http://router")
    asyncio.run(main())


def test_a_server_in_the_wrong_role_is_passed_over_for_a_right_one():
    """With another server of its kind up, a request the router would pair with a misconfigured
    server goes to another pair (nothing was sent), and the misconfigured one is passed over, also
    by requests whose prefix it has seen; /health still names it."""
    import asyncio

    from minengine.router import Backend, Router, build_app

    posts = []

    async def handler(request):
        host = request.url.host
        if request.url.path == "/server_info":
            mode = {"p1": "decode", "p2": "prefill", "d": "decode"}[host]
            port = {"p1": None, "p2": 2, "d": None}[host]
            return httpx.Response(200, json={"disaggregation_mode": mode, "disaggregation_bootstrap_port": port})
        if request.url.path == "/health":
            return httpx.Response(200)
        posts.append(host)
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]})

    async def main():
        shared = "You are a helpful assistant. " * 4
        for i in range(10):
            r = await http.post("/v1/completions", json={"prompt": shared + str(i)}, timeout=10)
            assert r.status_code == 200, r.text
        r = await http.get("/health")
        assert r.status_code == 503 and "http://p1 is a decode server" in r.json()["error"]["message"]

    router = Router([Backend("http://p1", 1), Backend("http://p2", 2)], [Backend("http://d")])
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(router)), base_url="http://router")
    asyncio.run(main())
    assert "p1" not in posts and posts.count("p2") == 10
    assert _retries(router) == {"http://p1": 1.0}


def _one_pair_router(handler):
    """A router over fake servers (``handler`` answers both), a prefill at p and a decode at d,
    and a client of its app."""
    from minengine.router import Backend, Router, build_app

    router = Router([Backend("http://p", 1)], [Backend("http://d")])
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(_no_server_info(handler)))
    return router, httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(router)), base_url="http://router")


def _router_app(handler):
    return _one_pair_router(handler)[1]


def _routed_post(handler, body: dict, path: str = "/v1/completions"):
    """A request through a one-pair router over ``handler``: the router, the response and the
    seconds it took."""
    import asyncio

    async def run():
        router, http = _one_pair_router(handler)
        async with http:
            start = time.monotonic()
            r = await http.post(path, json=body, timeout=30)
            return router, r, time.monotonic() - start

    return asyncio.run(run())


def _timed_post(handler, body: dict) -> tuple[httpx.Response, float]:
    """A completion through a one-pair router over ``handler``, and the seconds it took."""
    return _routed_post(handler, body)[1:]


def test_a_decode_server_dying_mid_stream_ends_the_stream_with_an_error():
    import asyncio

    async def handler(request):
        if request.url.host == "p":
            await asyncio.sleep(0.2)
            return httpx.Response(200, json={"choices": []})

        async def body():
            yield b'data: {"choices": [{"text": "a"}]}\n\n'
            raise httpx.RemoteProtocolError("peer closed connection")

        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    async def run():
        async with _router_app(handler) as http:
            r = await http.post("/v1/completions", json={"prompt": "x", "stream": True}, timeout=10)
            return r.text

    text = asyncio.run(run())
    events = [line for line in text.splitlines() if line.startswith("data: ")]
    assert events[0].startswith('data: {"choices"') and "decode server http://d failed" in events[-2]
    assert events[-1] == "data: [DONE]"


def test_a_silent_decode_server_does_not_hold_a_stream_whose_prefill_failed():
    import asyncio

    async def handler(request):
        if request.url.host == "p":
            return httpx.Response(500, json={"error": {"message": "the prefill half failed", "code": 500}})
        await asyncio.sleep(60)  # accepts, never answers

    r, seconds = _timed_post(handler, {"prompt": "x", "stream": True})
    assert r.status_code == 500 and "prefill half failed" in r.text and seconds < 5


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("prefill_error", ["died", 500])
def test_a_prefill_half_failing_after_the_output_began_does_not_cut_the_stream(chat, prefill_error):
    """Once the decode server streams output, the KV and the first token have landed: a prefill
    half that fails afterwards (its server died before answering) is no cause to end the stream.
    Before output (a chat stream's role event only), the prefill's error still ends it."""
    import asyncio

    role = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'

    def piece(text: str, finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
        return b"data: " + json.dumps({"choices": [choice | {"finish_reason": finish}]}).encode() + b"\n\n"

    async def handler(request):
        if request.url.host == "p":
            await asyncio.sleep(0.3)
            if prefill_error == "died":
                raise httpx.RemoteProtocolError("server disconnected without sending a response")
            return httpx.Response(500, json={"error": {"message": "the prefill half failed", "code": 500}})

        async def events():
            if chat:
                yield role
            event = piece("a")  # split mid-event: the watch joins the parts
            yield event[:20]
            yield event[20:]
            await asyncio.sleep(0.6)  # the prefill half fails meanwhile
            yield piece("b", "length") + b"data: [DONE]\n\n"

        return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})

    async def run():
        router, http = _one_pair_router(handler)
        async with http:
            r = await http.post("/v1/" + ("chat/completions" if chat else "completions"), json=body, timeout=10)
        return router, r

    body = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    body["stream"] = True
    router, r = asyncio.run(run())
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and "error" not in r.text, r.text
    assert events[-1] == "data: [DONE]" and [
        json.loads(e[6:])["choices"][0].get("finish_reason") for e in events[-3:-1]
    ] == [None, "length"]
    assert _failures(router) == {}


def _failures(router) -> dict[str, float]:
    return _counter(router, "failures")


def _role_then(then, role: bool = True):
    """A decode server's chat stream: its role event, then ``then()``'s events."""

    async def events():
        if role:
            yield b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
        async for event in then():
            yield event

    return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})


@pytest.mark.parametrize("status", [400, 503])
def test_a_prefill_half_failing_before_the_output_is_a_streams_whole_answer(status):
    """The decode server's headers and a chat stream's role event come before the prefill half
    fails (a 400: it rejected the request): they are held back, and the client gets the same error
    and status as unstreamed, at once. A server error also names the decode server."""
    import asyncio

    async def handler(request):
        if request.url.host == "p":
            await asyncio.sleep(0.2)
            return httpx.Response(status, json={"error": {"message": "the prefill half failed", "code": status}})

        async def then():
            await asyncio.sleep(60)  # waits for KV that never comes
            yield b"data: [DONE]\n\n"

        return _role_then(then)

    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    router, r, seconds = _routed_post(handler, body, "/v1/chat/completions")
    assert r.status_code == status and seconds < 5, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("the prefill half failed") and ("went to http://d" in message) == (status >= 500)
    assert _failures(router) == ({"http://p": 1.0} if status >= 500 else {})  # (a 400 is the client's)


def test_a_stream_that_ends_before_output_waits_a_moment_for_the_prefill_halfs_error():
    """A decode stream that ends with an error event before any output, while the prefill half is
    still running: the prefill half's error, if it comes within the grace, is the answer."""
    import asyncio

    async def handler(request):
        if request.url.host == "p":
            await asyncio.sleep(0.5)
            return httpx.Response(400, json={"error": {"message": "rejected by the prefill server", "code": 400}})

        async def then():
            yield b'data: {"error": {"message": "the KV never came", "code": 500}}\n\ndata: [DONE]\n\n'

        return _role_then(then, role=False)

    r, seconds = _timed_post(handler, {"prompt": "x", "stream": True})
    assert r.status_code == 400 and "rejected by the prefill server" in r.text and seconds < 2


@pytest.mark.parametrize("prefill", ["silent", "ended by the decode server", "succeeded"])
@pytest.mark.parametrize("ending", ["error event", "done", "broken"])
def test_a_stream_that_ends_before_any_output_is_answered_as_unstreamed(prefill, ending):
    """The decode stream ends before any output, beside a prefill half that stays silent (after
    the grace), that ended 499 (the decode server ended the pairing) or that succeeded: nothing
    reached the client yet, so an error event's code is the status, as unstreamed; a broken stream is a 502 naming
    the decode server; a stream that ended without an error is passed on as it was."""
    import asyncio

    async def handler(request):
        if request.url.host == "p":
            if prefill == "silent":
                await asyncio.sleep(30)
            if prefill == "succeeded":
                return httpx.Response(200, json={"choices": [{"text": "a", "finish_reason": "length"}]})
            return httpx.Response(499, json={"error": {"message": "aborted by the decode server", "code": 499}})

        async def then():
            await asyncio.sleep(0.2)
            if ending == "broken":
                raise httpx.RemoteProtocolError("peer closed connection")
            if ending == "error event":
                yield b'data: {"error": {"message": "the decode server says no", "code": 503}}\n\n'
            yield b"data: [DONE]\n\n"

        return _role_then(then)

    router, r, seconds = _routed_post(handler, {"prompt": "x", "stream": True})
    assert seconds < 10 and (seconds > 1) == (prefill == "silent"), seconds  # (the grace)
    if ending == "done":
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and len(events) == 2 and '"role"' in events[0], r.text
        assert _failures(router) == {}
    else:
        status, words = (503, "the decode server says no") if ending == "error event" else (502, "http://d failed")
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
        assert _failures(router) == {"http://d": 1.0}


@pytest.mark.parametrize("phase", ["headers", "held"])
def test_a_client_gone_before_its_stream_starts_lets_both_halves_go(phase):
    """While the router waits for the decode server's headers, or holds its stream back until
    output, it checks that the client is still there: one that went away gets both halves
    cancelled at once, not when the prefill half ends."""
    import asyncio

    from minengine.router import Backend, Router

    ended = []

    async def handler(request):
        try:
            if request.url.host == "p" or phase == "headers":
                await asyncio.sleep(30)
        except asyncio.CancelledError:
            ended.append(request.url.host)
            raise

        async def then():
            try:
                await asyncio.sleep(30)
                yield b"data: [DONE]\n\n"
            finally:
                ended.append("d")

        return _role_then(then)

    class Gone:  # the parts of a starlette Request that the router reads
        headers: dict = {}

        def __init__(self):
            self.start = time.monotonic()

        async def body(self) -> bytes:
            return json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": True}).encode()

        async def is_disconnected(self) -> bool:
            return time.monotonic() - self.start > 0.3

    p, d = Backend("http://p", 1), Backend("http://d")

    async def run():
        router = Router([p], [d])
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(_no_server_info(handler)))
        start = time.monotonic()
        r = await router.forward("/v1/chat/completions", Gone())
        await asyncio.sleep(0.1)  # (the cancelled halves end)
        return r, time.monotonic() - start

    r, seconds = asyncio.run(run())
    assert r.status_code == 499 and seconds < 2
    assert sorted(ended) == ["d", "p"] and p.in_flight == d.in_flight == 0


@pytest.mark.parametrize("output_first", [True, False])
def test_a_client_gone_mid_stream_is_a_disconnect_the_decode_server_sees(output_first):
    """Real sockets (uvicorn): a client that reads part of a stream and goes away, or goes away
    before any output, ends the router's connection to the decode server at once, so that server
    aborts the request and frees its KV, instead of generating on to max_tokens."""
    import asyncio

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from minengine.router import Backend, Router, build_app

    ends = {}

    async def prefill(request):
        start = time.monotonic()
        while time.monotonic() - start < (0.1 if output_first else 30):  # (else: the stream is held back)
            if await request.is_disconnected():
                ends["prefill gone"] = True
                return JSONResponse({}, status_code=499)
            await asyncio.sleep(0.05)
        return JSONResponse({"choices": [{"text": "a", "finish_reason": "length"}]})

    async def decode(request):
        async def events():
            start = time.monotonic()
            try:
                for i in range(20):
                    if output_first or i:
                        yield b'data: {"choices": [{"index": 0, "text": "t%d"}]}\n\n' % i
                    await asyncio.sleep(0.3)
                ends["finished"] = True
            finally:
                ends["after"] = time.monotonic() - start

        return StreamingResponse(events(), media_type="text/event-stream")

    def app(endpoint):
        return Starlette(routes=[Route("/v1/completions", endpoint, methods=["POST"])])

    async def run():
        ports = [free_port() for _ in range(3)]
        router = Router([Backend(f"http://127.0.0.1:{ports[0]}", 1)], [Backend(f"http://127.0.0.1:{ports[1]}")])
        router.client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(), base_url="")
        apps = [app(prefill), app(decode), build_app(router)]
        servers = [
            uvicorn.Server(uvicorn.Config(a, port=port, log_level="warning", lifespan="off"))
            for a, port in zip(apps, ports, strict=True)
        ]
        serving = [asyncio.create_task(s.serve()) for s in servers]
        try:
            while not all(s.started for s in servers):
                await asyncio.sleep(0.05)
            reader, writer = await asyncio.open_connection("127.0.0.1", ports[2])
            body = json.dumps({"prompt": "x", "stream": True}).encode()
            head = "POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
            writer.write(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
            got = b""
            while output_first and b'"t2"' not in got:  # (three events read)
                got += await reader.read(4096)
            if not output_first:
                await asyncio.sleep(0.6)
            writer.close()
            for _ in range(60):
                if "after" in ends:
                    break
                await asyncio.sleep(0.05)
            return router
        finally:
            for s in servers:
                s.should_exit = True
            await asyncio.gather(*serving)

    router = asyncio.run(run())
    assert "finished" not in ends and ends["after"] < 2.5 and ("prefill gone" in ends) != output_first, ends
    assert router.decode.backends[0].in_flight == 0


def test_decode_headers_that_come_while_the_disconnect_is_checked_are_closed():
    """The decode server's headers arrive while the router asks whether the client is still
    there, and it is not: that response is closed (the decode server sees the disconnect)."""
    import asyncio

    from minengine.router import Backend, Router

    closed = []

    async def handler(request):
        if request.url.host == "p":
            await asyncio.sleep(30)

        class Events(httpx.AsyncByteStream):
            async def __aiter__(self):
                await asyncio.sleep(30)
                yield b"data: [DONE]\n\n"

            async def aclose(self) -> None:
                closed.append(True)

        await asyncio.sleep(0.3)
        return httpx.Response(200, stream=Events(), headers={"content-type": "text/event-stream"})

    class Gone:
        headers: dict = {}

        async def body(self) -> bytes:
            return b'{"prompt": "x", "stream": true}'

        async def is_disconnected(self) -> bool:
            await asyncio.sleep(0.2)  # (the headers come meanwhile)
            return True

    async def run():
        router = Router([Backend("http://p", 1)], [Backend("http://d")])
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(_no_server_info(handler)))
        r = await router.forward("/v1/completions", Gone())
        await asyncio.sleep(0.1)
        return router, r

    router, r = asyncio.run(run())
    assert r.status_code == 499 and closed == [True] and router.decode.backends[0].in_flight == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_cancelled_in_the_router_cancels_its_decode_half(stream):
    """A request cancelled inside the router (its task: the router shutting down) cancels the
    decode half it sent, not only the prefill half."""
    import asyncio

    from minengine.router import Backend, Router

    cancelled = []

    async def handler(request):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(request.url.host)
            raise

    class Client:
        headers: dict = {}

        async def body(self) -> bytes:
            return json.dumps({"prompt": "x", "stream": stream}).encode()

        async def is_disconnected(self) -> bool:
            return False

    async def run():
        router = Router([Backend("http://p", 1)], [Backend("http://d")])
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(_no_server_info(handler)))
        task = asyncio.create_task(router.forward("/v1/completions", Client()))
        await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.1)
        return router, sorted(cancelled)  # (before asyncio.run cancels whatever is left)

    router, halves = asyncio.run(run())
    assert halves == ["d", "p"]
    assert router.prefill.backends[0].in_flight == router.decode.backends[0].in_flight == 0


def _silent_router(silent: str, stream: bool, timeout: float = 0.5):
    """A one-pair router with a request ``timeout`` over servers where ``silent`` ("p", "d" or
    "mid-stream": the decode server after its first piece) sends nothing more."""
    import asyncio

    async def handler(request):
        if request.url.host == "p":
            if silent == "p":
                await asyncio.sleep(30)
            return httpx.Response(200, json={"choices": [{"text": "a", "finish_reason": "length"}]})
        if silent == "d" or silent == "p" and not stream:  # (the decode server waits for the KV)
            await asyncio.sleep(30)
        if not stream:
            return httpx.Response(200, json={"choices": [{"text": "ab"}]})

        async def events():
            if silent == "p":
                await asyncio.sleep(30)
            yield b'data: {"choices": [{"text": "a"}]}\n\n'
            if silent == "mid-stream":
                await asyncio.sleep(30)
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})

    router, http = _one_pair_router(handler)
    router.timeout = timeout
    router.client = httpx.AsyncClient(
        transport=httpx.MockTransport(_no_server_info(_slow_reads(handler, timeout))),
    )
    return router, http


def _slow_reads(handler, timeout: float):
    """``handler`` behind httpx's read timeout, as a real connection has it (MockTransport has none)."""
    import asyncio

    async def handle(request):
        try:
            response = await asyncio.wait_for(handler(request), timeout)
        except TimeoutError:
            raise httpx.ReadTimeout("timed out", request=request) from None
        if response.headers.get("content-type") != "text/event-stream":
            return response

        async def pieces():
            it = response.stream.__aiter__()
            while True:
                try:
                    yield await asyncio.wait_for(it.__anext__(), timeout)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise httpx.ReadTimeout("timed out", request=request) from None

        return httpx.Response(200, content=pieces(), headers=response.headers)

    return handle


@pytest.mark.parametrize(
    "silent, stream",
    [("p", False), ("p", True), ("d", False), ("d", True), ("mid-stream", True)],
)
def test_a_server_that_sends_nothing_for_the_request_timeout_fails_its_request(silent, stream):
    """--request-timeout-secs: a stalled server (stopped: it still accepts connections) fails
    the request with a 504 naming it, instead of holding it forever; mid-stream, as the stream's
    last event."""
    import asyncio

    async def run():
        router, http = _silent_router(silent, stream)
        async with http:
            start = time.monotonic()
            r = await http.post("/v1/completions", json={"prompt": "x", "stream": stream}, timeout=20)
            return router, r, time.monotonic() - start

    router, r, seconds = asyncio.run(run())
    server = "prefill server http://p" if silent == "p" else "decode server http://d"
    assert seconds < 5, seconds
    if silent == "mid-stream":
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[0] == 'data: {"choices": [{"text": "a"}]}', r.text
        error = json.loads(events[1][6:])["error"]
        assert error["code"] == 504 and events[2] == "data: [DONE]"
    else:
        assert r.status_code == 504, r.text
        error = r.json()["error"]
    assert error["message"].startswith(f"the {server} sent nothing for 0.5 s (--request-timeout-secs)")
    assert _failures(router) == {server.split()[-1]: 1.0}


def _checked_router() -> SimpleNamespace:
    """A router over fake servers p, d1 and d2 that pass their health checks unless named in the
    set ``failing`` (then a decode server answers 503 and p refuses) or ``stalled`` (no answer).
    With its ``gauge`` by server, the decode servers it ``picks`` for 8 prompts, and the
    ``checks`` each server got."""
    from collections import Counter

    from minengine.router import Backend, HealthChecks, Router

    h = SimpleNamespace(failing=set(), stalled=set(), checks=Counter())

    async def handler(request):
        url = f"http://{request.url.host}"
        h.checks[url] += 1
        if url in h.stalled:
            await asyncio.sleep(3600)
        if url in h.failing:
            if url == "http://p":
                raise httpx.ConnectError("refused")
            return httpx.Response(503, json={"error": {"message": "shutting down", "code": 503}})
        return httpx.Response(200)

    h.router = Router(
        [Backend("http://p", 1)], [Backend("http://d1"), Backend("http://d2")], health_checks=HealthChecks(1, 1, 3, 2)
    )
    h.router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))

    def gauge() -> dict[str, float]:
        from prometheus_client import generate_latest

        text = generate_latest(h.router.registry).decode()
        return {
            line.split('"')[1]: float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("minengine_router:server_healthy{")
        }

    h.gauge = gauge
    h.picks = lambda: {h.router.decode.pick(f"prompt {i} " * 5).url for i in range(8)}
    return h


def test_a_server_is_pending_until_it_first_passes_a_health_check(monkeypatch):
    """A server that has not passed a health check yet (still loading, or stalled since before
    the router started) gets no requests while another of its kind passes; its first pass makes
    it healthy, and until then it is checked every few seconds, not once a round. Each answer
    counts as it comes: a server that answers nothing holds up no other."""
    from minengine import router as router_mod

    h = _checked_router()
    router = h.router
    assert set(h.gauge().values()) == {0.0}
    assert h.picks() == {"http://d1", "http://d2"}  # none passes yet: all are used
    h.failing.add("http://d1")
    asyncio.run(router.check_health())
    assert h.picks() == {"http://d2"} and h.gauge() == {"http://p": 1.0, "http://d1": 0.0, "http://d2": 1.0}
    for _ in range(5):  # (more failures than the threshold: still pending, not unhealthy)
        asyncio.run(router.check_health(pending_only=True))
    assert h.picks() == {"http://d2"} and h.checks == {"http://p": 1, "http://d1": 6, "http://d2": 1}
    h.failing.clear()
    asyncio.run(router.check_health(pending_only=True))
    assert h.picks() == {"http://d1", "http://d2"} and set(h.gauge().values()) == {1.0}
    h.failing.add("http://d1")  # no longer pending: one failure is not enough
    asyncio.run(router.check_health())
    assert h.picks() == {"http://d1", "http://d2"}
    router.decode.backends[0].unreachable(httpx.ConnectError("refused"))
    assert h.picks() == {"http://d2"}
    h.failing.clear()  # a check it passes: it answers now, so its refusal no longer passes it over
    asyncio.run(router.check_health(pending_only=True))
    assert h.picks() == {"http://d2"}  # (not checked: it is not pending)
    asyncio.run(router.check_health())
    assert h.picks() == {"http://d1", "http://d2"}

    # a stalled server: the others count before its check ends
    h = _checked_router()
    h.stalled.add("http://d1")

    async def first_round() -> set[str]:
        checking = asyncio.create_task(h.router.check_health())
        await asyncio.sleep(0.1)
        picked = h.picks()
        checking.cancel()
        return picked

    assert asyncio.run(first_round()) == {"http://d2"}

    # watch_health: a round at once, then only the pending server, every PENDING_CHECK_SECONDS
    h = _checked_router()
    h.router.health_checks.interval = 100.0
    monkeypatch.setattr(router_mod, "PENDING_CHECK_SECONDS", 0.02)
    h.failing.add("http://d1")

    async def watch(seconds: float) -> None:
        task = asyncio.create_task(h.router.watch_health())
        await asyncio.sleep(seconds)
        task.cancel()

    asyncio.run(watch(0.3))
    assert h.checks["http://p"] == h.checks["http://d2"] == 1 and h.checks["http://d1"] >= 5, h.checks
    h.failing.clear()
    asyncio.run(watch(0.3))
    assert h.checks["http://d2"] == 2 and h.picks() == {"http://d1", "http://d2"}, h.checks
    d1_checks = h.checks["http://d1"]
    asyncio.run(watch(0.3))  # (none pending: one round, then the interval)
    assert h.checks["http://d1"] == d1_checks + 1, h.checks


def test_health_checks_pass_a_failing_server_over_until_it_passes_again():
    """As SGLang's router: a server whose /health fails `failure_threshold` checks in a row is
    passed over (a stalled server still accepts connections, so requests alone would not show it)
    until it passes `success_threshold` in a row; with every server of a kind failing, they are
    all used (their errors are the answers); the gauge follows."""
    h = _checked_router()
    router, failing, gauge, picks = h.router, h.failing, h.gauge, h.picks
    d1, d2 = router.decode.backends

    async def rounds(n: int) -> None:
        for _ in range(n):
            await router.check_health()

    asyncio.run(rounds(1))
    assert gauge() == {"http://p": 1.0, "http://d1": 1.0, "http://d2": 1.0}
    failing.add("http://d1")
    asyncio.run(rounds(2))
    assert picks() == {"http://d1", "http://d2"}  # two failures: not yet
    asyncio.run(rounds(1))
    assert picks() == {"http://d2"} and gauge() == {"http://p": 1.0, "http://d1": 0.0, "http://d2": 1.0}
    failing.clear()
    asyncio.run(rounds(1))
    assert picks() == {"http://d2"}  # one pass: not yet
    failing.add("http://d1")
    asyncio.run(rounds(1))
    failing.clear()
    asyncio.run(rounds(1))
    assert picks() == {"http://d2"}  # the passes must come in a row
    asyncio.run(rounds(1))
    assert picks() == {"http://d1", "http://d2"} and gauge()["http://d1"] == 1.0
    failing.update({"http://d1", "http://d2", "http://p"})
    asyncio.run(rounds(3))
    assert picks() == {"http://d1", "http://d2"} and set(gauge().values()) == {0.0}
    assert router.prefill.pick("x").url == "http://p"
    # every server failing its checks (as while they all start): a refusal still turns requests away
    d1.unreachable(httpx.ConnectError("refused"))
    assert picks() == {"http://d2"} and router.decode.any_up()
    d2.unreachable(httpx.ConnectError("refused"))
    assert picks() == {"http://d1", "http://d2"} and not router.decode.any_up()


def test_output_watch_over_split_and_non_output_events():
    from minengine.router import _OutputWatch

    watch = _OutputWatch()
    for chunk in [
        b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n',
        b"\n",
        b"data: {",
        b'"error": {}}\n\n',
    ]:
        watch.feed(chunk)
        assert not watch.began
    watch.feed(b'data: {"choices": [{"text": "", "finish_reason": null}]}\n\ndata: [1]\n\ndata: not json\n\n')
    assert not watch.began
    watch.feed(b'data: {"choices": [{"text": "", "finish_')
    assert not watch.began
    watch.feed(b'reason": "stop"}]}\n\n')
    assert watch.began
    watch.feed(b"anything")
    assert watch.began and watch._buffer == b""


def _two_pair_router(handler):
    from minengine.router import Backend, Router, build_app

    router = Router([Backend("http://p1", 1), Backend("http://p2", 2)], [Backend("http://d1"), Backend("http://d2")])
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(_no_server_info(handler)))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(router)), base_url="http://router")
    return router, http


def _counter(router, name: str) -> dict[str, float]:
    """A router counter's samples by server."""
    from prometheus_client import generate_latest

    text = generate_latest(router.registry).decode()
    return {
        line.split('"')[1]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(f"minengine_router:{name}_total{{")
    }


def _retries(router) -> dict[str, float]:
    return _counter(router, "retries")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("refusing", ["p1", "d1"])
@pytest.mark.parametrize("error", [httpx.ConnectError, httpx.ConnectTimeout])
def test_a_refused_connection_sends_the_request_to_another_pair(stream, refusing, error):
    """A server that refuses the connection, or never answers it (a host that drops packets: a
    ConnectTimeout, no ConnectError in httpx), never saw the request: the router sends both halves
    to another pair (a new room), the client gets the answer, and that server is passed over for a
    while. The first pair's other half is cancelled."""
    import asyncio

    seen = []

    async def handler(request):
        body = json.loads(request.content)
        seen.append((request.url.host, body["bootstrap_port"], body["bootstrap_room"]))
        if request.url.host == refusing:
            raise error("connection refused")
        if request.url.host.startswith("p"):
            await asyncio.sleep(0.05)
            return httpx.Response(200, json={"choices": [{"text": "a"}]})
        await asyncio.sleep(0.2)  # the prefill half answers (or is refused) first
        if body.get("stream"):

            async def events():
                yield b'data: {"choices": [{"text": "ab"}]}\n\ndata: [DONE]\n\n'

            return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"choices": [{"text": "ab"}], "by": request.url.host})

    async def run():
        router, http = _two_pair_router(handler)
        async with http:
            first = await http.post("/v1/completions", json={"prompt": "x", "stream": stream}, timeout=10)
            again = await http.post("/v1/completions", json={"prompt": "y", "stream": stream}, timeout=10)
        return router, first, again

    router, first, again = asyncio.run(run())
    assert first.status_code == 200 and '"ab"' in first.text
    assert _retries(router) == {f"http://{refusing}": 1.0}
    # the retry went to the other server of the refusing kind, both halves with a new room
    tried = [h for h, _, _ in seen]
    kind = refusing[0]
    assert [h for h in tried if h[0] == kind][:2] == [refusing, kind + "2"]
    rooms = {room for _, _, room in seen}
    assert len(rooms) >= 2
    last_pair = [(h, port) for h, port, room in seen if room == seen[-1][2]]
    assert {h[0] for h, _ in last_pair} == {"p", "d"} and all(port == 2 for _, port in last_pair) == (kind == "p")
    # the refusing server is passed over now: the next request makes no retry
    assert again.status_code == 200 and _retries(router) == {f"http://{refusing}": 1.0}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("closing", ["p1", "d1"])
def test_a_server_shutting_down_sends_the_request_to_another_pair(stream, closing):
    """A 503 (shutting down: the server ran none of the request) is turned away like a refusal:
    the request goes to another pair, and that server is passed over for a while."""
    import asyncio

    seen = []

    async def handler(request):
        seen.append(request.url.host)
        if request.url.host == closing:
            if closing == "d1":
                await asyncio.sleep(0.05)
            return httpx.Response(503, json={"error": {"message": "the server is shutting down", "code": 503}})
        if request.url.host.startswith("p"):
            await asyncio.sleep(0.1 if closing == "d1" else 0)
            return httpx.Response(200, json={"choices": [{"text": "a"}]})
        await asyncio.sleep(0.2)
        if json.loads(request.content).get("stream"):

            async def events():
                yield b'data: {"choices": [{"text": "ab"}]}\n\ndata: [DONE]\n\n'

            return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"choices": [{"text": "ab"}]})

    async def run():
        router, http = _two_pair_router(handler)
        async with http:
            answers = [await http.post("/v1/completions", json={"prompt": p, "stream": stream}) for p in "xy"]
        return router, answers

    router, answers = asyncio.run(run())
    assert [r.status_code for r in answers] == [200, 200] and all('"ab"' in r.text for r in answers)
    assert _retries(router) == {f"http://{closing}": 1.0} and _failures(router) == {}
    assert seen.count(closing) == 1


def test_when_every_server_of_a_kind_refuses_the_client_gets_the_error():
    import asyncio

    tried = []

    async def handler(request):
        tried.append(request.url.host)
        if request.url.host.startswith("p"):
            raise httpx.ConnectError("connection refused")
        await asyncio.sleep(5)

    async def run():
        router, http = _two_pair_router(handler)
        async with http:
            return router, await http.post("/v1/completions", json={"prompt": "x"}, timeout=10)

    router, r = asyncio.run(run())
    assert r.status_code == 502 and "prefill server http://p2 failed" in r.json()["error"]["message"]
    assert sorted(h for h in tried if h.startswith("p")) == ["p1", "p2"]  # each once: no third attempt
    assert _retries(router) == {"http://p1": 1.0}


def _prefills_back(seen: list, back: set, stalled: str | None = None, released: list | None = None):
    """A fake two-pair cluster's handler: prefill servers not in ``back`` refuse connections (the
    ``stalled`` one's /health answers nothing until ``released`` holds something, then times out);
    the others answer, a decode half after 0.1 s. Each call's (host, path) goes to ``seen``."""

    async def handler(request):
        seen.append((request.url.host, request.url.path))
        if request.url.host == stalled and request.url.path == "/health":
            while not released:  # (a host that drops packets, until the probe's timeout)
                await asyncio.sleep(0.01)
            raise httpx.ConnectTimeout("no answer")
        if request.url.host.startswith("p") and request.url.host not in back:
            raise httpx.ConnectError("connection refused")
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.host.startswith("p"):
            return httpx.Response(200, json={"choices": [{"text": "a"}]})
        await asyncio.sleep(0.1)
        return httpx.Response(200, json={"choices": [{"text": "ab"}]})

    return handler


def test_with_every_prefill_server_down_nothing_is_sent_until_one_answers_again():
    """Every prefill server refused lately: a request is answered 503 at once, after a /health
    probe of the one picked, and no decode half is sent (it would hold its KV pages for the
    bootstrap timeout). Once the probe passes, requests flow again."""
    seen, back = [], set()
    handler = _prefills_back(seen, back)

    async def run():
        router, http = _two_pair_router(handler)
        async with http:
            first = await http.post("/v1/completions", json={"prompt": "x"})
            decodes = [h for h, path in seen if h.startswith("d") and path != "/health"]
            seen.clear()
            second = await http.post("/v1/completions", json={"prompt": "y"})
            during = list(seen)
            back.update({"p1", "p2"})
            third = await http.post("/v1/completions", json={"prompt": "z"})
        return router, first, decodes, second, during, third

    router, first, decodes, second, during, third = asyncio.run(run())
    message = first.json()["error"]["message"]
    assert first.status_code == 502 and "prefill server http://p2 failed" in message and "decode half" not in message
    assert len(decodes) == 2  # (the first request's halves went out together, as before)
    assert second.status_code == 503 and "no prefill server is up" in second.json()["error"]["message"]
    assert sorted(during) == [("p1", "/health"), ("p2", "/health")]  # probes, nothing sent
    assert third.status_code == 200 and '"ab"' in third.text


@pytest.mark.parametrize("attempts", [1, 3])
def test_a_probe_asks_every_server_passed_over_and_sends_to_one_that_is_back(monkeypatch, attempts):
    """Every prefill server refused lately, and the one picked is still gone (its probe gets no
    answer): the others are probed too, and the request goes at once to the first that answers,
    within the same attempt (even the last one: it was a 503 until their 5 s ended). Requests at
    once share the probes; the probe still out counts when it ends."""
    import minengine.router as router_module

    monkeypatch.setattr(router_module, "MAX_ATTEMPTS", attempts)
    seen, released = [], []
    handler = _prefills_back(seen, {"p2"}, stalled="p1", released=released)

    async def run():
        router, http = _two_pair_router(handler)
        p1, p2 = router.prefill.backends
        for b in (p1, p2):
            b.unreachable(httpx.ConnectError("refused"))
        router.prefill._next = 0  # (p1 is picked first)
        async with http:
            p1_before = p1.down_until
            answers = await asyncio.gather(*(http.post("/v1/completions", json={"prompt": f"x{i}"}) for i in range(4)))
            released.append(True)  # p1's probe times out now (it was still out): passed over from then on
            for _ in range(100):
                if p1.down_until != p1_before:
                    break
                await asyncio.sleep(0.01)
        return router, answers, p1_before, p1.down_until

    router, answers, p1_before, p1_after = asyncio.run(run())
    assert all(a.status_code == 200 and '"ab"' in a.text for a in answers), [a.text for a in answers]
    # one probe of each, shared by the requests at once; nothing sent to p1
    assert seen.count(("p1", "/health")) == seen.count(("p2", "/health")) == 1, seen
    assert ("p1", "/v1/completions") not in seen
    assert ("p2", "/v1/completions") in seen and _retries(router) == {}
    assert p1_after > p1_before  # its late failure counted


def test_a_server_that_refused_once_is_probed_before_one_that_never_passed_a_check():
    """d1 passes its health checks but refused a connection a moment ago; d2 has never passed
    one (it stalls): the request probes d1, which answers, and goes there, not to d2."""

    async def handler(request):
        host, path = request.url.host, request.url.path
        if host == "d2":
            await asyncio.sleep(3600)
        if path == "/health":
            return httpx.Response(200)
        if host.startswith("p"):
            return httpx.Response(200, json={"choices": [{"text": "a"}]})
        return httpx.Response(200, json={"choices": [{"text": "ab"}]})

    async def run():
        router, http = _two_pair_router(handler)
        for b in router.prefill.backends:
            b.pending, b.healthy = False, True
        d1, d2 = router.decode.backends
        d1.pending, d1.healthy = False, True
        d1.unreachable(httpx.ConnectError("refused"))
        async with http:
            ask = [http.post("/v1/completions", json={"prompt": f"x{i}"}) for i in range(3)]
            answers = [await asyncio.wait_for(a, 3) for a in ask]  # (d2 would hold one for good)
        return answers, router

    answers, router = asyncio.run(run())
    assert [a.status_code for a in answers] == [200] * 3
    assert router.decode.backends[0].down_until == 0.0


def test_a_stalled_server_gets_nothing_while_another_of_its_kind_passes_its_checks():
    """d1 passes its health checks but refuses connections now (restarting); d2 has never passed
    one and answers nothing (stopped since before the router started): its probe fails too, so the
    request is a 503 at once (d2 would hold it for the request timeout), and d2 is passed over.
    /v1/models and /tokenize ask a server not passed over first."""

    async def handler(request):
        host, path = request.url.host, request.url.path
        seen.append((host, path))
        if host == "d1":
            raise httpx.ConnectError("connection refused")
        if host == "d2" and path == "/health":
            await asyncio.sleep(0.05)
            raise httpx.ReadTimeout("no answer")
        if host == "d2" and path == "/v1/completions":
            await asyncio.sleep(3600)
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            return httpx.Response(200, json={"data": []})
        return httpx.Response(200, json={"choices": [{"text": "a"}]})

    async def run():
        router, http = _two_pair_router(handler)
        for b in (*router.prefill.backends, router.decode.backends[0]):
            b.pending, b.healthy = False, True
        d1, d2 = router.decode.backends
        d1.unreachable(httpx.ConnectError("refused"))
        async with http:
            answer = await asyncio.wait_for(http.post("/v1/completions", json={"prompt": "x"}), 3)
            seen.clear()
            d2.down_until = 0.0  # (d1 still passed over)
            models = await http.get("/v1/models")
        return answer, models, d2

    seen = []
    answer, models, d2 = asyncio.run(run())
    assert answer.status_code == 503 and "no decode server is up" in answer.text, answer.text
    assert models.status_code == 200 and seen == [("d2", "/v1/models")]


def test_a_passed_health_check_does_not_end_a_wrong_role_pass_over():
    """A server passed over for its role still answers /health: neither a health check nor a
    probe puts it back (only its /server_info, asked again, does)."""
    from minengine.router import Backend, Router

    async def handler(request):
        return httpx.Response(200)

    router = Router([Backend("http://p", 1)], [Backend("http://d1"), Backend("http://d2")])
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    d1, d2 = router.decode.backends
    d2.pass_over(wrong_role=True)
    asyncio.run(router.check_health())
    assert d1.healthy and d2.down_until > time.monotonic()
    assert {router.decode.pick(f"prompt {i} " * 5).url for i in range(8)} == {"http://d1"}
    d2.role_fits()
    assert d2.down_until == 0.0 and not d2.wrong_role


def test_a_failed_probe_passes_the_server_over_again(monkeypatch):
    """A probe that fails passes the server over for another DOWN_SECONDS: a dead prefill server
    gets probes, not requests with their decode halves, for as long as it stays dead."""
    import asyncio

    import minengine.router as router_module

    monkeypatch.setattr(router_module, "DOWN_SECONDS", 0.3)
    sent = []

    async def handler(request):
        if request.url.host == "p":
            raise httpx.ConnectError("connection refused")
        sent.append(request.url.path)
        await asyncio.sleep(0.1)  # (waiting for the KV)
        return httpx.Response(200, json={"choices": [{"text": "ab"}]})

    async def run():
        _, http = _one_pair_router(handler)
        async with http:
            answers = []
            for i in range(8):
                answers.append((await http.post("/v1/completions", json={"prompt": f"{i}"})).status_code)
                await asyncio.sleep(0.2)
            return answers

    answers = asyncio.run(run())
    assert answers[0] == 502 and set(answers[1:]) == {503} and sent == ["/v1/completions"], (answers, sent)


def test_a_probe_that_fails_while_another_server_came_back_retries():
    """The picked prefill server was passed over while this request waited for its role checks
    (another request's refusal): its failed probe sends the request to another pair, not a 503."""
    import asyncio

    from minengine.router import Backend, Router, build_app

    async def handler(request):
        host, path = request.url.host, request.url.path
        if host == "p1":
            raise httpx.ConnectError("connection refused")
        if path == "/server_info":
            await asyncio.sleep(0.3 if host == "d1" else 0)  # (the first request waits here)
            return httpx.Response(404)
        if path == "/health":
            return httpx.Response(200)
        return httpx.Response(200, json={"choices": [{"text": "ab"}]})

    async def run():
        router = Router([Backend("http://p1", 1), Backend("http://p2", 2)], [Backend("http://d1")])
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(router)), base_url="http://router")
        router.prefill.backends[1].role_checked = True
        prompt = "one prompt, so that both requests pick p1 by its prefix"
        async with http:
            waiting = asyncio.create_task(http.post("/v1/completions", json={"prompt": prompt}))
            await asyncio.sleep(0.05)  # (it picked p1 and waits for d1's role)
            router.decode.backends[0].role_checked = True
            refused = await http.post("/v1/completions", json={"prompt": prompt})  # p1 refuses: retried on p2
            return refused, await waiting

    refused, waiting = asyncio.run(run())
    assert refused.status_code == 200 and waiting.status_code == 200, (refused.text, waiting.text)


@pytest.mark.parametrize("stream", [False, True])
def test_a_prefill_half_its_server_aborted_ends_the_request_at_once(stream):
    """A prefill server that shuts down answers its half 200 with finish_reason "abort": no KV
    comes, so the client gets a 503 at once instead of waiting for the decode server to time out."""

    async def handler(request):
        import asyncio

        if request.url.host == "p":
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]})
        await asyncio.sleep(20)  # the decode half waits for KV that will never come

    r, seconds = _timed_post(handler, {"prompt": "x", "stream": stream})
    assert seconds < 5 and r.status_code == 503  # (a stream too: the decode server had not answered yet)
    assert "the prefill server http://p aborted the request" in r.json()["error"]["message"]


@pytest.mark.parametrize("decode_status", [400, 503])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prefill_first", [False, True])
def test_the_decode_servers_own_error_is_the_answer_not_the_prefill_half_it_aborted(
    decode_status, stream, prefill_first
):
    """The decode server rejected the request (400) or is shutting down (503: a client may
    retry), and aborted its room: the prefill half ends with a 499 ("aborted by the decode
    server"). The decode server's answer is the cause, even when the prefill half's comes first."""

    async def handler(request):
        import asyncio

        if request.url.host == "p":
            await asyncio.sleep(0 if prefill_first else 0.1)
            return httpx.Response(499, json={"error": {"message": "aborted by the decode server", "code": 499}})
        await asyncio.sleep(0.3 if prefill_first else 0)
        return httpx.Response(decode_status, json={"error": {"message": "the decode server's own", "code": 0}})

    r, _ = _timed_post(handler, {"prompt": "x", "stream": stream})
    assert r.status_code == decode_status and r.json()["error"]["message"] == "the decode server's own"


@pytest.mark.parametrize("decode_status", ["refused", 500])
def test_a_failed_decode_half_beside_a_refused_prefill_half_is_a_502(decode_status):
    """Both halves fail: the answer is the prefill server's error in the OpenAI shape (the
    prefill half's exception used to escape as a bare 500)."""
    import asyncio

    async def handler(request):
        if request.url.host == "p" or decode_status == "refused":
            raise httpx.ConnectError("connection refused")
        return httpx.Response(500, json={"error": {"message": "decode failed", "code": 500}})

    async def run():
        async with _router_app(handler) as http:
            return await http.post("/v1/completions", json={"prompt": "x"}, timeout=10)

    r = asyncio.run(run())
    assert r.status_code == 502 and "the prefill server http://p failed" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "hi", "temperature": NaN}',
        b'{"prompt": "hi", "temperature": Infinity, "stream": true}',
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'["a list"]',
        b"\xff",
        b'{"messages": [{"role": "user", "content": "a \\ud83d"}]}',
    ],
    ids=["nan", "infinity-stream", "deep", "list", "not-utf8", "lone-surrogate"],
)
def test_a_body_that_is_not_a_json_object_is_a_400_from_the_router(body):
    """The router answers these as a single server does, without sending them on (NaN and
    Infinity used to pass its parser and then fail re-encoding: a plain-text 500)."""
    import asyncio

    sent = []

    async def handler(request):
        sent.append(request.url.host)
        return httpx.Response(200, json={"choices": []})

    async def run():
        async with _router_app(handler) as http:
            headers = {"content-type": "application/json"}
            return await http.post("/v1/completions", content=body, headers=headers, timeout=10)

    r = asyncio.run(run())
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "BadRequestError" and error["code"] == 400, r.text
    assert ("JSON" in error["message"] or "unpaired surrogate" in error["message"]) and sent == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_decode_connection_is_a_502_at_once(stream):
    """The decode server never saw the request, so the prefill half (waiting for it) is not
    waited for: the 502 comes at once, streamed or not."""
    import asyncio

    async def handler(request):
        if request.url.host == "d":
            raise httpx.ConnectError("connection refused")
        await asyncio.sleep(30)  # the prefill half waits for a decode side that never comes

    r, seconds = _timed_post(handler, {"prompt": "x", "stream": stream})
    error = r.json()["error"]
    assert r.status_code == 502 and error["type"] == "BadGatewayError" and "decode server http://d" in error["message"]
    assert seconds < 1.0, seconds


def test_models_comes_from_any_decode_server_that_answers():
    import asyncio

    async def handler(request):
        if request.url.host == "d1":
            raise httpx.ConnectError("connection refused")
        return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "by": request.url.host}]})

    async def shutting_down(request):
        if request.url.host == "d1":
            return httpx.Response(503, json={"error": {"message": "the server is shutting down", "code": 503}})
        return await handler(request)

    async def run():
        router, http = _two_pair_router(handler)
        async with http:
            first = await http.get("/v1/models", timeout=10)
            router.decode.backends[1].down_until = time.monotonic() + 60
            router.decode.backends[0].down_until = 0.0
            again = await http.get("/v1/models", timeout=10)
        return router, first, again

    router, first, again = asyncio.run(run())
    assert first.status_code == 200 and first.json()["data"][0]["by"] == "d2"

    async def one(handler):
        _, http = _two_pair_router(handler)
        async with http:
            return await http.get("/v1/models", timeout=10)

    r = asyncio.run(one(shutting_down))
    assert r.status_code == 200 and r.json()["data"][0]["by"] == "d2"
    assert router.decode.backends[0].down_until > 0  # the refusal was noted
    assert again.status_code == 200 and again.json()["data"][0]["by"] == "d2"  # d1 refused again

    async def all_down():
        _, http = _two_pair_router(lambda request: (_ for _ in ()).throw(httpx.ConnectError("refused")))
        async with http:
            return await http.get("/v1/models", timeout=10)

    r = asyncio.run(all_down())
    message = r.json()["error"]["message"]
    assert r.status_code == 502 and "http://d1" in message and "http://d2" in message


def test_a_tokenize_post_goes_on_only_past_a_server_that_never_had_it():
    """/tokenize through the router: a refused connection goes to the next decode server, and so
    does a server that sent nothing for TOKENIZE_SECONDS (a stalled one: tokenizing has no side
    effects); one that took the request and then broke does not, and the client gets a 502
    naming it."""
    import asyncio

    seen = []

    async def refusing(request):
        seen.append(request.url.host)
        if request.url.host == "d1":
            raise httpx.ConnectError("connection refused")
        return httpx.Response(200, json={"tokens": [1], "from": request.url.host})

    async def slow(request):
        seen.append(request.url.host)
        if request.url.host == "d1":
            raise httpx.ReadTimeout("no answer")
        return httpx.Response(200, json={"tokens": [1], "from": request.url.host})

    async def broken(request):
        seen.append(request.url.host)
        raise httpx.RemoteProtocolError("peer closed connection")

    async def one(handler):
        _, http = _two_pair_router(handler)
        async with http:
            return await http.post("/tokenize", json={"prompt": "x"}, timeout=10)

    for handler in (refusing, slow):
        r = asyncio.run(one(handler))
        assert r.status_code == 200 and r.json()["from"] == "d2" and seen == ["d1", "d2"]
        seen.clear()
    r = asyncio.run(one(broken))
    assert r.status_code == 502 and "http://d1 failed: RemoteProtocolError" in r.text and seen == ["d1"]
