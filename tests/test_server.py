"""The OpenAI-compatible server, as a real subprocess on a free port, driven by the openai client."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from unittest.mock import ANY

import httpx
import openai
import pytest

MODEL = "tiny"
LONG = {"ignore_eos": True}  # extra_body: generate until max_tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*flags: str, tmpdir: Path | None = None, log: Path | None = None) -> tuple[subprocess.Popen, str]:
    """A server process; ``tmpdir`` becomes its TMPDIR (where its folder of ZMQ sockets goes);
    its output goes to ``log`` where given."""
    port = free_port()
    cmd = [sys.executable, "-m", "minengine.serve", "--port", str(port), "--log-level", "warning", *flags]
    env = None if tmpdir is None else {**os.environ, "TMPDIR": str(tmpdir)}
    url = f"http://127.0.0.1:{port}"
    # its log goes to a file (the server keeps writing it once this one is closed): a pipe nobody
    # reads would stall the server once it filled
    with tempfile.TemporaryFile(mode="w+") if log is None else open(log, "w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        deadline = time.time() + 120
        while time.time() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"server exited: {log.read()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


def run_cli(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a session of its own. Past
    ``timeout`` every process of that session (the front end, its workers, anything holding the
    pipes) writes its Python stacks (faulthandler, on SIGABRT) into the failure, and all are
    killed, as on any other way out (Ctrl-C): a hang says where it waits, and leaves nothing
    running."""
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        ps_cmd = ["ps", "-o", "pid,ppid,stat,etime,args", "-s", str(proc.pid)]
        ps = subprocess.run(ps_cmd, capture_output=True, text=True)
        # one at a time, as their dumps share the pipe; the newest first: a worker whose parent
        # went first would be ended by its parent-death signal before it wrote anything
        for line in reversed(ps.stdout.splitlines()[1:]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[0]), signal.SIGABRT)
            time.sleep(0.5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"{cmd} ran past {timeout} s; its processes:\n{ps.stdout}stderr:\n{err[-20000:]}", pytrace=False)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # (what is left of the session: none after a normal exit)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("minengine:"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_for(cond, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


# --- endpoints ---------------------------------------------------------------------------------


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server + "/health").status_code == 200


def test_completion_and_chat(client):
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, extra_body=LONG)
    assert out.object == "text_completion" and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5 and out.usage.prompt_tokens == 6  # <bos> + 5 bytes
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, extra_body=LONG
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4


