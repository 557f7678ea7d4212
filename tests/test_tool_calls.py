"""Tool calling (vLLM's ``tools``, ``tool_choice``, ``--enable-auto-tool-choice``, ``--tool-call-parser``):
the parsers, streamed against whole; the chat API on scripted model outputs, through the openai
client; a real server rendering tools and refusing what it cannot do."""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from minengine.models.tiny import tiny_tokenizer
from minengine.server.tool_calls import (
    PARSERS,
    ToolCall,
    ToolCallStream,
    finish_reason,
    parse_tool_calls,
    required_calls_schema,
)
from minengine.tokenizer import chat_messages

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
# a template that shows the tools and the conversation's earlier calls (as Qwen's do, shorter)
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def shown(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


# --- parsers -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("no calls here", "no calls here", []),
        ("", "", []),
        ("ends with half a tag <tool_c", "ends with half a tag <tool_c", []),
        (call("get_weather", city="Paris"), None, [("get_weather", {"city": "Paris"})]),
        ("Let me look.\n" + call("a", x=1) + "\n" + call("b"), "Let me look.\n", [("a", {"x": 1}), ("b", {})]),
        # text after a call is content only when it is more than whitespace
        (call("a") + "\n\n", None, [("a", {})]),
        (call("a") + "\nDone.", "\nDone.", [("a", {})]),
        ("\n " + call("a") + "\n" + call("b") + " ", None, [("a", {}), ("b", {})]),
        (" \n ", " \n ", []),  # no calls: the output is the content, whitespace too
        # a block that is not a call stays as written; the others are calls
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        (
            '<tool_call>{"arguments": {}}</tool_call>' + call("a"),
            '<tool_call>{"arguments": {}}</tool_call>',
            [("a", {})],
        ),
        # a block left open at the end: a call when it is one
        ('<tool_call>{"name": "a", "arguments": {"k": "v"}}', None, [("a", {"k": "v"})]),
        ('x<tool_call>{"name": "a", "argu', 'x<tool_call>{"name": "a", "argu', []),
        # arguments given as JSON text are kept; not JSON: no call
        ('<tool_call>{"name": "a", "arguments": "{\\"k\\": 1}"}</tool_call>', None, [("a", {"k": 1})]),
        (
            '<tool_call>{"name": "a", "arguments": "{oops"}</tool_call>',
            '<tool_call>{"name": "a", "arguments": "{oops"}</tool_call>',
            [],
        ),
        ("é 東京 🚀" + call("a", q="東京"), "é 東京 🚀", [("a", {"q": "東京"})]),
    ],
)
def test_hermes_parses_a_whole_output(text, content, calls):
    got_content, got_calls = parse_tool_calls("hermes", text)
    assert got_content == content and shown(got_calls) == calls
    if calls:  # the API's form: a JSON text of the arguments, and an id of its own each
        assert all(json.loads(c.arguments) is not None and c.id.startswith("chatcmpl-tool-") for c in got_calls)
        assert len({c.id for c in got_calls}) == len(got_calls)


def test_outputs_nested_past_pythons_recursion_are_no_calls():
    deep = "[" * 5000 + "]" * 5000
    hermes = '<tool_call>{"name": "a", "arguments": ARGS}</tool_call>'
    llama = '{"name": "a", "parameters": ARGS}'
    for name, form in (("hermes", hermes), ("llama3_json", llama)):
        for args in (deep, json.dumps(deep)):
            text = form.replace("ARGS", args)
            assert parse_tool_calls(name, text) == (text, [])


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('{"name": "a", "parameters": {"x": 1}}', None, [("a", {"x": 1})]),
        (
            '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"y": [2]}}',
            None,
            [("a", {}), ("b", {"y": [2]})],
        ),
        ('  {"name": "a", "arguments": {}}', None, [("a", {})]),
        # JSON with a name is no call without its arguments: an answer in JSON stays content
        ('{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
        ("Paris is sunny.", "Paris is sunny.", []),
        ('{"name": "a", "parameters": {}} and more', '{"name": "a", "parameters": {}} and more', []),
        ('{"not": "a call"}', '{"not": "a call"}', []),
        ('{"name": "a", "parameters": {', '{"name": "a", "parameters": {', []),
        ("<|python", "<|python", []),
    ],
)
def test_llama3_json_parses_a_whole_output(text, content, calls):
    got_content, got_calls = parse_tool_calls("llama3_json", text)
    assert got_content == content and shown(got_calls) == calls


