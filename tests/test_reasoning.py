"""vLLM's ``--reasoning-parser`` (``qwen3``, ``deepseek_r1``) and ``include_reasoning``: the
parsers, streamed against whole; the chat API on scripted outputs, with and without tool calls."""

from __future__ import annotations

import asyncio
import random

import openai
import pytest
from test_tool_calls import ASK, CLOCK, WEATHER, call, scripted

from minengine.models.tiny import tiny_tokenizer
from minengine.server.reasoning import PARSERS, ReasoningStream, prompt_opens_reasoning, split_reasoning

# a template that opens the model's <think> block, or closes an empty one (as Qwen3's with
# enable_thinking false)
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)


@pytest.mark.parametrize(
    "name, text, opens, reasoning, content",
    [
        ("qwen3", "<think>\nplan\n</think>\n\nAnswer", False, "\nplan\n", "\n\nAnswer"),
        ("qwen3", "\n<think>plan</think>Answer", False, "plan", "Answer"),
        ("qwen3", "Answer without reasoning", False, "", "Answer without reasoning"),
        ("qwen3", "plan</think>Answer", False, "", "plan</think>Answer"),  # nothing opened it
        ("qwen3", "plan</think>Answer", True, "plan", "Answer"),  # the prompt opened it
        ("qwen3", "<think>cut off mid-thought", False, "cut off mid-thought", ""),
        ("qwen3", "  <thi", False, "", "  <thi"),
        ("qwen3", "", False, "", ""),
        ("deepseek_r1", "plan</think>Answer", False, "plan", "Answer"),
        ("deepseek_r1", "<think>plan</think>Answer", False, "plan", "Answer"),
        ("deepseek_r1", "still thinking", False, "still thinking", ""),
        ("deepseek_r1", "a</think>b</think>c", False, "a", "b</think>c"),
    ],
)
def test_whole_outputs(name, text, opens, reasoning, content):
    assert split_reasoning(name, text, opens) == (reasoning, content)


def test_where_a_prompt_leaves_the_model():
    # how templates end the prompt: Qwen3-Thinking's, QwQ's, R1's open the block; Qwen3's with
    # thinking on let the model open it, with it off close an empty one
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert prompt_opens_reasoning("<｜Assistant｜><think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # a <think> the user wrote opens nothing
    assert not prompt_opens_reasoning("<|im_start|>user\nwhat is <think>?<|im_end|>\n<|im_start|>assistant\n")
    # continue_final_message: the final message's own block
    prompt = "<|im_start|>assistant\n<think>\nThe plan so far"
    assert prompt_opens_reasoning(prompt, final="<think>\nThe plan so far")
    assert not prompt_opens_reasoning(prompt + "</think>ok", final="<think>\nThe plan so far</think>ok")
    assert not prompt_opens_reasoning(prompt)
    with pytest.raises(ValueError, match="allowed: deepseek_r1, qwen3"):
        ReasoningStream("granite")


FRAGMENTS = ["<think>", "</think>", "<th", "</thi", "<", " ", "\n", "plan", "é東🚀", ">", "/"]


@pytest.mark.parametrize("name", PARSERS)
@pytest.mark.parametrize("opens", [False, True])
def test_a_stream_gives_what_the_whole_output_gives_however_it_is_split(name, opens):
    rng = random.Random(11)
    for _ in range(400):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 8)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        parts = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream, reasoning, content = ReasoningStream(name, opens), "", ""
        for k, part in enumerate(parts):
            r, c = stream.feed(part, last=k == len(parts) - 1)
            reasoning, content = reasoning + r, content + c
        assert (reasoning, content) == split_reasoning(name, text, opens), (text, parts)
        # nothing is lost: without tags, the output is all reasoning or all content
        if "<think>" not in text and "</think>" not in text:
            assert reasoning + content == text and not (reasoning and content)


def test_the_stream_holds_back_only_what_may_be_a_tag():
    stream = ReasoningStream("qwen3")
    assert stream.feed(" <th") == ("", "")
    assert stream.feed("ink>First") == ("First", "")
    assert stream.feed(" step </th") == (" step ", "")
    assert stream.feed("ink>\n\nAnswer") == ("", "\n\nAnswer")
    assert stream.feed(" more", last=True) == ("", " more")