@pytest.mark.parametrize("chat", [False, True])
def test_stream_equals_non_stream_with_usage(client, chat):
    kwargs = dict(model=MODEL, max_tokens=12, temperature=0, extra_body=LONG)
    if chat:
        create, args = client.chat.completions.create, dict(messages=[{"role": "user", "content": "stream me"}])
    else:
        create, args = client.completions.create, dict(prompt="stream me")
    full = create(**args, **kwargs)
    chunks = list(create(**args, **kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join((c.choices[0].delta.content or "") if chat else c.choices[0].text for c in chunks if c.choices)
    expected = full.choices[0].message.content if chat else full.choices[0].text
    assert text == expected
    with_reason = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(with_reason) == 1 and with_reason[0] is [c for c in chunks if c.choices][-1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_token_id_and_batched_prompts(client):
    ids = client.completions.create(model=MODEL, prompt=[72, 105], max_tokens=3, temperature=0, extra_body=LONG)
    assert ids.usage.prompt_tokens == 2 and len(ids.choices) == 1
    batch = client.completions.create(model=MODEL, prompt=["a", "bb", "ccc"], max_tokens=2, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    lists = client.completions.create(model=MODEL, prompt=[[72, 105], [72]], max_tokens=2, temperature=0)
    assert len(lists.choices) == 2 and lists.usage.prompt_tokens == 3


def test_n_choices(client):
    out = client.completions.create(
        model=MODEL, prompt="n test", n=3, max_tokens=6, temperature=1.0, seed=5, extra_body=LONG
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2] and out.usage.completion_tokens == 18
    streamed = client.completions.create(
        model=MODEL, prompt="n test", n=3, max_tokens=6, temperature=1.0, seed=5, extra_body=LONG, stream=True
    )
    texts = ["", "", ""]
    for chunk in streamed:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def test_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt="stop", max_tokens=12, temperature=0, extra_body=LONG)
    text = base.choices[0].text
    stop = text[3:5]
    out = client.completions.create(model=MODEL, prompt="stop", max_tokens=12, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == text[: text.find(stop)]
    assert out.choices[0].stop_reason == stop  # which one, as vLLM reports it
    assert base.choices[0].finish_reason == "length" and base.choices[0].stop_reason is None
    streamed = list(
        client.completions.create(model=MODEL, prompt="stop", max_tokens=12, temperature=0, stop=[stop], stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    assert [c.choices[0].stop_reason for c in streamed][-1] == stop
    assert all(c.choices[0].stop_reason is None for c in streamed[:-1])
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "s"}], max_tokens=12, temperature=0)
    said = client.chat.completions.create(**kwargs, extra_body=LONG).choices[0].message.content
    chat = client.chat.completions.create(**kwargs, stop=[said[3:5]])
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].stop_reason == said[3:5]
    # include_stop_str_in_output (vLLM's): the text runs to the end of the stop string
    kept = dict(model=MODEL, prompt="stop", max_tokens=12, temperature=0, stop=[stop], n=2)
    kept_body = kept | {"extra_body": {"include_stop_str_in_output": True}}
    out = client.completions.create(**kept_body)
    want = text[: text.find(stop) + len(stop)]
    assert [(c.text, c.finish_reason, c.stop_reason) for c in out.choices] == [(want, "stop", stop)] * 2
    streamed = list(client.completions.create(**kept_body, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices[0].index == 1) == want


def test_seeds(client):
    def run(seed):
        kwargs = dict(model=MODEL, prompt="seeded", max_tokens=10, temperature=1.0, seed=seed, extra_body=LONG)
        return client.completions.create(**kwargs).choices[0].text

    assert run(11) == run(11)
    assert run(11) != run(12)


# --- errors --------------------------------------------------------------------------------------


BAD = [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -5}, "top_k"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "", "add_special_tokens": False}, "prompt"),  # no tokens ("" alone runs as its BOS)
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [5, 999999]}, "prompt"),
    ({"prompt": [5] * 4000, "max_tokens": 200}, "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": 5}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "echo": 1}, "echo"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    # seeds torch cannot take used to kill the scheduler (choice j of n samples with seed + j)
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    ({"prompt": "x", "seed": 2**64 - 1, "n": 2}, "seed"),
    # JSON types as given: true is not 1
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": [True, 5]}, "prompt"),
    ({"prompt": "x", "n": 1.5}, "n"),
    ({"prompt": "hi \ud800 there"}, "prompt"),  # a lone surrogate: not text a tokenizer takes
    # one call starts at most 2048 sequences, n at most 128 (a huge n used to stall the server)
    ({"prompt": "x", "n": 10_000_000}, "n"),
    ({"prompt": ["x"] * 17, "n": 128}, "n"),
    # logit adjustments out of their ranges
    ({"prompt": "x", "logit_bias": {"65": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"10000": 1}}, "logit_bias"),  # past the tiny model's vocabulary
    ({"prompt": "x", "logit_bias": {"65": "up"}}, "logit_bias"),
    ({"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
    ({"prompt": "x", "presence_penalty": -3}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "min_tokens": 17}, "min_tokens"),
    ({"prompt": "x", "min_tokens": False}, "min_tokens"),
    # sampling fields of OpenAI / vLLM minengine does not implement: refused, never ignored
    ({"prompt": "x", "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "suffix": "end"}, "suffix"),
    # vLLM's allowed_token_ids and bad_words out of their ranges
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "x", "allowed_token_ids": [65, 260]}, "allowed_token_ids"),  # past the tiny model's vocabulary
    ({"prompt": "x", "allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"prompt": "x", "allowed_token_ids": [259], "min_tokens": 3}, "allowed_token_ids"),  # all end tokens
    ({"prompt": "x", "stop_token_ids": [-5]}, "stop_token_ids"),
    ({"prompt": "x", "bad_words": "no"}, "bad_words"),
    ({"prompt": "x", "bad_words": ["no", " "]}, "bad_words"),
    ({"prompt": "x", "bad_words": ["w"] * 129}, "bad_words"),
    ({"prompt": "x", "bad_words": ["w" * 1025]}, "bad_words"),
    ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt": "x", "truncate_prompt_tokens": 100_000}, "truncate_prompt_tokens"),  # past the context length
]

# (body, the message it must give): what was wrong, and with what value
MESSAGES = [
    ({"prompt": "x", "n": 10_000_000}, "n is 10000000; allowed: 1..128"),
    ({"prompt": ["x"] * 17, "n": 128}, "17 prompts x n 128 = 2176 sequences; allowed: at most 2048"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens is 1.5: input should be a valid integer"),
    ({"prompt": [1.5]}, "prompt is [1.5]; allowed: a string, a list of strings, a list of token ids, or a list of"),
    ({"prompt": "x", "stop": 5}, "stop is 5; allowed: a string or a list of strings"),
    ({"prompt": "x", "suffix": "end"}, 'suffix is "end"; minengine does not support it'),
    ({"prompt": "x", "logit_bias": {"65": 101}}, "logit_bias of token 65 is 101"),
    ({"prompt": "x", "logit_bias": {"6x": 1}}, 'logit_bias has key "6x"; allowed: token ids (integers, as strings)'),
    ({"prompt": "x", "logit_bias": {"10000": 1}}, "logit_bias token id 10000 is outside the vocabulary [0, 260)"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens is 5; allowed: an integer in [0, max_tokens]"),
    ({"prompt": "x", "logit_bias": {"1" * 5000: 1}}, 'logit_bias has key "11111'),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids is []; allowed: None or a non-empty list"),
    (
        {"prompt": "x", "allowed_token_ids": [65, 260]},
        "allowed_token_ids has token id 260, outside the vocabulary [0, 260)",
    ),
    ({"prompt": "x", "bad_words": ["ok", "\t"]}, "bad_words has '\\t'; allowed: strings with a character that is not"),
    ({"prompt": "x", "bad_words": ["w"] * 129}, "bad_words is ['w', 'w'"),
    ({"prompt": "x", "bad_words": ["w" * 1025]}, "bad_words take 1025 tokens; allowed: at most 1024"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p + str(i) for i, (_, p) in enumerate(BAD)])
def test_bad_completion_requests(server, body, param):
    # json.dumps escapes what httpx would not send (a lone surrogate)
    content = json.dumps({"model": MODEL, **body})
    r = httpx.post(server + "/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == 400 and error["type"] == "BadRequestError"
    assert error["message"]
    assert httpx.get(server + "/health").status_code == 200


@pytest.mark.parametrize(("body", "message"), MESSAGES)
def test_errors_name_the_value(server, body, message):
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), r.text


def test_off_values_of_unsupported_fields_and_unknown_fields_pass(client):
    extra = {"length_penalty": 1, "use_beam_search": False, "suffix": "", "bad_words": [], "user": "me"}
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=LONG | extra)
    assert out.usage.completion_tokens == 2
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2, extra_body=LONG | {"best_of": 2})
    assert len(out.choices) == 2


def test_non_json_numbers_routing_errors_and_content_parts(server):
    raw = b'{"prompt": "x", "temperature": Infinity}'
    r = httpx.post(server + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "Infinity is not a JSON number" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/nothing", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = httpx.delete(server + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405 and r.headers["allow"] == "POST"

    def chat(content, **body):
        return httpx.post(
            server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]} | body
        )

    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    joined = chat("hi\nthere", max_tokens=1).json()["usage"]["prompt_tokens"]
    assert chat(parts, max_tokens=1).json()["usage"]["prompt_tokens"] == joined  # joined by newlines, as vLLM
    r = chat([{"type": "image_url", "image_url": {"url": "x"}}])
    assert r.status_code == 400 and r.json()["error"]["message"].startswith('messages.0.content.0.type is "image_url"')
    r = chat([{"type": "text"}])
    assert r.status_code == 400 and "messages.0.content.0.text" in r.json()["error"]["message"]
    for body, name in (({"response_format": {"type": "json_schema"}}, "response_format"), ({"tools": [{}]}, "tools")):
        r = chat("x", **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == name
    r = chat("x", max_completion_tokens=10_000)
    assert r.status_code == 400 and "max_completion_tokens (10000)" in r.json()["error"]["message"]
    r = chat("x" * 5000)  # no max given: the messages alone must leave room for a token
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("the messages take")


def test_null_means_the_default_and_numbers_must_be_finite(server, client):
    """The openai SDK sends a parameter given as None as null: as vLLM, that is the default."""
    fields = ("temperature", "top_p", "top_k", "min_p", "n", "stream", "ignore_eos", "seed", "stop")
    nulls = dict.fromkeys(fields, None) | {"stream_options": None, "presence_penalty": None}
    out = client.completions.create(model=MODEL, prompt="ab", max_tokens=3, temperature=None, top_p=None, n=None)
    assert len(out.choices) == 1 and out.usage.completion_tokens == 3
    r = httpx.post(server + "/v1/completions", json={"prompt": "ab", "max_tokens": 3, "echo": None} | nulls)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    chat = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2}
    r = httpx.post(server + "/v1/chat/completions", json=chat | nulls | {"logprobs": None, "max_tokens": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    stream = {"prompt": "ab", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": None}}
    r = httpx.post(server + "/v1/completions", json=stream)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]") and '"usage": {' not in r.text
    for body, param in (({"prompt": None}, "prompt"), ({"prompt": "x", "stop_token_ids": [None]}, "stop_token_ids")):
        r = httpx.post(server + "/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    raw = b'{"prompt": "x", "temperature": 1e400}'
    r = httpx.post(server + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and '"1e400" is out of range' in r.json()["error"]["message"]


def test_bad_chat_requests_are_400s(server):
    def post(**body):
        return httpx.post(server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]} | body)

    r = post(max_completion_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    assert r.json()["error"]["message"].startswith("max_completion_tokens is 0")
    body = json.dumps({"messages": [{"role": "user", "content": "a \ud800 b"}]})
    r = httpx.post(server + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = post(seed=2**64, max_tokens=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(server + "/v1/completions", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    assert httpx.get(server + "/health").status_code == 200


def test_seeds_at_the_ends_of_their_range(client):
    for seed, n in ((2**64 - 2, 2), (-(2**63), 1)):
        out = client.completions.create(model=MODEL, prompt="edge", max_tokens=3, seed=seed, n=n, extra_body=LONG)
        assert [c.finish_reason for c in out.choices] == ["length"] * n


def test_cached_tokens_count_each_prompt_once(client):
    prompt = "a prompt long enough to fill several pages of the prefix cache " * 4
    for stream in (False, True):
        for _ in range(2):
            kwargs = dict(model=MODEL, prompt=prompt, max_tokens=2, n=4, extra_body=LONG)
            if stream:
                chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
                usage = chunks[-1].usage
            else:
                usage = client.completions.create(**kwargs).usage
            assert usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
        assert usage.prompt_tokens_details.cached_tokens > 0  # the second time, the prompt was cached


def test_penalties_logit_bias_and_min_tokens(client):
    """The OpenAI fields and vLLM's give the offline LLM's tokens; a stop string cannot end in the
    text of the first min_tokens tokens (the front end makes the text), streamed or not."""
    from minengine import LLM, SamplingParams

    fields = dict(frequency_penalty=0.8, presence_penalty=0.5, logit_bias={"65": 4.0, "100": -100})
    extra = {"repetition_penalty": 1.3, "ignore_eos": True}
    llm = LLM("tiny", page_size=4, max_total_tokens=256)
    adjusted = SamplingParams(
        temperature=0,
        max_tokens=10,
        frequency_penalty=0.8,
        presence_penalty=0.5,
        logit_bias={65: 4.0, 100: -100},
        repetition_penalty=1.3,
        ignore_eos=True,
    )
    (ref,) = llm.generate("penalties", adjusted, use_tqdm=False)
    chat_prompt = llm.tokenizer.render_chat([{"role": "user", "content": "p"}])
    chat_ids = llm.tokenizer.encode(chat_prompt, add_special_tokens=False)  # as the server encodes it
    (chat_ref,) = llm.generate({"prompt_token_ids": chat_ids}, adjusted, use_tqdm=False)
    (free,) = llm.generate("penalties", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    assert ref.token_ids != free.token_ids and 100 not in ref.token_ids
    out = client.completions.create(
        model=MODEL, prompt="penalties", max_tokens=10, temperature=0, **fields, extra_body=extra
    )
    assert out.choices[0].text == ref.text
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "p"}],
        max_tokens=10,
        temperature=0,
        **fields,
        extra_body=extra,
    )
    assert chat.choices[0].message.content == chat_ref.text
    stop = free.text[:1]
    held = dict(model=MODEL, prompt="penalties", max_tokens=10, temperature=0, stop=[stop], extra_body=LONG)
    assert client.completions.create(**held).choices[0].text == ""
    held["extra_body"] = LONG | {"min_tokens": 10}
    out = client.completions.create(**held)
    assert out.choices[0].text == free.text and out.choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in client.completions.create(**held, stream=True)) == free.text
    why = r"min_tokens is 5; allowed: an integer in \[0, max_completion_tokens\] = \[0, 4\]"
    with pytest.raises(openai.BadRequestError, match=why):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "p"}],
            max_completion_tokens=4,
            extra_body={"min_tokens": 5},
        )


def test_allowed_token_ids_and_bad_words(client):
    """vLLM's fields through both APIs give the offline LLM's tokens: the output stays inside the
    allowed tokens, and never has a bad word in it, though "a" (97) is biased to come every time."""
    from minengine import LLM, SamplingParams

    allowed = [32, *range(97, 110)]
    fields = {"allowed_token_ids": allowed, "bad_words": ["aa", "ha"], "logit_bias": {"97": 20}, "ignore_eos": True}
    p = SamplingParams(
        temperature=0,
        max_tokens=12,
        allowed_token_ids=allowed,
        bad_words=["aa", "ha"],
        logit_bias={97: 20},
        ignore_eos=True,
    )
    llm = LLM("tiny", page_size=4, max_total_tokens=256)
    (ref,) = llm.generate("bad words", p, use_tqdm=False)
    chat_prompt = llm.tokenizer.render_chat([{"role": "user", "content": "w"}])
    chat_ids = llm.tokenizer.encode(chat_prompt, add_special_tokens=False)
    (chat_ref,) = llm.generate({"prompt_token_ids": chat_ids}, p, use_tqdm=False)
    llm.shutdown()
    text = ref.outputs[0].text
    assert set(text) <= {chr(t) for t in allowed} and "aa" not in text and "ha" not in text
    assert text.count("a") == 6  # every other token
    out = client.completions.create(model=MODEL, prompt="bad words", max_tokens=12, temperature=0, extra_body=fields)
    assert out.choices[0].text == text
    streamed = client.completions.create(
        model=MODEL, prompt="bad words", max_tokens=12, temperature=0, extra_body=fields, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w"}], max_tokens=12, temperature=0, extra_body=fields
    )
    assert chat.choices[0].message.content == chat_ref.outputs[0].text


def test_special_tokens_in_the_text_with_skip_special_tokens_false(client):
    """vLLM's skip_special_tokens: False puts special tokens in the text, offline and served,
    streamed or not; the end-of-sequence token that ends the output stays out, as in vLLM, unless
    include_stop_str_in_output."""
    from minengine import LLM, SamplingParams

    start, end = "<|im_start|>", "<|end_of_text|>"  # the tiny tokenizer's 258 and 257 (its EOS)
    kept = SamplingParams(temperature=0, max_tokens=6, logit_bias={258: 100}, skip_special_tokens=False)
    ended = SamplingParams(
        temperature=0, max_tokens=6, min_tokens=2, logit_bias={257: 100, 258: 50}, skip_special_tokens=False
    )
    llm = LLM("tiny", page_size=4, max_total_tokens=256)
    try:
        texts = [o.outputs[0].text for o in llm.generate(["s"] * 2, [kept, ended], use_tqdm=False)]
        skipped = llm.generate("s", replace(kept, skip_special_tokens=True), use_tqdm=False)[0].outputs[0].text
        shown = replace(ended, include_stop_str_in_output=True)
        with_end = llm.generate("s", shown, use_tqdm=False)[0].outputs[0].text
    finally:
        llm.shutdown()
    assert texts == [start * 6, start * 2] and skipped == "" and with_end == start * 2 + end
    for stream in (False, True):
        extra = {"logit_bias": {"258": 100}, "skip_special_tokens": False}
        kwargs = dict(model=MODEL, prompt="s", max_tokens=6, temperature=0, extra_body=extra, stream=stream)
        out = client.completions.create(**kwargs)
        assert ("".join(c.choices[0].text for c in out) if stream else out.choices[0].text) == texts[0]
        extra = {"logit_bias": {"257": 100, "258": 50}, "min_tokens": 2, "skip_special_tokens": False}
        out = client.completions.create(**kwargs | {"extra_body": extra})
        assert ("".join(c.choices[0].text for c in out) if stream else out.choices[0].text) == texts[1]


def test_truncate_prompt_tokens(client, server):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens run (a text's BOS stays, as vLLM's
    tokenizer truncates; usage counts them; echo shows them), in both APIs; out of range, a 400."""
    prompt = "a prompt that is longer than what the request keeps of it"
    base = dict(model=MODEL, max_tokens=1, temperature=0, echo=True, logprobs=0)
    bos = "<|begin_of_text|>"  # the tiny tokenizer: a byte a token, after its BOS
    for given, ran in ((prompt, [bos, *prompt[-6:]]), ([256, *prompt.encode()], list(prompt[-7:]))):
        out = client.completions.create(prompt=given, **base, extra_body={"truncate_prompt_tokens": 7})
        choice = out.choices[0]
        assert out.usage.prompt_tokens == 7 and choice.logprobs.tokens[:7] == ran
        assert choice.text.startswith(prompt[-6:] if given == prompt else prompt[-7:])
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": prompt}],
        model=MODEL,
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 5},
    )
    assert chat.usage.prompt_tokens == 5
    r = httpx.post(
        server + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "truncate_prompt_tokens": -3},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    assert r.json()["error"]["message"].startswith("truncate_prompt_tokens is -3; allowed: None, -1")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_long_prompt_is_tokenized_off_the_event_loop(server, path):
    """A 3.6 MB prompt (about 2.5 s of tokenizing on this CPU, cut to its last 10 tokens): health
    checks and other requests are answered meanwhile (on the event loop, each waited for all of
    it: 1.9 s for a 1.2 MB prompt)."""
    text = "hello world " * 300_000
    body = {"max_tokens": 1, "truncate_prompt_tokens": 10}
    body |= {"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}

    async def run() -> tuple[float, float, httpx.Response]:
        async with httpx.AsyncClient(base_url=server, timeout=120) as h:
            big = asyncio.create_task(h.post(path, json=body))
            worst, start = 0.0, time.monotonic()
            while not big.done():
                t = time.monotonic()
                await h.get("/health")
                worst = max(worst, time.monotonic() - t)
                await asyncio.sleep(0.02)
            return worst, time.monotonic() - start, await big

    worst, took, r = asyncio.run(run())
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10, r.text
    assert took > 1.0 and worst < min(0.5, took / 3), (worst, took)


def test_a_stop_token_is_not_in_the_text(client):
    """As in vLLM (and the offline LLM): a stop token id ends the output, counts as a completion
    token, and adds no text."""
    from minengine import LLM, SamplingParams

    llm = LLM("tiny", page_size=4, max_total_tokens=256)
    (ref,) = llm.generate("stop token", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    stop_id = ref.token_ids[4]
    first = ref.token_ids.index(stop_id)
    kwargs = dict(model=MODEL, prompt="stop token", max_tokens=10, temperature=0)
    kwargs["extra_body"] = {"stop_token_ids": [stop_id]}
    out = client.completions.create(**kwargs)
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == first + 1
    assert out.choices[0].stop_reason == stop_id
    assert out.choices[0].text == llm.tokenizer.decode(ref.token_ids[:first])
    streamed = client.completions.create(**kwargs, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    kwargs["extra_body"] |= {"stop": ["\x00never"]}  # text made token by token
    assert client.completions.create(**kwargs).choices[0].text == out.choices[0].text
    # the EOS listed among them: it ends the output as the EOS (no stop_reason), as in vLLM
    eos = llm.tokenizer.eos_token_id
    body = {"stop_token_ids": [eos], "allowed_token_ids": [eos]}
    (choice,) = client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=body).choices
    assert (choice.finish_reason, choice.stop_reason) == ("stop", None)
    # the model's other end token (tiny's <|im_end|>): its id is the stop_reason, as in vLLM
    from minengine.models import load_model_config

    (end,) = set(load_model_config("tiny").eos_token_ids) - {eos}
    body = {"allowed_token_ids": [end]}
    (choice,) = client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=body).choices
    assert (choice.finish_reason, choice.stop_reason) == ("stop", end)


def test_chat_without_max_tokens_fits_a_kv_pool_smaller_than_the_context():
    """max_tokens defaults to all the room left: the context or, when smaller, the KV pool. As
    vLLM: in chat when left out or null; in completions when null (left out: 16), each prompt's own."""
    proc, url = start_server("--page-size", "4", "--max-total-tokens", "512")
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        body = {"prompt": [[5] * 480, [6] * 500], "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body | {"max_tokens": None}, timeout=120)
        assert [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 2
        assert r.json()["usage"]["completion_tokens"] == 32 + 12
        r = httpx.post(url + "/v1/completions", json=body | {"prompt": [5] * 480}, timeout=120)
        assert r.json()["usage"]["completion_tokens"] == 16  # left out
        r = httpx.post(url + "/v1/completions", json={"prompt": [5] * 480, "max_tokens": None, "min_tokens": 40})
        error = r.json()["error"]
        assert error["param"] == "min_tokens" and error["message"].endswith("[0, max_tokens] = [0, 32]")
        chat = {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 600}
        error = httpx.post(url + "/v1/chat/completions", json=chat).json()["error"]
        assert error["param"] == "min_tokens" and "[0, max_tokens] = [0, " in error["message"]
        r = httpx.post(url + "/v1/completions", json={"prompt": [5] * 512, "max_tokens": None})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        message = r.json()["error"]["message"]
        assert message.startswith("the prompt takes 512 tokens, leaving no room to generate; allowed: at most 511")
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 600}]})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("the messages take")
    finally:
        stop_server(proc)