FRAGMENTS = [
    "Sure",
    " ",
    "\n",
    "<",
    "<tool",
    "<tool_call>",
    "</tool_call>",
    "</tool_",
    "{",
    "}",
    '"',
    '{"name": "f", "arguments": {"a": 1}}',
    '{"name": "g", "parameters": {}}',
    "; ",
    "<|python_tag|>",
    "é東",
    call("h", city="Paris"),
]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_a_stream_gives_what_the_whole_output_gives_however_it_is_split(name):
    rng = random.Random(7)
    for _ in range(400):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 8)))
        want_content, want_calls = parse_tool_calls(name, text)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        parts = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream, content, calls = ToolCallStream(name), "", []
        for k, part in enumerate(parts):
            got, new = stream.feed(part, last=k == len(parts) - 1)
            content += got
            calls += new
        assert [k for k, _ in calls] == list(range(len(calls)))
        assert shown([c for _, c in calls]) == shown(want_calls), (text, parts)
        assert (content or None if calls else content) == want_content, (text, parts)
        if not calls:  # nothing is lost: without calls, the content is the text
            assert content == text


def test_the_stream_holds_back_only_what_may_be_a_tag():
    stream = ToolCallStream("hermes")
    assert stream.feed("Hello <to") == ("Hello ", [])
    assert stream.feed("day") == ("<today", [])
    assert stream.feed("<tool_call>" + '{"name": "a", ') == ("", [])
    content, calls = stream.feed('"arguments": {}}</tool_call>')
    assert content == "" and [(k, c.name) for k, c in calls] == [(0, "a")]
    assert stream.feed("\n") == ("", [])  # whitespace after a call: held (and dropped at the end)
    content, calls = stream.feed(call("b"))
    assert content == "" and [(k, c.name) for k, c in calls] == [(1, "b")]
    assert stream.feed(" ") == ("", [])
    assert stream.feed("Done") == (" Done", [])  # text after a call: at once
    assert stream.feed("", last=True) == ("", []) and stream.calls == 2


def test_max_calls_keeps_the_first():
    content, calls = parse_tool_calls("hermes", "x" + call("a") + call("b") + " tail", max_calls=1)
    assert content == "x tail" and shown(calls) == [("a", {})]


def test_earlier_calls_reach_the_template_with_their_arguments_decoded():
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "w", "arguments": '{"city": "P"}'}}],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "1"},
    ]
    out = chat_messages(history)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "P"} and out[1]["content"] == ""
    for none in ("", None):  # (as vLLM: a call without arguments)
        history[1]["tool_calls"][0]["function"]["arguments"] = none
        assert chat_messages(history)[1]["tool_calls"][0]["function"]["arguments"] == {}
    history[1]["tool_calls"][0]["function"]["arguments"] = '{"city": "P"}'
    assert out[2] == {"role": "tool", "content": "sunny", "tool_call_id": "1"}
    assert history[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "P"}'  # the caller's: untouched
    history[1]["tool_calls"][0]["function"]["arguments"] = "{nope"
    with pytest.raises(ValueError, match=r"messages\.1\.tool_calls\.0\.function\.arguments is not JSON"):
        chat_messages(history)