# --- the chat API -------------------------------------------------------------------------------


@pytest.fixture
def chat_api(monkeypatch):
    from minengine.server import api

    def make(outputs, **fields):
        client, fake = scripted(outputs, **fields)
        monkeypatch.setattr(api, "_pieces", fake)
        return client

    return make


THOUGHT = "<think>\nThe user wants the weather. <tool_call> is how I call.\n</think>\n\n"


def _stream(client, **body):
    async def run():
        chunks = [
            c async for c in await client.chat.completions.create(model="tiny", messages=ASK, stream=True, **body)
        ]
        reasoning = "".join((ch.delta.model_extra or {}).get("reasoning") or "" for c in chunks for ch in c.choices)
        content = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
        calls = [t for c in chunks for ch in c.choices for t in ch.delta.tool_calls or ()]
        reasons = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
        return reasoning, content, calls, reasons

    return asyncio.run(run())


def test_a_chat_answer_with_reasoning(chat_api):
    for seed in range(3):
        client = chat_api([THOUGHT + "It is sunny."], parser=None, reasoning_parser="qwen3", seed=seed)
        out = asyncio.run(client.chat.completions.create(model="tiny", messages=ASK))
        message = out.choices[0].message
        assert message.model_extra["reasoning"] == THOUGHT[len("<think>") : -len("</think>\n\n")]
        assert message.content == "\n\nIt is sunny." and out.choices[0].finish_reason == "stop"
        reasoning, content, _, reasons = _stream(client)
        assert (reasoning, content, reasons) == (message.model_extra["reasoning"], message.content, ["stop"])
    # include_reasoning false: the answer alone
    out = asyncio.run(
        client.chat.completions.create(model="tiny", messages=ASK, extra_body={"include_reasoning": False})
    )
    assert (
        out.choices[0].message.model_extra["reasoning"] is None and out.choices[0].message.content == "\n\nIt is sunny."
    )
    assert _stream(client, extra_body={"include_reasoning": False})[:2] == ("", "\n\nIt is sunny.")


def test_calls_are_found_after_the_reasoning(chat_api):
    """A tag in the reasoning is no call; the calls after it are (the content: none)."""
    output = THOUGHT + call("get_weather", city="Paris") + "\n" + call("get_time")
    client = chat_api([output], reasoning_parser="qwen3")
    out = asyncio.run(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK]))
    (choice,) = out.choices
    assert "<tool_call> is how I call" in choice.message.model_extra["reasoning"]
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "get_time"]
    reasoning, content, calls, reasons = _stream(client, tools=[WEATHER, CLOCK])
    assert reasoning == choice.message.model_extra["reasoning"] and content == "" and reasons == ["tool_calls"]
    assert [(c.index, c.function.name) for c in calls] == [(0, "get_weather"), (1, "get_time")]


def test_a_template_that_opens_the_block(chat_api):
    client = chat_api(
        ["The plan.</think>\n\nAnswer."], parser=None, reasoning_parser="qwen3", template=THINKING_TEMPLATE
    )
    out = asyncio.run(client.chat.completions.create(model="tiny", messages=ASK))
    assert (out.choices[0].message.model_extra["reasoning"], out.choices[0].message.content) == (
        "The plan.",
        "\n\nAnswer.",
    )
    # with enable_thinking false the template closes an empty block: the output is the answer
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    out = asyncio.run(client.chat.completions.create(model="tiny", messages=ASK, extra_body=off))
    assert out.choices[0].message.model_extra["reasoning"] is None
    assert out.choices[0].message.content == "The plan.</think>\n\nAnswer."


def test_the_router_takes_reasoning_for_output():
    import json

    from minengine.router import _is_output

    event = {"choices": [{"index": 0, "delta": {"reasoning": "hmm"}}]}
    assert _is_output(b"data: " + json.dumps(event).encode())


def test_the_flag():
    from minengine.serve import parse_args

    assert parse_args(["--reasoning-parser", "qwen3"])[0].reasoning_parser == "qwen3"
    with pytest.raises(SystemExit):
        parse_args(["--reasoning-parser", "granite"])