def test_context_length_error_names_both_numbers(server):
    r = httpx.post(server + "/v1/completions", json={"prompt": [5] * 4000, "max_tokens": 200})
    assert re.search(r"4000 tokens.*max_tokens \(200\).*4200.*context length 4096", r.json()["error"]["message"])


def test_malformed_json_unknown_model_and_chat_errors(server, client):
    r = httpx.post(server + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = httpx.post(server + "/v1/chat/completions", json={"messages": [], "max_tokens": 3})
    assert r.status_code == 400
    r = httpx.post(server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "top_p": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    r = httpx.post(server + "/v1/completions", json={"prompt": "x", "best_of": 2})
    assert r.json()["error"]["message"] == "best_of is 2; minengine does not support it (allowed: 1)"
    assert client.completions.create(model=MODEL, prompt="still serving", max_tokens=2).choices


# --- load, aborts, metrics -------------------------------------------------------------------------


def test_256_concurrent_streams_deliver_every_token(server):
    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, str, int]:
        body = {"prompt": f"request {i}", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
        body["stream_options"] = {"include_usage": True}
        text, reason, tokens = "", None, 0
        async with http.stream("POST", server + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text += chunk["choices"][0]["text"]
                    reason = chunk["choices"][0]["finish_reason"] or reason
                else:
                    tokens = chunk["usage"]["completion_tokens"]
        return tokens, reason, len(text)

    async def all_of_them():
        limits = httpx.Limits(max_connections=300)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            return await asyncio.gather(*(one(http, i) for i in range(256)))

    before = metrics(server)["minengine:generation_tokens_total"]
    results = asyncio.run(all_of_them())
    assert all(tokens == 8 and reason == "length" for tokens, reason, _ in results)
    assert metrics(server)["minengine:generation_tokens_total"] - before == 256 * 8


def test_disconnects_abort_and_free_kv(server):
    async def read_a_little_then_leave(http: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"long {i}", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        async with http.stream("POST", server + "/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break  # closing the stream drops the connection

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            await asyncio.gather(*(read_a_little_then_leave(http, i) for i in range(8)))

    aborted_before = metrics(server).get("minengine:num_aborted_requests_total", 0)
    asyncio.run(run())
    assert wait_for(
        lambda: (m := metrics(server))["minengine:num_requests_running"] == 0 and m["minengine:kv_pages_in_use"] == 0
    ), metrics(server)
    assert metrics(server)["minengine:num_aborted_requests_total"] - aborted_before == 8
    # a non-streaming client that leaves is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server + "/v1/completions", json={"prompt": "x", "max_tokens": 3000, "ignore_eos": True}, timeout=0.5
        )
    assert wait_for(lambda: metrics(server)["minengine:num_requests_running"] == 0)
    assert metrics(server)["minengine:kv_pages_in_use"] == 0


def test_metrics_are_consistent(server, client):
    m0 = metrics(server)
    out = client.completions.create(model=MODEL, prompt="metrics!", max_tokens=7, temperature=0, extra_body=LONG)
    m1 = metrics(server)
    assert m1["minengine:prompt_tokens_total"] - m0["minengine:prompt_tokens_total"] == out.usage.prompt_tokens
    assert m1["minengine:generation_tokens_total"] - m0["minengine:generation_tokens_total"] == 7
    key = 'minengine:request_success_total{finished_reason="length"}'
    assert m1[key] - m0[key] == 1
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert m1[f"minengine:{name}_count"] > m0.get(f"minengine:{name}_count", 0)
    for gauge in ("num_requests_waiting", "kv_pages_total", "kv_pages_cached"):
        assert f"minengine:{gauge}" in m1
    assert m1["minengine:kv_pages_total"] == 65536 // 4
    again = client.completions.create(model=MODEL, prompt="metrics!", max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert metrics(server)["minengine:prefix_cache_hit_tokens_total"] > m1["minengine:prefix_cache_hit_tokens_total"]


# --- process lifecycle -----------------------------------------------------------------------------


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def ipc_dirs(tmpdir: Path) -> list[Path]:
    from minengine.server.scheduler_process import IPC_DIR_PREFIX

    return [p for p in tmpdir.iterdir() if p.name.startswith(IPC_DIR_PREFIX)]


def test_sigterm_aborts_in_flight_and_exits_cleanly(tmp_path):
    proc, url = start_server(tmpdir=tmp_path)
    kids = children(proc.pid)
    assert kids
    assert len(ipc_dirs(tmp_path)) == 1
    reasons = []

    async def stream():
        body = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=30) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    if not reasons:  # the stream is flowing: stop the server under it
                        proc.send_signal(signal.SIGTERM)
                    reasons.append(json.loads(line[6:])["choices"][0]["finish_reason"])

    t0 = time.time()
    asyncio.run(stream())
    proc.wait(10)
    assert time.time() - t0 < 10
    assert reasons[-1] == "abort"
    assert proc.returncode == 0
    assert wait_for(lambda: not any(alive(k) for k in kids), 5)
    assert ipc_dirs(tmp_path) == []


def test_a_dead_scheduler_ends_its_requests_and_the_server(tmp_path):
    """The scheduler process killed under a stream and a plain request: both end with an error
    (the stream with an error event, then [DONE]; the plain one 500), and the server exits with
    code 1 and the reason, removing its folder of sockets: as vLLM's and SGLang's servers exit when
    their engine dies, so that a supervisor starts a new one."""
    proc, url = start_server(tmpdir=tmp_path, log=tmp_path / "log")
    try:
        (kid,) = [k for k in children(proc.pid) if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
        lines: list[str] = []
        flowing = threading.Event()

        def stream() -> None:
            body = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    flowing.set()
                    lines.append(line)

        reader = threading.Thread(target=stream)
        reader.start()
        assert flowing.wait(60)
        plain = {}
        body = {"prompt": "y", "max_tokens": 3000, "ignore_eos": True}
        poster = threading.Thread(
            target=lambda: plain.update(r=httpx.post(url + "/v1/completions", json=body, timeout=30))
        )
        poster.start()
        time.sleep(0.5)
        os.kill(kid, signal.SIGKILL)
        reader.join(20)
        poster.join(20)
        assert not reader.is_alive() and not poster.is_alive()
        data = [line[6:] for line in lines if line.startswith("data: ")]
        assert data[-1] == "[DONE]" and "a scheduler process exited" in json.loads(data[-2])["error"]["message"]
        assert plain["r"].status_code == 500 and "a scheduler process exited" in plain["r"].text
        assert proc.wait(20) == 1
        assert "error: a scheduler process exited" in (tmp_path / "log").read_text()
        assert ipc_dirs(tmp_path) == []
    finally:
        stop_server(proc)


# SIGTERM comes 1 s after the request; the server then waits up to 5 s for the requests it
# accepted, and uvicorn 3 s more. A render of 6.5 s ends 5.5 s after the signal: past uvicorn's 3 s
# alone (the drain must wait for it), inside 8 (2.5 s of slack either way for a loaded machine)
@pytest.mark.parametrize(("stream", "seconds"), [(True, 6.5), (False, 2.0)])
def test_sigterm_waits_for_a_request_still_rendering_its_template(tmp_path, stream, seconds):
    """A request accepted before SIGTERM but still rendering its own chat template (it has not
    reached the scheduler yet) is waited for, and ends as the in-flight ones do: finish_reason
    "abort" (a stream's with [DONE]), not a connection cut by the server's exit."""
    messages = [{"role": "user", "content": "hi"}]

    def template(n: int) -> str:
        return "{% for i in range(" + str(n) + ") %}{% for j in range(10000) %}{% endfor %}{% endfor %}{{ 'x' }}"

    proc, url = start_server("--trust-request-chat-template", tmpdir=tmp_path)
    try:

        def timed(n: int, **extra) -> float:
            body = {"messages": messages, "chat_template": template(n), "max_tokens": 1, **extra}
            t0 = time.perf_counter()
            assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
            return time.perf_counter() - t0

        timed(10)  # the server's first render, then how long 200 more loops take there
        per_loop = max(timed(210) - timed(10), 1e-3) / 200
        body = {"messages": messages, "chat_template": template(int(seconds / per_loop)), "stream": stream}
        threading.Timer(1.0, proc.send_signal, (signal.SIGTERM,)).start()
        r = httpx.post(url + "/v1/chat/completions", json=body | {"max_tokens": 3}, timeout=30)
        assert r.status_code == 200, r.text
        if stream:
            lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort"
        else:
            assert r.json()["choices"][0]["finish_reason"] == "abort"
        proc.wait(15)
        assert proc.returncode == 0
    finally:
        stop_server(proc)


def test_shutting_down_answers_503():
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from minengine.models.tiny import tiny_tokenizer
    from minengine.server.api import ServerState, build_app
    from minengine.server.metrics import Metrics
    from minengine.server.protocol import Ready

    client = SimpleNamespace(ready=Ready(260, 4096, 65536), dead=None, shutdown=lambda: None)
    state = ServerState(client, tiny_tokenizer(), MODEL, Metrics())
    app = build_app(state)
    app.get("/inflight")(lambda: state.inflight)  # what a request sees counted while it runs
    http = TestClient(app)
    assert http.get("/health").status_code == 200
    assert http.get("/inflight").json() == 1 and state.inflight == 0
    asyncio.run(state.begin_shutdown())
    assert http.get("/health").status_code == 503
    r = http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    # requests that come once shutdown began (answered 503) are not counted: the drain waits
    # only for those it accepted, however many keep coming
    assert http.get("/inflight").json() == 0


def _app_with_access(flags: list[str]):
    """The API (over a stand-in scheduler client) behind the access control that ``flags`` ask for."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from minengine.models.tiny import tiny_tokenizer
    from minengine.serve import parse_args
    from minengine.server.access import add_access_control
    from minengine.server.api import ServerState, build_app
    from minengine.server.metrics import Metrics
    from minengine.server.protocol import Ready

    client = SimpleNamespace(ready=Ready(260, 4096, 65536), dead=None, shutdown=lambda: None)
    app = build_app(ServerState(client, tiny_tokenizer(), MODEL, Metrics()))
    add_access_control(app, parse_args(flags)[0])
    return TestClient(app)


def test_an_api_key_guards_the_v1_routes_as_in_vllm(monkeypatch):
    http = _app_with_access(["--api-key", "sesame"])
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
        r = http.get("/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError", r.text
        assert "Authorization: Bearer <key>" in r.json()["error"]["message"]
        assert http.post("/v1/completions", json={"prompt": "x"}, headers=headers).status_code == 401
    assert http.get("/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
    for path in ("/health", "/metrics", "/version"):  # (open, as vLLM's)
        assert http.get(path).status_code == 200, path
    monkeypatch.setenv("MINENGINE_API_KEY", "from-env")  # (a key on the command line shows in ps)
    http = _app_with_access([])
    assert http.get("/v1/models").status_code == 401
    assert http.get("/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200


def test_cors_as_in_vllm():
    """vLLM's defaults: any origin, method and header; a browser's preflight passes the key check,
    and a 401 carries the CORS headers (the page can read it)."""
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
    http = _app_with_access([])
    r = http.options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    http = _app_with_access(["--allowed-origins", '["http://ui.example"]', "--api-key", "k"])
    r = http.options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
    r = http.get("/v1/models", headers={"Origin": "http://ui.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://ui.example"
    r = http.options("/v1/chat/completions", headers={**preflight, "Origin": "http://other.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--allowed-origins", "*"], "argument --allowed-origins: '*'; allowed: a JSON list of strings"),
        (["--allowed-headers", "[1]"], "argument --allowed-headers: '[1]'; allowed: a JSON list of strings"),
        (["--api-key", " "], "argument --api-key: ' ' is empty; allowed: a non-empty key"),
    ],
)
@pytest.mark.parametrize("prog", ["serve", "router"])
def test_bad_access_flags_exit_with_one_line(flags, message, prog, capsys):
    from minengine import router, serve

    argv = [*flags] if prog == "serve" else ["--prefill", "http://a", "--decode", "http://b", *flags]
    with pytest.raises(SystemExit) as exc:
        (serve.parse_args if prog == "serve" else router.parse_args)(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1 and message in lines[0], lines


def test_the_openai_client_with_a_key_and_a_router_that_passes_it_on():
    from minengine.router import Backend, Router

    proc, url = start_server("--api-key", "sesame")
    try:
        ok = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0).models.list()

        async def through_router() -> int:
            router = Router([Backend(url, 8998)], [Backend(url)], api_key="sesame")
            try:
                return (await router.client.get(url + "/v1/models")).status_code
            finally:
                await router.close()

        assert asyncio.run(through_router()) == 200
    finally:
        stop_server(proc)


BOOT = {"bootstrap_host": "10.0.0.7", "bootstrap_port": 9000, "bootstrap_room": 42}


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ("completions", {"prompt": "x", "prompt_logprobs": 0}, "prompt_logprobs"),
        ("completions", {"prompt": "x", "echo": True, "logprobs": 1}, "logprobs"),
        ("completions", {"prompt": "", "add_special_tokens": False, "max_tokens": 2}, "prompt"),
        ("completions", {"prompt": "x" * 5000, "max_tokens": 2}, "prompt"),
        ("completions", {"prompt": "x", "model": "other"}, "model"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x" * 5000}]}, "messages"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 2}, "top_p"),
        ("completions", {"prompt": "x", "logprobs": 0}, "logprobs"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ],
)
def test_a_refused_disaggregated_request_tells_the_other_server(mode, path, body, param):
    """The other server waits for this request's half: every 400 (404) after the body parsed
    tells it at once, with the reason, instead of leaving it to the bootstrap timeout."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from minengine.models.tiny import tiny_tokenizer
    from minengine.server.api import ServerState, build_app
    from minengine.server.metrics import Metrics
    from minengine.server.protocol import Bootstrap, Ready

    told = []
    fail_room = lambda bootstrap, reason: told.append((bootstrap, reason))  # noqa: E731
    client = SimpleNamespace(ready=Ready(260, 4096, 4096), dead=None, fail_room=fail_room)
    http = TestClient(build_app(ServerState(client, tiny_tokenizer(), MODEL, Metrics(), mode=mode)))
    r = http.post(f"/v1/{path}", json=body | BOOT)
    error = r.json()["error"]
    assert r.status_code in (400, 404) and error["param"] == param, r.text
    assert told == [(Bootstrap("10.0.0.7", 9000, 42), error["message"])]
    # no room, or no address on a decode server: nobody to tell
    told.clear()
    r = http.post(f"/v1/{path}", json=body | {"bootstrap_host": "10.0.0.7", "bootstrap_port": 9000})
    assert r.status_code in (400, 404) and told == []
    r = http.post(f"/v1/{path}", json=body | {"bootstrap_room": 42})
    assert r.status_code in (400, 404) and told == ([] if mode == "decode" else [(Bootstrap("", 0, 42), ANY)])


def test_a_request_takes_the_generation_config_defaults_for_what_it_leaves_out():
    """The model's generation_config.json sampling fields (``ServerState.sampling_defaults``)
    stand in for the fields a request leaves out or sends as null, not for those it gives."""
    from minengine.server.api import ChatCompletionRequest, CompletionRequest, sampling_params

    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    for cls, extra in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": []})):
        p = sampling_params(cls.model_validate(extra), 16, defaults=defaults)
        assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.6, 0.95, 20, 0.0)
        req = cls.model_validate(extra | {"temperature": 1.0, "top_k": None, "min_p": 0.1})
        p = sampling_params(req, 16, defaults=defaults)
        assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 0.95, 20, 0.1)
        p = sampling_params(cls.model_validate(extra), 16)
        assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, -1)
    # through the app: both endpoints hand the scheduler the state's defaults
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from minengine.models.tiny import tiny_tokenizer
    from minengine.server.api import ServerState, build_app
    from minengine.server.metrics import Metrics
    from minengine.server.protocol import Ready, TokenUpdate

    submitted = []

    def submit(rid, prompt_ids, params, bootstrap):
        submitted.append(params)
        queue = asyncio.Queue()
        queue.put_nowait(TokenUpdate(rid, [65], "length"))
        return queue

    client = SimpleNamespace(ready=Ready(260, 4096, 65536), dead=None, submit=submit, release=lambda rid: None)
    http = TestClient(build_app(ServerState(client, tiny_tokenizer(), MODEL, Metrics(), sampling_defaults=defaults)))
    assert http.post("/v1/completions", json={"prompt": "x", "top_p": 0.5}).status_code == 200
    chat = {"messages": [{"role": "user", "content": "x"}], "temperature": None}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    assert [(p.temperature, p.top_p, p.top_k) for p in submitted] == [(0.6, 0.5, 20), (0.6, 0.95, 20)]


def test_scheduler_exits_when_front_end_dies(tmp_path):
    proc, _ = start_server(tmpdir=tmp_path)
    kids = children(proc.pid)
    assert len(ipc_dirs(tmp_path)) == 1
    proc.kill()
    proc.wait()
    assert wait_for(lambda: not any(alive(k) for k in kids), 10)
    # the front end could not remove its folder of sockets; the worker it left did
    assert ipc_dirs(tmp_path) == []


# --- CLI -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--page-size", "0"], "argument --page-size: page_size is 0; allowed: an integer >= 1"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--port", "70000"], "argument --port: 70000 is out of range; allowed: 1..65535"),
        (["--chunked-prefill-size", "abc"], "argument --chunked-prefill-size: invalid int value"),
        (["--mem-fraction-static", "2"], "argument --mem-fraction-static: mem_fraction_static is 2.0"),
        (["--chat-template", "chat.jinja"], "argument --chat-template: 'chat.jinja' is no file, nor a template"),
        (["--chat-template", "{% if %}"], "argument --chat-template: the template does not parse"),
        (["--response-role", ""], "argument --response-role: '' is empty"),
    ],
)
def test_bad_flags_exit_with_one_line(flags, message):
    r = run_cli([sys.executable, "-m", "minengine.serve", *flags], timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr


@pytest.mark.parametrize(
    ("flags", "code", "message"),
    [
        (["--model", "/nonexistent"], 2, "error: argument --model: cannot load a tokenizer from '/nonexistent'"),
        (["--tokenizer", "/nonexistent"], 2, "error: argument --tokenizer: cannot load a tokenizer"),
        (
            ["--context-length", "99999"],
            1,
            "error: scheduler 0 failed to start: context_length is 99999; allowed: 1..4096",
        ),
        (["--context-length", "99999", "--dp-size", "2"], 1, "failed to start: context_length is 99999"),
    ],
)
def test_start_up_failures_exit_with_one_line_and_leave_nothing(tmp_path, flags, code, message):
    """A configuration the model cannot take is found by the workers: one line naming the value
    and the allowed range, no traceback, no folder of sockets left in TMPDIR, no process left."""
    cmd = [sys.executable, "-m", "minengine.serve", "--log-level", "warning", *flags]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    r = run_cli(cmd, timeout=120, env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and len(lines) == 1 and message in lines[0], r.stderr
    assert ipc_dirs(tmp_path) == []


def test_a_command_past_its_timeout_writes_its_stacks_and_leaves_nothing():
    """``run_cli``'s timeout: the command and the child that still holds its pipes both write their
    stacks into the failure and are killed (a hung server start-up once printed nothing)."""
    script = (
        "import subprocess, sys, time; "
        "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(kid.pid, file=sys.stderr, flush=True); time.sleep(60)"
    )
    with pytest.raises(pytest.fail.Exception) as info:
        run_cli([sys.executable, "-c", script], timeout=5)
    message = str(info.value)
    assert "ran past 5 s" in message and message.count("Fatal Python error: Aborted") == 2, message
    kid = int(message.split("stderr:\n", 1)[1].split()[0])
    assert wait_for(lambda: not alive(kid), 5)


def test_a_port_in_use_fails_before_the_model_loads(tmp_path):
    """A port another process listens on: one line naming --port and the address, exit code 2,
    before any worker starts (with a real checkpoint, loading takes minutes)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [sys.executable, "-m", "minengine.serve", "--port", str(port), "--log-level", "info"]
        r = run_cli(cmd, timeout=60, env={**os.environ, "TMPDIR": str(tmp_path)})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert f"error: argument --port: cannot bind 127.0.0.1:{port}: [Errno {errno.EADDRINUSE}]" in lines[0]
    assert ipc_dirs(tmp_path) == []  # no worker started


def test_a_port_taken_while_the_workers_load_is_found_when_it_would_open():
    """Two processes may both bind a port (SO_REUSEADDR) until one listens: another that listens
    while this server's workers load wins it, and this server ends with the reason (the same
    line as above, exit code 2), not uvicorn's traceback."""
    from types import SimpleNamespace

    import uvicorn

    from minengine.serve import _bind, _bind_error, _Server

    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1]
        socks = _bind("127.0.0.1", port)  # both bound, neither listening

        async def ready_once_the_other_listens():
            busy.listen()
            return SimpleNamespace(context_length=4096, kv_capacity_tokens=4096)

        client = SimpleNamespace(shutdown=lambda: None, close=lambda: None)
        state = SimpleNamespace(client=client, served_model_name="tiny")
        workers = SimpleNamespace(start=ready_once_the_other_listens, processes=[None])
        server = _Server(uvicorn.Config(app=None, host="127.0.0.1", port=port), state, workers)
        try:
            server.run(sockets=socks)
        finally:
            for sock in socks:
                sock.close()
    assert not server.started and server.listen_failed is not None
    assert _bind_error("serve", "127.0.0.1", port, server.listen_failed) == (
        f"serve: error: argument --port: cannot bind 127.0.0.1:{port}: {server.listen_failed}"
    )
    assert server.listen_failed.errno == errno.EADDRINUSE