def test_tools_render_as_transformers_renders_them():
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer

    from minengine.tokenizer import Tokenizer

    ours = Tokenizer(HFTokenizer.from_str(tiny_tokenizer().backend.to_str()), {}, TOOLS_TEMPLATE)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=ours.backend)
    args = {"city": "Paris"}
    calls = [{"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    want = theirs.apply_chat_template(messages, tools=[WEATHER, CLOCK], chat_template=TOOLS_TEMPLATE, tokenize=False)
    as_api = json.loads(json.dumps(messages))
    as_api[1]["tool_calls"][0]["function"]["arguments"] = json.dumps(args)  # the API's form: JSON text
    assert ours.render_chat(as_api, {"tools": [WEATHER, CLOCK]}, add_generation_prompt=False) == want
    assert '"name": "get_weather"' in want and '{"name": "get_weather", "arguments": {"city": "Paris"}}' in want


def test_router_takes_a_tool_call_for_output():
    from minengine.router import _is_output

    delta = {"tool_calls": [{"index": 0, "id": "x", "type": "function", "function": {"name": "a", "arguments": "{}"}}]}
    assert _is_output(b"data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]}).encode())
    assert not _is_output(b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}).encode())


# --- the chat API on scripted outputs ----------------------------------------------------------


def scripted(
    outputs: list[str], parser="hermes", seed=0, reason="stop", tokenizer=None, template=TOOLS_TEMPLATE, **state_fields
):
    """An openai client of the chat API whose model answers choice i with ``outputs[i]``, in
    pieces of random sizes, the choices' pieces interleaved, ending with ``reason``; and the
    fake ``_pieces``, which keeps the choices it was given in ``.seen``."""
    from minengine.server import api
    from minengine.server.frontend import Piece
    from minengine.server.metrics import Metrics
    from minengine.server.protocol import Ready

    tok = tokenizer or tiny_tokenizer()
    rng = random.Random(seed)

    async def fake_pieces(state, choices):
        fake_pieces.seen.append(choices)
        streams = []
        for c in choices:
            text = outputs[c.index]
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 5))) if len(text) > 1 else []
            parts = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            streams.append([c.index, parts])
        while streams:
            index, parts = stream = rng.choice(streams)
            part = parts.pop(0)
            ids = tok.encode(part, add_special_tokens=False)
            entries = None if choices[index].params.logprobs is None else [(-1.0, 1, [i], [-1.0]) for i in ids]
            yield index, Piece(part, ids, None if parts else reason, logprobs=entries)
            if not parts:
                streams.remove(stream)

    fake_pieces.seen = []

    client = SimpleNamespace(ready=Ready(tok.vocab_size, 4096, 1 << 20), dead=None)
    flags = {"enable_auto_tool_choice": parser is not None, "tool_call_parser": parser} | state_fields
    tok.chat_template = template
    state = api.ServerState(client, tok, "tiny", Metrics(), **flags)
    app = api.build_app(state)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http), fake_pieces


@pytest.fixture
def chat_api(monkeypatch):
    from minengine.server import api

    def make(outputs, parser="hermes", **fields):
        client, fake = scripted(outputs, parser, **fields)
        monkeypatch.setattr(api, "_pieces", fake)
        client.seen = fake.seen
        return client

    return make


ASK = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
ANSWER = "Let me look.\n" + call("get_weather", city="Paris") + "\n" + call("get_time")


def test_a_chat_answer_with_tool_calls(chat_api):
    client = chat_api([ANSWER])
    out = asyncio.run(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK]))
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look.\n"
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}),
        ("function", "get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2


def test_a_streamed_answer_has_the_same_calls(chat_api):
    async def run(seed):
        client = chat_api([ANSWER])
        whole = await client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK])
        # the openai client's own accumulation of the deltas (it checks their form)
        async with client.chat.completions.stream(model="tiny", messages=ASK, tools=[WEATHER, CLOCK]) as stream:
            chunks = [event.chunk async for event in stream if event.type == "chunk"]
            final = await stream.get_final_completion()
        return whole, chunks, final

    for seed in range(3):
        whole, chunks, final = asyncio.run(run(seed))
        got, want = final.choices[0], whole.choices[0]
        assert got.finish_reason == "tool_calls" and got.message.content == want.message.content
        strip = lambda calls: [(c.function.name, c.function.arguments) for c in calls]  # noqa: E731
        assert strip(got.message.tool_calls) == strip(want.message.tool_calls)
        deltas = [c for chunk in chunks for ch in chunk.choices for c in ch.delta.tool_calls or ()]
        assert [d.index for d in deltas] == [0, 1] and all(d.id and d.type == "function" for d in deltas)
        assert all("<tool_call" not in (ch.delta.content or "") for chunk in chunks for ch in chunk.choices)