def test_a_think_tag_in_the_question_is_no_reasoning(chat_api):
    client = chat_api(["It marks reasoning."], parser=None, reasoning_parser="qwen3", template=THINKING_TEMPLATE)
    ask = [{"role": "user", "content": "what does <think> mean?"}]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    out = asyncio.run(client.chat.completions.create(model="tiny", messages=ask, extra_body=off))
    assert out.choices[0].message.content == "It marks reasoning."
    # going on with a final message whose block is open: reasoning until it closes
    client = chat_api([" so far.</think>Done."], parser=None, reasoning_parser="qwen3")
    partial = [*ask, {"role": "assistant", "content": "<think>The plan"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    out = asyncio.run(client.chat.completions.create(model="tiny", messages=partial, extra_body=extra))
    assert (out.choices[0].message.model_extra["reasoning"], out.choices[0].message.content) == (" so far.", "Done.")


@pytest.mark.parametrize(
    "output, tools, reasoning, content",
    [
        ("", True, False, ""),  # tools alone: no text is "" (as before, and as vLLM)
        ("", False, True, None),  # reasoning looked for: null
        ("", True, True, None),
        ("  ", True, False, "  "),
        (call("get_time"), True, False, None),
        ("<think>r</think>", False, True, None),
        ("<think>r</think>text", True, True, "text"),
        ("<think>r</think>\n" + call("get_time"), True, True, None),
    ],
)
def test_empty_content_is_null_only_where_vllm_makes_it_null(chat_api, output, tools, reasoning, content):
    fields = {"parser": "hermes" if tools else None, "reasoning_parser": "qwen3" if reasoning else None}
    client = chat_api([output], **fields)
    out = asyncio.run(client.chat.completions.create(model="tiny", messages=ASK, tools=[CLOCK] if tools else None))
    assert out.choices[0].message.content == content
    assert ("reasoning" in out.choices[0].message.model_extra) == reasoning


def test_deepseek_r1_and_reasoning_left_out_with_calls(chat_api):
    client = chat_api(["Plan: call it.</think>" + call("get_time")], reasoning_parser="deepseek_r1")
    out = asyncio.run(client.chat.completions.create(model="tiny", messages=ASK, tools=[CLOCK]))
    (c,) = out.choices
    assert c.message.model_extra["reasoning"] == "Plan: call it." and c.message.content is None
    assert [t.function.name for t in c.message.tool_calls] == ["get_time"] and c.finish_reason == "tool_calls"
    out = asyncio.run(
        client.chat.completions.create(
            model="tiny", messages=ASK, tools=[CLOCK], extra_body={"include_reasoning": False}
        )
    )
    assert out.choices[0].message.model_extra["reasoning"] is None and out.choices[0].message.tool_calls
    reasoning, content, calls, _ = _stream(client, tools=[CLOCK], extra_body={"include_reasoning": False})
    assert (reasoning, content, [t.function.name for t in calls]) == ("", "", ["get_time"])


@pytest.mark.parametrize("reason", ["length", "abort"])
def test_an_answer_cut_off_mid_reasoning(chat_api, reason):
    client = chat_api(["<think>half a thou"], parser=None, reasoning_parser="qwen3", reason=reason)
    out = asyncio.run(client.chat.completions.create(model="tiny", messages=ASK))
    (c,) = out.choices
    assert (c.message.model_extra["reasoning"], c.message.content, c.finish_reason) == ("half a thou", None, reason)
    assert _stream(client)[::3] == ("half a thou", [reason])


def test_a_reasoning_sent_back_reaches_the_template_by_both_names(chat_api):
    shows = "{% for m in messages %}[{{ m.role }}:{{ m.reasoning_content }}|{{ m.reasoning }}]{% endfor %}"
    client = chat_api(["x"], parser=None, reasoning_parser="qwen3", template=shows)
    history = [
        {"role": "assistant", "content": "a", "reasoning": "r1"},
        {"role": "assistant", "content": "b", "reasoning_content": "r2"},
    ]
    r = asyncio.run(
        client._client.post("http://test/tokenize", json={"messages": history, "add_generation_prompt": False})
    )
    assert tiny_tokenizer().decode(r.json()["tokens"]) == "[assistant:r1|r1][assistant:r2|r2]"


def test_streamed_and_whole_answers_agree_through_the_api():
    """Random outputs of reasoning, text and calls, three choices interleaved, with logprobs and
    token ids: a stream adds up to the whole answer."""
    from minengine.server import api

    pieces = [
        "<think>",
        "</think>",
        "</th",
        "<",
        "plan ",
        "text ",
        "\n",
        call("get_time"),
        call("get_weather", city="P"),
        "<tool",
    ]
    rng = random.Random(5)
    for trial in range(30):
        outputs = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 6))) for _ in range(3)]
        fields = {"reasoning_parser": rng.choice(PARSERS), "parser": rng.choice(["hermes", None])}
        body = dict(model="tiny", messages=ASK, n=3, logprobs=True, tools=[CLOCK, WEATHER])
        body["tool_choice"] = "auto" if fields["parser"] else "none"
        extra = {"return_token_ids": True, "include_reasoning": rng.random() < 0.7}

        async def run(outputs, trial, fields, body, extra):
            client, fake = scripted(outputs, seed=trial, **fields)
            orig, api._pieces = api._pieces, fake
            try:
                whole = await client.chat.completions.create(**body, extra_body=extra)
                chunks = [c async for c in await client.chat.completions.create(**body, extra_body=extra, stream=True)]
            finally:
                api._pieces = orig
            return whole, chunks

        whole, chunks = asyncio.run(run(outputs, trial, fields, body, extra))
        for want in whole.choices:
            got = [ch for c in chunks for ch in c.choices if ch.index == want.index]
            reasoning = "".join((ch.delta.model_extra or {}).get("reasoning") or "" for ch in got)
            content = "".join(ch.delta.content or "" for ch in got)
            calls = [(t.function.name, t.function.arguments) for ch in got for t in ch.delta.tool_calls or ()]
            assert reasoning == (want.message.model_extra.get("reasoning") or ""), outputs
            assert content == (want.message.content or ""), outputs
            assert calls == [(t.function.name, t.function.arguments) for t in want.message.tool_calls or ()]
            assert [ch.finish_reason for ch in got if ch.finish_reason] == [want.finish_reason]
            assert sum(len(ch.logprobs.content) for ch in got if ch.logprobs) == len(want.logprobs.content)
            ids = [i for ch in got for i in ch.model_extra.get("token_ids") or ()]
            assert ids == want.model_extra["token_ids"]