def test_a_signal_while_the_workers_start_stops_the_server_cleanly():
    """The port opens only once the workers are ready; SIGTERM before that ends the wait, tells
    the workers to stop and closes the client's sockets (exit code 0)."""
    from types import SimpleNamespace

    import uvicorn

    from minengine.serve import _Server

    calls = []

    async def never_ready():
        asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)
        await asyncio.sleep(60)

    client = SimpleNamespace(shutdown=lambda: calls.append("shutdown"), close=lambda: calls.append("close"))
    state = SimpleNamespace(client=client)
    server = _Server(uvicorn.Config(app=None), state, SimpleNamespace(start=never_ready))
    t0 = time.monotonic()
    server.run()
    assert server.stopped_early and not server.started and server.failed is None
    assert calls == ["shutdown", "close"] and time.monotonic() - t0 < 10
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are gone again


def test_a_malformed_config_json_is_named_in_one_line(tmp_path):
    from checkpoints import build_checkpoint

    ckpt = build_checkpoint(tmp_path / "m", "qwen3")
    (ckpt / "config.json").write_text('{"vocab_size": 400,}')
    cmd = [sys.executable, "-m", "minengine.serve", "--model", str(ckpt), "--log-level", "warning"]
    r = run_cli(cmd, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert f"failed to start: {ckpt / 'config.json'} is not valid JSON: Expecting" in lines[0]
    assert ipc_dirs(tmp_path) == []


def test_a_missing_model_directory_beside_a_tokenizer_is_named_in_one_line(tmp_path):
    """--tokenizer loads, --model does not exist: one line naming it (the generation config is
    read before the workers start), no traceback."""
    from checkpoints import build_checkpoint

    tok = build_checkpoint(tmp_path / "t", "qwen3")
    cmd = [sys.executable, "-m", "minengine.serve", "--tokenizer", str(tok), "--model", str(tmp_path / "none")]
    r = run_cli(cmd, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert f"error: model directory '{tmp_path / 'none'}' does not exist" in lines[0]


@pytest.mark.parametrize("how", ["no grace", "hurried"])
def test_stopping_workers_that_read_no_shutdown(tmp_path, monkeypatch, how):
    """Workers still loading the model read no Shutdown: ``stop`` with no grace, or hurried by a
    signal handler (a second Ctrl-C), terminates them at once; the folder of sockets goes too."""
    import threading

    from minengine.config import EngineConfig
    from minengine.server.metrics import Metrics
    from minengine.server.workers import Workers

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    workers = Workers(EngineConfig(model="tiny", page_size=4), Metrics())
    assert len(ipc_dirs(tmp_path)) == 1
    t0 = time.monotonic()
    if how == "hurried":
        threading.Timer(0.3, workers.hurry).start()
        workers.stop(grace=60)
    else:
        workers.stop(grace=0)
    assert time.monotonic() - t0 < 10
    assert not any(p.is_alive() for p in workers.processes) and ipc_dirs(tmp_path) == []


def test_a_worker_that_fails_to_start_leaves_nothing(tmp_path, monkeypatch):
    """The second of two workers fails to start (a script without the ``__main__`` guard, re-run
    by spawn, gets this): the first is stopped, and the client's sockets and the folder go."""
    import multiprocessing.context

    from minengine.config import EngineConfig
    from minengine.server.metrics import Metrics
    from minengine.server.workers import Workers

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    started, start = [], multiprocessing.context.SpawnProcess.start

    def second_fails(self):
        if started:
            raise RuntimeError("no second worker")
        start(self)
        started.append(self)

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", second_fails)
    with pytest.raises(RuntimeError, match="no second worker"):
        Workers(EngineConfig(model="tiny", page_size=4, dp_size=2), Metrics())
    assert len(started) == 1 and not started[0].is_alive() and ipc_dirs(tmp_path) == []


def test_a_temporary_folder_too_long_for_socket_paths_is_passed_over(tmp_path):
    """A TMPDIR too long for a socket path (107 characters on Linux): the server puts its sockets
    in /tmp, as Python's multiprocessing does, serves, and leaves nothing there when it stops."""
    long_dir = tmp_path / ("x" * 100)
    long_dir.mkdir()
    before = set(ipc_dirs(Path("/tmp")))
    proc, url = start_server(tmpdir=long_dir)
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert ipc_dirs(long_dir) == [] and len(set(ipc_dirs(Path("/tmp"))) - before) >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert set(ipc_dirs(Path("/tmp"))) <= before


def test_the_folder_of_sockets_fits_the_system_limit_or_is_an_error(tmp_path, monkeypatch):
    import zmq

    from minengine.server.workers import ipc_folder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = ipc_folder(dp_size=2)
    assert os.path.dirname(folder) == str(tmp_path)
    os.rmdir(folder)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / ("x" * 100)))
    folder = ipc_folder(dp_size=1000)
    assert os.path.dirname(folder) == "/tmp" and len(f"{folder}/requests-999") <= zmq.IPC_PATH_MAX_LEN
    os.rmdir(folder)
    monkeypatch.setattr(zmq, "IPC_PATH_MAX_LEN", 30)
    with pytest.raises(ValueError, match=r"is 1\d\d characters long, and a socket path may have at most 30"):
        ipc_folder(dp_size=1)