def test_answers_without_calls_and_with_broken_calls_keep_their_text(chat_api):
    broken = "<tool_call>{oops}</tool_call>"
    client = chat_api(["Paris is sunny.", broken])
    out = asyncio.run(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], n=2))
    assert [(c.message.content, c.message.tool_calls, c.finish_reason) for c in out.choices] == [
        ("Paris is sunny.", [], "stop"),
        (broken, [], "stop"),
    ]


@pytest.mark.parametrize("reason, want", [("length", "tool_calls"), ("abort", "abort")])
def test_an_answer_with_calls_ends_with_tool_calls_unless_aborted(chat_api, reason, want):
    for stream in (False, True):
        client = chat_api([ANSWER], reason=reason)
        body = dict(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], stream=stream)
        out = asyncio.run(client.chat.completions.create(**body))
        if stream:
            out = asyncio.run(_collect(out))
        assert out[-1] == want if stream else out.choices[0].finish_reason == want


async def _collect(stream) -> list:
    return [c.choices[0].finish_reason async for c in stream if c.choices and c.choices[0].finish_reason]


def test_streamed_logprobs_and_ids_of_held_text_are_not_lost(chat_api):
    client = chat_api([ANSWER, "\n" + call("get_time") + "\n\n"])
    body = dict(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], n=2, logprobs=True, stream=True)
    body["stream_options"] = {"include_usage": True}

    async def run():
        chunks = [c async for c in await client.chat.completions.create(**body, extra_body={"return_token_ids": True})]
        per_choice = [[0, 0], [0, 0]]
        for c in chunks:
            for ch in c.choices:
                per_choice[ch.index][0] += len(ch.logprobs.content) if ch.logprobs else 0
                per_choice[ch.index][1] += len(ch.model_extra.get("token_ids") or ())
        return per_choice, chunks[-1].usage.completion_tokens

    per_choice, total = asyncio.run(run())
    tok = tiny_tokenizer()
    sizes = [len(tok.encode(t, add_special_tokens=False)) for t in (ANSWER, "\n" + call("get_time") + "\n\n")]
    assert per_choice == [[n, n] for n in sizes] and total == sum(sizes)


def test_a_special_tag_is_kept_in_the_text(chat_api):
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from minengine.server import api
    from minengine.tokenizer import Tokenizer

    backend = HFTokenizer.from_str(tiny_tokenizer().backend.to_str())
    backend.add_tokens([AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)])
    special = Tokenizer(backend, {}, None)
    assert api._special_tags(special, "hermes") and not api._special_tags(tiny_tokenizer(), "hermes")
    for tok, kept in ((special, True), (tiny_tokenizer(), False)):
        client = chat_api([ANSWER], tokenizer=tok)
        for choice in ("auto", "none"):
            asyncio.run(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice=choice))
            assert client.seen[-1][0].params.skip_special_tokens is not (kept and choice == "auto")


def test_a_prefill_server_checks_the_choice_but_finds_no_calls():
    from minengine.server import api

    req = api.ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER]})
    for mode, flags, want in (("null", True, "hermes"), ("decode", True, "hermes"), ("prefill", False, None)):
        state = SimpleNamespace(mode=mode, enable_auto_tool_choice=flags, tool_call_parser="hermes" if flags else None)
        assert api.tool_parser(state, req) == want
    # forced calls: a prefill server samples the first token under the grammar, finds no calls
    required = req.model_copy(update={"tool_choice": "required"})
    assert api.tool_parser(state, required) is None and api.forced_tool(required, None)[0].json
    with pytest.raises(api.APIError, match="allowed: one of the tools"):
        api.tool_parser(state, req.model_copy(update={"tool_choice": {"function": {"name": "nope"}}}))