def test_a_constrained_answer_has_its_grammar_start_after_the_reasoning(monkeypatch):
    """As vLLM with a reasoning parser: the grammar of ``response_format``, ``structured_outputs``
    or a forced ``tool_choice`` starts after the reasoning, where the parser finds it (the engine
    side: test_structured.py). Only with <think> and </think> as tokens; not a field of the API."""
    from minengine.server import api

    thinking = tiny_tokenizer()
    thinking.backend.add_tokens(["<think>", "</think>"])

    def reasoning_of(parser, tokenizer=thinking, **body):
        client, fake = scripted(
            ["{}"], parser=None, reasoning_parser=parser, tokenizer=tokenizer, template=THINKING_TEMPLATE
        )
        monkeypatch.setattr(api, "_pieces", fake)
        asyncio.run(client.chat.completions.create(model="tiny", messages=ASK, **body))
        spec = fake.seen[0][0].params.structured_outputs
        return spec.reasoning if spec is not None else "unconstrained"

    fmt = {"response_format": {"type": "json_object"}}
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert reasoning_of("qwen3", **fmt) == "open"  # the template opens the block
    assert reasoning_of("qwen3", **fmt, extra_body=off) == "may_open"  # closed an empty one: the output may open one
    assert reasoning_of("deepseek_r1", **fmt, extra_body=off) == "open"  # (R1's output always reasons first)
    assert reasoning_of(None, **fmt) is None
    assert reasoning_of("qwen3", tokenizer=tiny_tokenizer(), **fmt) is None  # no such tokens
    assert reasoning_of("qwen3") == "unconstrained"
    so = {"structured_outputs": {"choice": ["a", "b"]}}
    assert reasoning_of("qwen3", extra_body=so) == "open"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert reasoning_of("qwen3", tools=[WEATHER], tool_choice=named) == "open"
    assert reasoning_of("qwen3", tools=[WEATHER], tool_choice="required", extra_body=off) == "may_open"
    with pytest.raises(openai.BadRequestError, match='structured_outputs has field "reasoning"'):
        reasoning_of("qwen3", extra_body={"structured_outputs": {"choice": ["a"], "reasoning": "open"}})