def test_a_client_whose_sockets_cannot_bind_closes_its_context(tmp_path, monkeypatch):
    """(A folder gone, a path over the limit): the error, and no context or socket left open."""
    import zmq
    import zmq.asyncio

    from minengine.server.frontend import SchedulerClient
    from minengine.server.metrics import Metrics

    made = []

    class Context(zmq.asyncio.Context):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(zmq.asyncio, "Context", Context)
    ok = f"ipc://{tmp_path}/requests-0"
    for requests, outputs in [([ok, f"ipc://{tmp_path}/gone/requests-1"], ok), ([ok], f"ipc://{tmp_path}/gone/out")]:
        with pytest.raises(zmq.ZMQError):
            SchedulerClient(requests, outputs, Metrics())
        assert made[-1].closed
    assert len(made) == 2


def test_a_zmq_context_that_does_not_end_does_not_hold_the_server(tmp_path, monkeypatch, caplog):
    """SchedulerClient.close waits at most TERM_SECONDS for its context to end (its term once hung
    in CI after a worker failed to start), then says which sockets are still open."""
    import zmq
    import zmq.asyncio

    import minengine.server.frontend as frontend
    from minengine.server.metrics import Metrics

    class Context(zmq.asyncio.Context):
        def term(self) -> None:  # a term that never returns (until the test lets it)
            released.wait(30)
            super().term()

    released = threading.Event()
    monkeypatch.setattr(zmq.asyncio, "Context", Context)
    monkeypatch.setattr(frontend, "TERM_SECONDS", 0.5)
    client = frontend.SchedulerClient([f"ipc://{tmp_path}/r0"], f"ipc://{tmp_path}/out", Metrics())
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="minengine.server.frontend"):
        client.close()
    released.set()
    assert time.monotonic() - start < 3
    assert "did not end within 0.5 s; sockets still open: []" in caplog.text


def test_workers_that_cannot_start_end_the_server_in_one_line(monkeypatch, capsys):
    import minengine.server.workers
    from minengine import serve

    why = "no folder for the scheduler's sockets"

    def fails(config, metrics):
        raise ValueError(why)

    monkeypatch.setattr(minengine.server.workers, "Workers", fails)
    assert serve.main(["--port", str(free_port())]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"python -m minengine.serve: error: cannot start the scheduler workers: {why}"]


def test_help_lists_every_config_field_with_defaults():
    import dataclasses

    from minengine.config import EngineConfig

    r = run_cli([sys.executable, "-m", "minengine.serve", "--help"], timeout=60)
    text = " ".join(r.stdout.split())
    for f in dataclasses.fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in text
    assert "(default: 8192)" in text and "(default: 127.0.0.1)" in text and "(default: 30000)" in text


@pytest.mark.parametrize("dataset", ["random", "generated-shared-prefix", "multi-turn"])
def test_bench_serving_smoke(server, dataset, tmp_path):
    from test_bench_smoke import load_bench

    bench = load_bench("bench_serving")
    small = [
        "--num-prompts", "12", "--random-input-len", "40", "--random-output-len", "6", "--random-range-ratio", "0.5",
        "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "40",
        "--gsp-question-len", "5", "--gsp-output-len", "6",
        "--multi-turn-num-conversations", "3", "--multi-turn-num-turns", "3", "--multi-turn-question-len", "5",
        "--multi-turn-output-len", "6",
    ]  # fmt: skip
    argv = ["--base-url", server, "--dataset", dataset, "--tokenizer", "tiny", "--out", str(tmp_path), "--plot"]
    report = bench.main([*argv, *small, "--no-progress", "--max-concurrency", "4", "--request-rate", "200"])
    s = report["summary"]
    assert s["failed"] == 0 and s["completed"] == {"random": 12, "generated-shared-prefix": 6, "multi-turn": 9}[dataset]
    low = 3 if dataset == "random" else 6  # random: output lengths uniform in [6 * 0.5, 6]
    assert low * s["completed"] <= s["total_output_tokens"] <= 6 * s["completed"]
    assert s["ttft"]["median_ms"] > 0 and s["e2e"]["p99_ms"] >= s["e2e"]["median_ms"]
    assert all(Path(p).stat().st_size > 0 for p in report["plots"])
    assert (tmp_path / f"serving_{dataset}.json").is_file()
    gained = report["server_counters"]  # the server's counters, scraped before and after the run
    assert gained["minengine:num_preemptions_total"] == 0
    hits = gained["minengine:prefix_cache_hit_tokens_total"]  # (random prompts may share a page by chance)
    assert hits > 0 if dataset != "random" else hits >= 0


def test_a_request_the_scheduler_rejects_fails_alone():
    """The front end checks requests before they reach a scheduler, but one that still fails there
    (a worker with a smaller KV pool than the one checked against) gets an error of its own; the
    scheduler goes on."""
    from minengine import EngineConfig, SamplingParams
    from minengine.engine import Engine
    from minengine.server.protocol import AddRequest
    from minengine.server.scheduler_process import LocalDriver

    driver = LocalDriver(Engine(EngineConfig(model="tiny", page_size=4, max_total_tokens=64), detokenize=False))
    (update,) = driver.add(AddRequest("big", [1] * 60, SamplingParams(max_tokens=10)))
    assert update.rid == "big" and update.finish_reason == "abort"
    assert "exceeds the KV cache capacity of 64 tokens" in update.error
    assert not driver.live and not driver.has_work()
    assert driver.add(AddRequest("ok", [1, 2, 3], SamplingParams(max_tokens=2))) == [] and driver.has_work()