def test_parallel_tool_calls_false_keeps_the_first_call(chat_api):
    client = chat_api([ANSWER])
    out = asyncio.run(
        client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], parallel_tool_calls=False)
    )
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["get_weather"]


def test_tool_choice_none_shows_the_tools_and_leaves_the_output_alone(chat_api):
    client = chat_api([ANSWER])
    out = asyncio.run(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none"))
    assert out.choices[0].message.content == ANSWER and out.choices[0].message.tool_calls is None
    tokenized = asyncio.run(client._client.post("http://test/tokenize", json={"messages": ASK, "tools": [WEATHER]}))
    assert client.seen[-1][0].prompt_ids == tokenized.json()["tokens"]
    assert json.dumps(WEATHER) in tiny_tokenizer().decode(tokenized.json()["tokens"])
    # as vLLM: no tools to call is no call to find; a tool without its type is a function
    out = asyncio.run(client.chat.completions.create(model="tiny", messages=ASK, tools=[], tool_choice="auto"))
    assert out.choices[0].message.content == ANSWER
    bare = {"function": WEATHER["function"]}
    asyncio.run(client.chat.completions.create(model="tiny", messages=ASK, tools=[bare], tool_choice="none"))
    assert client.seen[-1][0].prompt_ids == tokenized.json()["tokens"]


def test_llama3_json_answers(chat_api):
    client = chat_api(['{"name": "get_weather", "parameters": {"city": "Paris"}}'], parser="llama3_json")
    out = asyncio.run(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER]))
    (c,) = out.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]


UNIQUE = {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            'allowed: one of the tools ("get_weather")',
        ),
        ({"tool_choice": {"type": "function", "function": {}}}, '{"type": "function", "function": {"name": ...}}'),
        ({"tool_choice": {"type": "retrieval", "function": {"name": "get_weather"}}}, '"function": {"name": ...}}'),
        ({"tool_choice": "required", "tools": []}, "no tools are given"),
        ({"response_format": {"type": "json_object"}, "tool_choice": "required"}, "both constrain the output"),
        ({"tool_choice": "sometimes"}, 'allowed: "none", "auto", "required" or a named function'),
        ({"tool_choice": "auto", "tools": None}, "no tools are given"),
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        ({"tools": [{"function": {"name": "a"}, "type": None}]}, "tools.0.type"),
        ({"tools": [{"type": "retrieval", "function": {"name": "a"}}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools.0.function.name"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
        (
            {
                "tool_choice": "required",
                "tools": [{"type": "function", "function": {"name": "f", "parameters": UNIQUE}}],
            },
            "tool_choice schema uses uniqueItems at /items/anyOf/0/properties/parameters/properties/ids, which",
        ),
        (
            {
                "tool_choice": {"type": "function", "function": {"name": "f"}},
                "tools": [{"function": {"name": "f", "parameters": UNIQUE}}],
            },
            "tool_choice schema uses uniqueItems at /properties/ids, which minengine cannot enforce",
        ),
    ],
)
def test_what_cannot_be_done_is_a_400(chat_api, fields, message):
    client = chat_api([ANSWER])
    body = {"model": "tiny", "messages": ASK, "tools": [WEATHER], **fields}
    with pytest.raises(openai.BadRequestError) as err:
        asyncio.run(client.post("/chat/completions", body=body, cast_to=httpx.Response))
    error = err.value.body
    assert message in error["message"] and error["param"] == next(iter(fields)), error


def test_auto_needs_the_server_flags(chat_api):
    client = chat_api([ANSWER], parser=None)
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice and --tool-call-parser"):
        asyncio.run(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER]))
    out = asyncio.run(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none"))
    assert out.choices[0].message.content == ANSWER


# --- a real server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_server():
    from test_server import start_server, stop_server

    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "tools.jinja"
        template.write_text(TOOLS_TEMPLATE)
        flags = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(template))
        flags += ("--reasoning-parser", "qwen3")
        proc, url = start_server("--page-size", "4", *flags)
        yield url
        stop_server(proc)