def test_scheduler_tracebacks_stay_in_the_log():
    from minengine.server.api import _summary
    from minengine.server.frontend import SchedulerDied

    died = SchedulerDied('scheduler 0 failed:\nTraceback (most recent call last):\n  File "x.py"\nValueError: boom\n')
    assert _summary(died) == "scheduler 0 failed: ValueError: boom"
    assert _summary(SchedulerDied("a scheduler process exited")) == "a scheduler process exited"


# --- values quoted back, vLLM's stream and chat-template fields -----------------------------------


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"prompt": "hi", "temperature": "\\ud800"}', "temperature"),
        (b'{"prompt": "hi", "frequency_penalty": "\\ud800"}', "frequency_penalty"),
        (b'{"prompt": [1, "\\ud800"]}', "prompt"),
        (b'{"prompt": "hi", "stop": ["\\ud800", 1]}', "stop"),
        # strings no step would fail on before its answer: it used to run, then fail to encode it
        (b'{"prompt": "hi", "max_tokens": 2, "request_id": "\\ud800"}', "request_id"),
        (b'{"prompt": "hi", "max_tokens": 2, "request_id": "\\ud800", "stream": true}', "request_id"),
        (b'{"prompt": "hi", "bad_words": ["ok", "\\ud800"]}', "bad_words"),  # (the tokenizer's TypeError: a 500)
        (b'{"prompt": "hi", "logit_bias": {"\\ud800": 1}}', "logit_bias"),
        (b'{"prompt": "hi", "user": {"a": ["\\uDfFf\\ud800"]}}', "user"),  # (a field it ignores)
        (b'{"prompt": "hi", "max_tokens": 2, "\\ud800": 1}', "\\ud800"),  # a field's name: quoted too
        # no escape: its UTF-8 bytes (json.loads decodes with surrogatepass), or a UTF-16 body
        (b'{"prompt": "hi", "max_tokens": 2, "request_id": "\xed\xa0\x80"}', "request_id"),
        ('{"prompt": "hi", "max_tokens": 2, "request_id": "\\ud800"}'.encode("utf-16"), "request_id"),
    ],
)
def test_a_lone_surrogate_is_a_json_400_naming_it(server, raw, param):
    r = httpx.post(server + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "\\ud800" in error["message"] or "\\udfff" in error["message"]
    assert "unpaired surrogate" in error["message"] and error["param"] == param


def test_a_surrogate_pair_is_text_and_an_empty_prompt_is_its_bos(server):
    """A pair of surrogate escapes is one character (JSON's way to write one past U+FFFF); a lone
    one is a 400 that names where it is. "" runs as vLLM runs it: the tokenizer's BOS alone."""
    body = b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1, "echo": true}'
    r = httpx.post(server + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("\U0001f600"), r.text
    body = b'{"messages": [{"role": "user", "content": "a \\ud83d b"}]}'
    r = httpx.post(server + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    message = r.json()["error"]["message"]
    assert message.startswith('messages.0.content is "a \\ud83d b": an unpaired surrogate') and "character 2" in message
    r = httpx.post(server + "/v1/completions", json={"prompt": "", "max_tokens": 2, "return_token_ids": True})
    assert r.status_code == 200 and r.json()["choices"][0]["prompt_token_ids"] == [256]


def test_request_ids_and_head_health_as_vllm(server):
    """vLLM's request_id field and X-Request-Id header (which wins) name the answer; HEAD /health
    answers as GET does."""
    body = {"prompt": "hi", "max_tokens": 1}
    assert httpx.post(server + "/v1/completions", json=body | {"request_id": "r-1"}).json()["id"] == "cmpl-r-1"
    headed = httpx.post(server + "/v1/completions", json=body | {"request_id": "r-1"}, headers={"X-Request-Id": "h-2"})
    assert headed.json()["id"] == "cmpl-h-2"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "request_id": "c-3", "stream": True}
    with httpx.stream("POST", server + "/v1/chat/completions", json=chat) as r:
        ids = {json.loads(x[6:])["id"] for x in r.iter_lines() if x.startswith("data: {")}
    assert ids == {"chatcmpl-c-3"}
    assert len(httpx.post(server + "/v1/completions", json=body).json()["id"]) == len("cmpl-") + 32
    head = httpx.head(server + "/health")
    assert head.status_code == 200 and head.content == b""


def test_continuous_usage_stats_as_vllm(server):
    """vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk has its
    choice's usage so far (a chat's role chunk: none out yet); the last, the whole request's."""

    def events(path, body):
        with httpx.stream("POST", server + path, json=body | {"stream": True}) as r:
            return [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]

    for path, body in (
        ("/v1/completions", {"prompt": "hi", "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        body |= {"max_tokens": 4, "ignore_eos": True, "stream_options": {"continuous_usage_stats": True}}
        got = events(path, body)
        *chunks, last = got
        so_far = {}
        for c in chunks:
            index, used = c["choices"][0]["index"], c["usage"]
            assert used["total_tokens"] == used["prompt_tokens"] + used["completion_tokens"] > 0
            assert used["completion_tokens"] >= so_far.get(index, 0)
            so_far[index] = used["completion_tokens"]
        assert so_far == {i: 4 for i in range(body.get("n", 1))}
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4 * body.get("n", 1)
        if "messages" in body:
            assert chunks[0]["usage"]["completion_tokens"] == 0 and "role" in chunks[0]["choices"][0]["delta"]
        off = body | {"stream_options": {"include_usage": False, "continuous_usage_stats": True}}
        assert all("usage" not in c for c in events(path, off))


def test_chat_template_kwargs_reach_the_template_and_bad_template_fields_are_400s(server):
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
    plain = httpx.post(server + "/v1/chat/completions", json=base).json()["usage"]["prompt_tokens"]
    # the built-in ChatML template ignores unknown variables: same prompt, but the field is accepted
    kw = httpx.post(server + "/v1/chat/completions", json={**base, "chat_template_kwargs": {"enable_thinking": False}})
    assert kw.status_code == 200 and kw.json()["usage"]["prompt_tokens"] == plain
    for extra, param, message in (
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "chat_template_kwargs may not set"),
        ({"chat_template_kwargs": {"add_generation_prompt": 0}}, "chat_template_kwargs", "set add_generation_prompt"),
        ({"chat_template": "x"}, "chat_template", "not started with --trust-request-chat-template"),
        ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message", "cannot both"),
        ({"add_generation_prompt": "no"}, "add_generation_prompt", "a valid boolean"),
        ({"echo": 1}, "echo", "a valid boolean"),
    ):
        r = httpx.post(server + "/v1/chat/completions", json={**base, **extra})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and message in error["message"], (extra, r.text)


def _chat_stream(url: str, body: dict) -> list[dict]:
    """A streamed chat answer's chunks' first choices."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body | {"stream": True}) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    return [json.loads(line)["choices"][0] for line in lines]


def test_continue_final_message_add_generation_prompt_and_echo_as_vllm(server):
    """vLLM's chat template fields give the offline LLM.chat's tokens. continue_final_message: the
    prompt ends inside the last message; add_generation_prompt false: the answer takes the last
    message's role; echo: the answer starts with the last message when it has the answer's role
    (a stream sends it with the first output token's text; vLLM, on its own before it)."""
    from minengine import LLM, SamplingParams

    user, partial = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}
    p = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm = LLM("tiny", page_size=4, max_total_tokens=256)
    try:
        cont = llm.chat([user, partial], p, use_tqdm=False, continue_final_message=True)[0]
        closed = llm.chat([user], p, use_tqdm=False, add_generation_prompt=False)[0]
    finally:
        llm.shutdown()
    assert cont.prompt.endswith("<|im_start|>assistant\nThe answer is") and closed.prompt.endswith("<|im_end|>\n")
    base = {"model": MODEL, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    for body, ref, role, echo in (
        ({"messages": [user, partial], "continue_final_message": True}, cont, "assistant", "The answer is"),
        ({"messages": [user], "add_generation_prompt": False}, closed, "user", "hi"),
        ({"messages": [user, partial], "add_generation_prompt": True}, None, "assistant", "The answer is"),
        ({"messages": [user]}, None, "assistant", ""),  # the last message is not the answer's role: no echo
    ):
        out = httpx.post(server + "/v1/chat/completions", json=base | body).json()
        message = out["choices"][0]["message"]
        assert message["role"] == role, (body, out)
        if ref is not None:
            assert out["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
            assert message["content"] == ref.outputs[0].text
        echoed = httpx.post(server + "/v1/chat/completions", json=base | body | {"echo": True}).json()
        assert echoed["choices"][0]["message"] == {"role": role, "content": echo + message["content"]}
        chunks = _chat_stream(server, base | body | {"echo": True})
        assert chunks[0]["delta"] == {"role": role, "content": ""}
        if echo:  # with the first output (a router tells output from the role events by their text)
            assert chunks[1]["delta"]["content"].startswith(echo) and len(chunks[1]["delta"]["content"]) > len(echo)
        assert "".join(c["delta"].get("content", "") for c in chunks) == echo + message["content"]


def test_return_tokens_as_token_ids(server):
    """vLLM's return_tokens_as_token_ids: logprobs name each token (sampled, top, echoed prompt)
    "token_id:<id>", its offsets count those names; the values and the text stay as they are."""
    from minengine.models.tiny import tiny_tokenizer

    tok = tiny_tokenizer()

    def named(name: str) -> str:  # a "token_id:<id>" name as the token's text
        assert re.fullmatch(r"token_id:[0-9]+", name), name
        return tok.token_text(int(name.split(":")[1]))

    base = {"prompt": "hi", "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True, "ignore_eos": True}
    plain = httpx.post(server + "/v1/completions", json=base).json()["choices"][0]
    ids = httpx.post(server + "/v1/completions", json=base | {"return_tokens_as_token_ids": True}).json()["choices"][0]
    lp, want = ids["logprobs"], plain["logprobs"]
    assert ids["text"] == plain["text"] and [named(t) for t in lp["tokens"]] == want["tokens"]
    assert lp["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-5)
    assert lp["top_logprobs"][0] is None and lp["tokens"][0] == f"token_id:{tok.encode('hi')[0]}"
    for top, top_want in zip(lp["top_logprobs"][1:], want["top_logprobs"][1:], strict=True):
        assert {named(t): v for t, v in top.items()} == pytest.approx(top_want, abs=1e-5)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    with httpx.stream(
        "POST", server + "/v1/completions", json=base | {"return_tokens_as_token_ids": True, "stream": True}
    ) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = [json.loads(line)["choices"][0]["logprobs"] for line in lines]
    assert [t for s in streamed for t in s["tokens"]] == lp["tokens"]
    assert [o for s in streamed for o in s["text_offset"]] == lp["text_offset"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "logprobs": True}
    chat |= {"top_logprobs": 2, "return_tokens_as_token_ids": True}
    content = httpx.post(server + "/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for item in content:  # (as vLLM: a sampled token's bytes are its text's, a top token's its name's)
        assert item["bytes"] == list(named(item["token"]).encode()) and len(item["top_logprobs"]) == 2
        for top in item["top_logprobs"]:
            assert top["bytes"] == list(top["token"].encode()) and named(top["token"]) is not None


def test_return_token_ids_and_add_special_tokens(server):
    """vLLM's return_token_ids: the prompt's and the output's token ids with the text (a stream:
    each chunk's new ones, the prompt's in a choice's first chunk; a chat's at the top level);
    add_special_tokens: a text prompt's BOS (default on for a completion, off for a chat, whose
    template has its own), kept by truncate_prompt_tokens."""
    from minengine.models.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    base = {"prompt": "hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    out = httpx.post(server + "/v1/completions", json=base | {"n": 2}).json()
    for choice in out["choices"]:
        assert choice["prompt_token_ids"] == tok.encode("hi") and len(choice["token_ids"]) == 4
        assert tok.decode(choice["token_ids"]) == choice["text"]
    with httpx.stream("POST", server + "/v1/completions", json=base | {"stream": True}) as r:
        chunks = [json.loads(x[6:])["choices"][0] for x in r.iter_lines() if x.startswith("data: {")]
    assert [c.get("prompt_token_ids") for c in chunks] == [tok.encode("hi")] + [None] * (len(chunks) - 1)
    assert [t for c in chunks for t in c["token_ids"]] == out["choices"][0]["token_ids"]
    scored = httpx.post(server + "/v1/completions", json=base | {"max_tokens": 0, "echo": True}).json()
    assert scored["choices"][0]["token_ids"] == [] and scored["choices"][0]["text"] == "hi"
    plain = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    bare = httpx.post(server + "/v1/completions", json=base | {"add_special_tokens": False}).json()
    assert bare["choices"][0]["prompt_token_ids"] == tok.encode("hi", add_special_tokens=False)

    messages = [{"role": "user", "content": "hi"}]
    rendered = tok.encode(tok.render_chat(messages), add_special_tokens=False)
    chat = {"messages": messages, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    out = httpx.post(server + "/v1/chat/completions", json=chat).json()
    assert out["prompt_token_ids"] == rendered and len(out["choices"][0]["token_ids"]) == 3
    chunks = _chat_stream(server, chat)
    assert [t for c in chunks for t in c.get("token_ids", [])] == out["choices"][0]["token_ids"]
    with httpx.stream("POST", server + "/v1/chat/completions", json=chat | {"stream": True}) as r:
        first = json.loads(next(x for x in r.iter_lines() if x.startswith("data: {"))[6:])
    assert first["prompt_token_ids"] == rendered and first["choices"][0]["delta"]["role"] == "assistant"
    with_bos = httpx.post(server + "/v1/chat/completions", json=chat | {"add_special_tokens": True}).json()
    assert with_bos["prompt_token_ids"] == tok.encode(tok.render_chat(messages))
    cut = chat | {"add_special_tokens": True, "truncate_prompt_tokens": 5}
    cut_ids = httpx.post(server + "/v1/chat/completions", json=cut).json()["prompt_token_ids"]
    assert cut_ids == [with_bos["prompt_token_ids"][0], *rendered[-4:]]  # the BOS stays
    for extra, param in (({"priority": 1}, "priority"), ({"cache_salt": ""}, "cache_salt")):
        r = httpx.post(server + "/v1/chat/completions", json=chat | extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.post(server + "/v1/chat/completions", json=chat | {"priority": 0}).status_code == 200


def test_cache_salt_shares_cached_prompt_tokens_only_within_the_salt(server):
    """vLLM's cache_salt: usage's cached_tokens count prefix-cache hits of the same salt only."""

    def cached(salt=None, path="/v1/completions"):
        body = {"max_tokens": 1} | ({} if salt is None else {"cache_salt": salt})
        if path == "/v1/completions":
            body["prompt"] = "zq: a prompt no other test's starts as, salted " * 2
        else:
            # (a role no other test's chat starts with: their template prefix is no hit either)
            body["messages"] = [{"role": "salted", "content": "a conversation, salted " * 3}]
        r = httpx.post(server + path, json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    for path in ("/v1/completions", "/v1/chat/completions"):
        assert cached("tenant a", path) == 0
        assert cached("tenant a", path) > 0
        assert cached("tenant b", path) == 0 and cached(None, path) == 0


def test_tokenize_detokenize_and_version(server):
    """vLLM's /tokenize (a prompt, or messages through the chat template with the chat API's
    fields: the ids a chat request runs with), /detokenize (special tokens kept) and /version."""
    import minengine
    from minengine.models.tiny import tiny_tokenizer

    tok = tiny_tokenizer()

    def post(path, **body):
        return httpx.post(server + path, json=body)

    context = httpx.get(server + "/v1/models").json()["data"][0]["max_model_len"]
    ids = tok.encode("hi")
    assert post("/tokenize", prompt="hi").json() == {
        "count": len(ids),
        "max_model_len": context,
        "tokens": ids,
        "token_strs": None,
    }
    bare = post("/tokenize", prompt="hi", add_special_tokens=False, return_token_strs=True).json()
    assert bare["tokens"] == tok.encode("hi", add_special_tokens=False) == [104, 105]
    assert bare["token_strs"] == ["h", "i"]
    partial = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The"}]
    for fields in ({}, {"continue_final_message": True}, {"add_special_tokens": True}):
        counted = post("/tokenize", messages=partial, **fields).json()["tokens"]
        ran = post("/v1/chat/completions", messages=partial, max_tokens=1, return_token_ids=True, **fields).json()
        assert counted == ran["prompt_token_ids"], fields
    assert post("/detokenize", tokens=ids).json() == {"prompt": tok.decode(ids, skip_special_tokens=False)}
    assert post("/detokenize", tokens=ids).json()["prompt"].endswith("hi")
    for path, body, param, message in (
        ("/tokenize", {}, "prompt", "either prompt or messages"),
        ("/tokenize", {"prompt": "hi", "messages": partial}, "prompt", "either prompt or messages"),
        ("/tokenize", {"messages": []}, "messages", "messages is empty"),
        ("/tokenize", {"messages": partial, "chat_template": "x"}, "chat_template", "--trust-request-chat-template"),
        ("/tokenize", {"prompt": 5}, "prompt", "prompt is 5"),
        (
            "/detokenize",
            {"tokens": [104, 10**6]},
            "tokens",
            f"tokens.1 is 1000000; allowed: token ids 0..{tok.vocab_size - 1}",
        ),
        ("/detokenize", {"tokens": ["h"]}, "tokens", "tokens.0 is"),
    ):
        r = httpx.post(server + path, json=body)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and message in error["message"], (body, r.text)
    assert post("/tokenize", prompt="hi", model="other").status_code == 404
    # a chat body's sampling fields, those minengine refuses in the chat API too, change no token
    # (a client counts a request's tokens by posting its body)
    sampling = {"logprobs": True, "top_logprobs": 5, "best_of": 2, "suffix": "x", "n": 2, "tool_choice": "auto"}
    assert (
        post("/tokenize", messages=partial, **sampling).json()["tokens"]
        == post("/tokenize", messages=partial).json()["tokens"]
    )
    for best_of in (None, 1, 3):
        assert post("/tokenize", prompt="hi", best_of=best_of).json()["tokens"] == ids
        assert post("/detokenize", tokens=ids, best_of=best_of).status_code == 200
    assert httpx.get(server + "/version").json() == {"version": minengine.__version__}


def test_chat_template_response_role_and_token_id_flags(tmp_path):
    """vLLM's server flags: --chat-template (a file) renders every chat; --response-role names the
    answer; --return-tokens-as-token-ids is the default a request can turn off;
    --trust-request-chat-template lets a request bring its own template (one that does not parse,
    or drops the message continue_final_message continues, is a 400 naming the field)."""
    from minengine.models.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    proc, url = start_server(
        "--chat-template",
        str(template),
        "--trust-request-chat-template",
        "--response-role",
        "bot",
        "--return-tokens-as-token-ids",
        "--max-total-tokens",
        "512",
    )
    try:
        base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, "logprobs": True}

        def chat(**extra):
            return httpx.post(url + "/v1/chat/completions", json=base | extra)

        out = chat().json()
        assert out["usage"]["prompt_tokens"] == len(tok.encode("[user]hi>", add_special_tokens=False))
        assert out["choices"][0]["message"]["role"] == "bot"
        assert all(i["token"].startswith("token_id:") for i in out["choices"][0]["logprobs"]["content"])
        texts = chat(return_tokens_as_token_ids=False).json()["choices"][0]["logprobs"]["content"]
        assert [i["token"] for i in texts] == [
            tok.token_text(int(i["token"][9:])) for i in out["choices"][0]["logprobs"]["content"]
        ]
        assert _chat_stream(url, base)[0]["delta"]["role"] == "bot"
        own = chat(chat_template="{{ messages[-1].content }}!").json()
        assert own["usage"]["prompt_tokens"] == len(tok.encode("hi!", add_special_tokens=False))
        # vLLM's documents reach the template (chat_template_kwargs may give its own)
        cites = "{% for d in documents %}[{{ d.title }}]{% endfor %}{{ messages[-1].content }}"
        docs = [{"title": "a", "text": "x"}, {"title": "b", "text": "y"}]
        for extra, text in (
            ({"documents": docs}, "[a][b]hi"),
            ({"documents": docs, "chat_template_kwargs": {"documents": docs[:1]}}, "[a]hi"),
        ):
            body = {"messages": base["messages"], "chat_template": cites, **extra}
            tokens = httpx.post(url + "/tokenize", json=body).json()["tokens"]
            assert tokens == tok.encode(text, add_special_tokens=False), extra
        r = chat(documents=[{"title": 1}])
        assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text
        deep = "{% for x in y %}" * 40 + "{% endfor %}" * 40  # nested past what Python compiles
        for extra, param in (
            ({"chat_template": "{% for %}"}, "chat_template"),
            ({"chat_template": deep}, "chat_template"),
            ({"chat_template": "{{ " + "(" * 2000 + "1" + ")" * 2000 + " }}"}, "chat_template"),
            ({"chat_template": ""}, "chat_template"),
            ({"chat_template": "x" * 65537}, "chat_template"),
            ({"chat_template": "{{ raise_exception('no') }}"}, "chat_template"),
            (
                {"chat_template": "{{ add_generation_prompt }}", "continue_final_message": True},
                "continue_final_message",
            ),
        ):
            r = chat(**extra)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    finally:
        stop_server(proc)


def test_completion_logprobs_equal_the_offline_ones_streamed_or_not(client):
    """Raw logprobs of every output token (EOS included), the sampled token and the top k in the
    completions shape; a stream's chunks add up to the whole answer; the values are the offline
    engine's for the same request."""
    from minengine import LLM, SamplingParams

    kwargs = dict(model=MODEL, prompt="Hello there", max_tokens=8, temperature=0, logprobs=3, extra_body=LONG)
    full = client.completions.create(**kwargs)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == full.usage.completion_tokens == 8
    offsets = [0]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # greedy: it is the top one; two tokens with one text (U+FFFD: part of a character) share a key
        assert top[token] == value == max(top.values()) and 1 <= len(top) <= 3
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets[:-1]
    chunks = [c for c in client.completions.create(**kwargs, stream=True) if c.choices]
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    # equal up to float rounding: the prefix cache changes how the prompt's KV was computed
    joined = {field: [x for part in streamed for x in getattr(part, field)] for field in vars(lp)}
    assert joined["tokens"] == lp.tokens and joined["text_offset"] == lp.text_offset
    assert joined["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert [list(top) for top in joined["top_logprobs"]] == [list(top) for top in lp.top_logprobs]
    llm = LLM("tiny", device="cpu")
    try:
        out = llm.generate("Hello there", SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True))
    finally:
        llm.shutdown()
    steps = out[0].outputs[0].logprobs
    assert [s[t].decoded_token for t, s in zip(out[0].token_ids, steps, strict=True)] == lp.tokens
    assert [s[t].logprob for t, s in zip(out[0].token_ids, steps, strict=True)] == pytest.approx(
        lp.token_logprobs, abs=1e-4
    )
    plain = client.completions.create(**{**kwargs, "logprobs": None})
    assert plain.choices[0].logprobs is None and plain.choices[0].text == full.choices[0].text


def test_echo_and_prompt_logprobs_as_vllm(server, client):
    """``echo`` puts the prompt before the output; with ``logprobs`` the prompt's tokens come
    first in the logprobs too (the first with null values), as lm-eval's loglikelihood requests
    read them; ``prompt_logprobs`` is vLLM's field. Values: the offline engine's."""
    from minengine import LLM, SamplingParams

    base = dict(model=MODEL, max_tokens=4, temperature=0, extra_body=LONG)
    plain = client.completions.create(prompt="Hello there", **base).choices[0].text
    echoed = client.completions.create(prompt="Hello there", echo=True, **base).choices[0]
    assert echoed.text == "Hello there" + plain and echoed.logprobs is None

    llm = LLM("tiny", device="cpu")
    try:
        ids = llm.tokenizer.encode("Hello there")
        ref = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2, logprobs=2))[0]
    finally:
        llm.shutdown()
    # lm-eval's loglikelihood request: token ids, echo, logprobs 1, one token
    kwargs = dict(model=MODEL, prompt=[ids], max_tokens=1, temperature=0, echo=True, logprobs=2)
    out = client.completions.create(**kwargs).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    want = [step[t].logprob for t, step in zip(ids[1:], ref.prompt_logprobs[1:], strict=True)]
    want.append(ref.outputs[0].logprobs[0][ref.token_ids[0]].logprob)
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert top[token] == value and 1 <= len(top) <= 3
    assert out.text == llm_text(ids) + ref.text
    # vLLM's prompt_logprobs field: {token id: {logprob, rank, decoded_token}} after a null
    prompt_lps = out.model_extra["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(ids)
    assert [v[str(t)]["logprob"] for t, v in zip(ids[1:], prompt_lps[1:], strict=True)] == pytest.approx(
        want[:-1], abs=1e-4
    )
    assert all(len(v) <= 3 and v[str(t)]["rank"] >= 1 for t, v in zip(ids[1:], prompt_lps[1:], strict=True))

    # streamed: the prompt (and its logprobs) in the first chunk of each choice
    chunks = [c for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == out.text
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert chunks[0].choices[0].text.startswith(llm_text(ids))
    # as vLLM: a stream takes prompt_logprobs 0 (and sends none); with echo it scores the prompt
    # with no top tokens beside the prompt's own
    zero = client.completions.create(**kwargs, stream=True, extra_body={"prompt_logprobs": 0})
    zero = [c.choices[0].logprobs for c in zero if c.choices and c.choices[0].logprobs]
    tops = [top for lps in zero for top in lps.top_logprobs]
    assert tops[0] is None and all(len(top) == 1 for top in tops[1 : len(ids)])
    assert [x for lps in zero for x in lps.token_logprobs][1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    for path, body in (
        ("completions", {"prompt": "ab"}),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        body = {**body, "max_tokens": 2, "stream": True, "prompt_logprobs": 0}
        with httpx.stream("POST", f"{server}/v1/{path}", json=body) as r:
            assert r.status_code == 200 and "prompt_logprobs" not in r.read().decode().replace(
                '"prompt_logprobs":null', ""
            )

    # echo with max_tokens 0: the prompt alone, scored (vLLM's; older lm-eval sends it)
    alone = client.completions.create(**{**kwargs, "max_tokens": 0}).choices[0]
    assert alone.text == llm_text(ids) and alone.finish_reason == "length"
    assert len(alone.logprobs.tokens) == len(ids) and alone.logprobs.token_logprobs[0] is None
    assert alone.logprobs.token_logprobs[1:] == pytest.approx(want[:-1], abs=1e-4)
    r = httpx.post(server + "/v1/completions", json={"prompt": "ab", "max_tokens": 0, "echo": True})
    assert r.json()["choices"][0]["text"] == "ab" and r.json()["usage"]["completion_tokens"] == 0
    r = httpx.post(server + "/v1/completions", json={"prompt": "ab", "max_tokens": 0})
    assert r.status_code == 400 and "0 with echo" in r.json()["error"]["message"]
    # echoed prompt tokens list at most `logprobs` top tokens, though prompt_logprobs asked for more
    wide = client.completions.create(**{**kwargs, "logprobs": 1}, extra_body={"prompt_logprobs": 5}).choices[0]
    assert all(len(top) <= 2 for top in wide.logprobs.top_logprobs[1:])
    assert max(len(v) for v in wide.model_extra["prompt_logprobs"][1:]) == 6
    # vLLM's field is there, null, when not asked for
    r = httpx.post(server + "/v1/completions", json={"prompt": "ab", "max_tokens": 1})
    assert "prompt_logprobs" in r.json()["choices"][0] and r.json()["choices"][0]["prompt_logprobs"] is None

    # several prompts, n 2: every choice echoes its own prompt
    many = client.completions.create(model=MODEL, prompt=["ab", "cd"], n=2, max_tokens=2, echo=True, extra_body=LONG)
    assert [c.text[:2] for c in sorted(many.choices, key=lambda c: c.index)] == ["ab", "ab", "cd", "cd"]

    # chat: vLLM's prompt_logprobs at the top level, one per prompt token
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0}
    body = httpx.post(server + "/v1/chat/completions", json=chat).json()
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert all(len(v) == 1 for v in body["prompt_logprobs"][1:])


def llm_text(ids: list[int]) -> str:
    from minengine.models.tiny import tiny_tokenizer

    return tiny_tokenizer().decode(ids, skip_special_tokens=False)


def test_chat_logprobs_and_top_logprobs(client):
    messages = [{"role": "user", "content": "hi"}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body=LONG)
    out = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 6
    for item in content:
        assert item.bytes == list(item.token.encode()) and item.logprob <= 0
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == item.logprob  # greedy

    # the same up to float rounding (the prefix cache changes how the prompt's KV was computed)
    def same(items, top=True):
        assert [(c.token, [t.token for t in c.top_logprobs] if top else []) for c in items] == [
            (c.token, [t.token for t in c.top_logprobs] if top else []) for c in content
        ]
        assert [c.logprob for c in items] == pytest.approx([c.logprob for c in content], abs=1e-5)

    bare = client.chat.completions.create(**kwargs, logprobs=True).choices[0].logprobs.content
    assert all(c.top_logprobs == [] for c in bare)
    same(bare, top=False)
    stream = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2, stream=True)
    same([x for c in stream if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content])
    assert client.chat.completions.create(**kwargs).choices[0].logprobs is None


@pytest.mark.parametrize(
    ("path", "extra", "param", "message"),
    [
        ("completions", {"logprobs": 21}, "logprobs", "logprobs is 21; allowed: None or an integer in [0, 20]"),
        ("completions", {"logprobs": -1}, "logprobs", "logprobs is -1; allowed"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs", "top_logprobs is 2; it needs logprobs: true"),
        ("chat/completions", {"logprobs": False, "top_logprobs": 1}, "top_logprobs", "needs logprobs: true"),
        ("completions", {"logprobs": 1, "return_tokens_as_token_ids": 1}, "return_tokens_as_token_ids", "a valid bool"),
        (
            "chat/completions",
            {"logprobs": True, "top_logprobs": 21},
            "top_logprobs",
            "top_logprobs is 21; allowed: 0..20",
        ),
        ("chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "top_logprobs is -1; allowed"),
    ],
)
def test_bad_logprobs_requests_are_400s(server, path, extra, param, message):
    body = {"prompt": "x"} if path == "completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(f"{server}/v1/{path}", json=body | {"max_tokens": 2} | extra)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert message in r.json()["error"]["message"]


def test_stream_options_without_include_usage_sends_usage_as_vllm(server):
    body = {"prompt": "hi", "max_tokens": 2, "stream": True, "stream_options": {}}
    r = httpx.post(server + "/v1/completions", json=body)
    assert r.status_code == 200 and '"usage": {"prompt_tokens"' in r.text


def test_a_request_aborted_before_its_prompt_logprobs_came_still_answers():
    """An abort before the first token (a shutdown drain) brings no prompt logprobs: the answer is
    a 200 with finish_reason abort and null values, as for a request that asked for none."""
    from types import SimpleNamespace

    from minengine.models.tiny import tiny_tokenizer
    from minengine.sampling_params import SamplingParams
    from minengine.server import api
    from minengine.server.frontend import Piece
    from minengine.server.metrics import Metrics

    async def fake_pieces(state, choices):
        for c in choices:
            yield c.index, Piece("", [], "abort", logprobs=[])

    async def connected():
        return False

    async def run(chat, echo):
        state = api.ServerState(SimpleNamespace(), tiny_tokenizer(), MODEL, Metrics())
        params = SamplingParams(logprobs=1, prompt_logprobs=1)
        choices = [api.Choice(0, [5, 6, 7], params, echo="ab" if echo else None)]
        fields = dict(return_tokens_as_token_ids=None, return_token_ids=False, request_id=None)
        req = SimpleNamespace(stream=False, n=1, **fields)
        raw = SimpleNamespace(is_disconnected=connected, headers={})
        return json.loads((await api._respond(state, raw, req, choices, chat)).body)

    orig, api._pieces = api._pieces, fake_pieces
    try:
        for chat, echo in ((False, False), (False, True), (True, False)):
            body = asyncio.run(run(chat, echo))
            choice = body["choices"][0]
            assert choice["finish_reason"] == "abort"
            assert (body if chat else choice)["prompt_logprobs"] == [None, None, None]
            if echo:
                assert choice["text"] == "ab" and choice["logprobs"]["token_logprobs"] == [None, None, None]
    finally:
        api._pieces = orig


def test_logprobs_of_tokens_without_text_go_with_the_next_chunk():
    """A piece whose tokens make no text yet sends no chunk: its logprobs are not lost, they go
    with the next chunk, and text offsets run on."""
    from types import SimpleNamespace

    from minengine.models.tiny import tiny_tokenizer
    from minengine.sampling_params import SamplingParams
    from minengine.server import api
    from minengine.server.frontend import Piece
    from minengine.server.metrics import Metrics

    tok = tiny_tokenizer()
    entry = lambda v: (v, 1, [5], [v])  # noqa: E731
    pieces = [
        Piece("", [0xE2 + 4], logprobs=[entry(-1.0)]),  # half a character: no text yet
        Piece("ab", [0x82 + 4, ord("a") + 4], logprobs=[entry(-2.0), entry(-3.0)]),
        Piece("", [1], "stop", logprobs=[entry(-4.0)]),
    ]

    async def fake_pieces(state, choices):
        for p in pieces:
            yield 0, p

    async def run(chat):
        state = api.ServerState(SimpleNamespace(), tok, MODEL, Metrics())
        choices = [api.Choice(0, [1], SamplingParams(logprobs=1))]
        stream = api._stream(state, choices, "id", 0, MODEL, api._Shape("assistant" if chat else None), False, 1, {0})
        return [json.loads(line[6:]) for line in [x async for x in stream] if line.startswith("data: {")]

    orig, api._pieces = api._pieces, fake_pieces
    try:
        events = asyncio.run(run(False))
        chat_events = asyncio.run(run(True))
    finally:
        api._pieces = orig
    parts = [e["choices"][0]["logprobs"] for e in events]
    assert [p["token_logprobs"] for p in parts] == [[-1.0, -2.0, -3.0], [-4.0]]
    texts = [tok.token_text(t) for p in pieces for t in p.token_ids]
    assert [o for p in parts for o in p["text_offset"]] == [0, *[sum(map(len, texts[:i])) for i in range(1, 4)]]
    content = [c["logprob"] for e in chat_events[1:] for c in e["choices"][0]["logprobs"]["content"]]
    assert content == [-1.0, -2.0, -3.0, -4.0]