def test_a_server_shows_the_model_its_tools(tool_server):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    tokenized = httpx.post(tool_server + "/tokenize", json={"messages": history, "tools": [WEATHER, CLOCK]}).json()
    prompt = tiny_tokenizer().decode(tokenized["tokens"], skip_special_tokens=False)
    assert json.dumps(WEATHER) in prompt and json.dumps(CLOCK) in prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    client = openai.OpenAI(base_url=tool_server + "/v1", api_key="none", max_retries=0)
    for stream in (False, True):
        body = dict(model="tiny", messages=history, tools=[WEATHER, CLOCK], max_tokens=4, temperature=0)
        if stream:
            chunks = list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
            usage, reasons = chunks[-1].usage, [c.choices[0].finish_reason for c in chunks if c.choices]
        else:
            out = client.chat.completions.create(**body)
            usage, reasons = out.usage, [out.choices[0].finish_reason]
            # (and no <think> in it: no reasoning)
            assert out.choices[0].message.model_extra["reasoning"] is None
        # the random model writes no call: its text is the answer, ended as usual
        assert usage.prompt_tokens == tokenized["count"] and reasons[-1] in ("stop", "length")
    bad = json.loads(json.dumps(history))
    bad[1]["tool_calls"][0]["function"]["arguments"] = "{city"
    r = httpx.post(tool_server + "/v1/chat/completions", json={"messages": bad, "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "messages.1.tool_calls.0.function.arguments is not JSON" in r.json()["error"]["message"]


def test_the_template_gets_the_tools_as_given():
    """No tools is None (the template's default); an empty list is an empty list, as vLLM gives it."""
    from minengine.server import api

    req = api.ChatCompletionRequest.model_validate
    assert api._tool_dicts(req({"messages": ASK}).tools) is None
    assert api._tool_dicts(req({"messages": ASK, "tools": []}).tools) == []
    tool = {"function": {"name": "a", "strict": True}}  # (type defaults to function; extra fields stay)
    assert api._tool_dicts(req({"messages": ASK, "tools": [tool]}).tools) == [{"type": "function", **tool}]


def test_the_completions_api_refuses_tools(chat_api):
    client = chat_api(["x"])
    for body in ({"tools": [WEATHER]}, {"tool_choice": "auto"}):
        r = asyncio.run(client._client.post("http://test/v1/completions", json={"prompt": "hi", **body}))
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(body)), r.text


def test_llama3_json_needs_no_special_token_kept():
    """Its calls parse without <|python_tag|> (a special token of Llama 3.1's tokenizer), so the
    request's skip_special_tokens stays."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from minengine.server import api
    from minengine.tokenizer import Tokenizer

    backend = HFTokenizer.from_str(tiny_tokenizer().backend.to_str())
    backend.add_tokens([AddedToken("<|python_tag|>", special=True)])
    assert not api._special_tags(Tokenizer(backend, {}, None), "llama3_json")
    assert parse_tool_calls("llama3_json", '{"name": "a", "parameters": {}}')[1]


# --- tool_choice "required" and named: calls forced by structured outputs -------------------------

REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'


@pytest.mark.parametrize(
    "name, text, content, calls",
    [
        ("required", REQUIRED, None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
        ("required", "[]", "[]", []),  # (the schema asks for one call at least: no calls, as written)
        ("required", '[{"name": "a", "parameters": {}}, {"nam', '[{"name": "a", "parameters": {}}, {"nam', []),
        ("required", '{"name": "a", "parameters": {}}', '{"name": "a", "parameters": {}}', []),
        ("named", '{"city": "東京"}', None, [("get_weather", {"city": "東京"})]),
        ("named", '{"city": "Par', '{"city": "Par', []),  # cut short: content
        ("named", "[1]", "[1]", []),
    ],
)
def test_forced_outputs_parse_whole_and_streamed(name, text, content, calls):
    assert (lambda c: (c[0], shown(c[1])))(parse_tool_calls(name, text, None, "get_weather")) == (content, calls)
    rng = random.Random(0)
    for _ in range(20):  # streamed in random pieces: nothing comes out before the end
        stream, cuts = ToolCallStream(name, None, "get_weather"), sorted(rng.sample(range(len(text) + 1), 3))
        parts = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert all(stream.feed(p) == ("", []) for p in parts)
        got_content, got_calls = stream.feed("", last=True)
        assert ((got_content or None) if calls else got_content, shown([c for _, c in got_calls])) == (content, calls)


def test_forced_finish_reasons_are_vllms():
    # "required": tool_calls when the output ended itself; named: stop (as the OpenAI API)
    assert [finish_reason("required", r, True) for r in ("stop", "length", "abort")] == [
        "tool_calls",
        "length",
        "abort",
    ]
    assert [finish_reason("named", r, True) for r in ("stop", "length")] == ["stop", "length"]
    assert [finish_reason("hermes", r, True) for r in ("stop", "length", "abort", None)] == [
        "tool_calls",
        "tool_calls",
        "abort",
        None,
    ]
    assert finish_reason("required", "stop", False) == "stop"


def test_the_required_schema_lists_the_tools_and_gathers_their_definitions():
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    fns = [
        {
            "name": "a",
            "parameters": {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": point}},
        },
        {"name": "b", "parameters": None},
    ]
    schema = required_calls_schema(fns)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["$defs"] == {"P": point}
    options = schema["items"]["anyOf"]
    assert [o["properties"]["name"]["enum"] for o in options] == [["a"], ["b"]]
    assert "$defs" not in options[0]["properties"]["parameters"] and fns[0]["parameters"]["$defs"] == {"P": point}
    assert options[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    other = {"name": "c", "parameters": {"$defs": {"P": {"type": "string"}}}}
    with pytest.raises(ValueError, match="twice"):
        required_calls_schema([*fns, other])
    with pytest.raises(ValueError, match="has \\$defs 5; allowed: an object"):
        required_calls_schema([{"name": "d", "parameters": {"$defs": 5}}])


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choice_answer_with_calls(chat_api, stream):
    xgrammar = pytest.importorskip("xgrammar")  # (a test dependency: CI has it)
    del xgrammar

    async def ask(client, **fields):
        body = dict(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], stream=stream, **fields)
        if not stream:
            return (await client.chat.completions.create(**body)).choices[0]
        async with client.chat.completions.stream(**{k: v for k, v in body.items() if k != "stream"}) as s:
            async for _ in s:
                pass
            return (await s.get_final_completion()).choices[0]

    client = chat_api([REQUIRED], parser=None)  # (no --tool-call-parser needed)
    got = asyncio.run(ask(client, tool_choice="required"))
    assert got.finish_reason == "tool_calls" and not got.message.content  # (a stream: "" from the role chunk)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got.message.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    spec = client.seen[-1][0].params.structured_outputs
    assert json.loads(spec.json) == required_calls_schema([WEATHER["function"], CLOCK["function"]])
    got = asyncio.run(ask(client, tool_choice="required", parallel_tool_calls=False))
    assert [c.function.name for c in got.message.tool_calls] == ["get_weather"]

    client = chat_api(['{"city": "Paris"}'], parser=None)
    got = asyncio.run(ask(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert got.finish_reason == "stop" and not got.message.content
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    assert json.loads(client.seen[-1][0].params.structured_outputs.json) == WEATHER["function"]["parameters"]
    # a function without parameters: any object
    got = asyncio.run(ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert json.loads(client.seen[-1][0].params.structured_outputs.json) == {"type": "object", "properties": {}}
