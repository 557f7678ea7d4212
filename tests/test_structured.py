"""Structured outputs (vLLM's ``structured_outputs``, the OpenAI API's ``response_format``): the
constraint's checks, the bitmask against a reference, the engine (every kind, greedy and sampled,
overlap on and off, constrained and free requests in one batch, ``ignore_eos``, a token the grammar
cannot take), and a real server through the openai client."""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest
import torch
import xgrammar as xgr

from minengine import LLM
from minengine.models.tiny import EOS_ID, tiny_tokenizer
from minengine.sampling_params import SamplingParams
from minengine.structured import MAX_SCHEMA_DEPTH, MAX_SOURCE_CHARS, StructuredOutputs, apply_mask

SCHEMA = {
    "type": "object",
    "properties": {"unit": {"type": "string", "enum": ["c", "f"]}, "ok": {"type": "boolean"}},
    "required": ["unit", "ok"],
}
COLORS = ["red", "green", "blue", 'say "hi"\n']
# each kind, and how to tell an output that follows it (a whole one)
KINDS = [
    (StructuredOutputs(json=SCHEMA, disable_any_whitespace=True), lambda t: _follows_schema(json.loads(t))),
    (StructuredOutputs(regex="[a-c]{2,4}-[0-9]"), lambda t: re.fullmatch("[a-c]{2,4}-[0-9]", t)),
    (StructuredOutputs(choice=COLORS), lambda t: t in COLORS),
    (StructuredOutputs(grammar='root ::= "A" [0-9]+ "Z"'), lambda t: re.fullmatch("A[0-9]+Z", t)),
    (StructuredOutputs(json_object=True, disable_any_whitespace=True), lambda t: isinstance(json.loads(t), dict)),
]


def _nested(depth: int) -> dict:
    """A schema of arrays ``depth`` deep (its brackets one deeper), with a bracket in a string."""
    schema = {"type": "string", "pattern": "[{]"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def _follows_schema(value) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"unit", "ok"}
        and value["unit"] in ("c", "f")
        and value["ok"] in (True, False)
    )


def _matcher(spec: StructuredOutputs):
    """A fresh matcher of ``spec`` for the tiny model, compiled apart from the engine's."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer().backend)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=260, stop_token_ids=[EOS_ID, 259])
    compiler = xgr.GrammarCompiler(info)
    kind, source, any_whitespace = spec.key
    if kind == "json":
        return xgr.GrammarMatcher(compiler.compile_json_schema(source, any_whitespace=any_whitespace))
    if kind == "regex":
        return xgr.GrammarMatcher(compiler.compile_regex(source))
    return xgr.GrammarMatcher(compiler.compile_grammar(source))


def _check_output(spec, follows, out) -> None:
    """Every token of ``out`` is one the grammar allowed; a stopped one is complete."""
    matcher = _matcher(spec)
    assert all(matcher.accept_token(t) for t in out.token_ids), (out.text, out.token_ids)
    if out.finish_reason == "stop":
        assert matcher.is_terminated() and follows(out.text), out.text
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 40


# --- the constraint ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, "gives no constraint; allowed: exactly one of json, regex, choice, grammar, json_object"),
        ({"regex": "a", "choice": ["a"]}, "gives regex and choice; allowed: exactly one"),
        ({"json": {"type": "bogus"}}, 'json is no JSON schema xgrammar takes: Unsupported type "bogus"'),
        ({"json": "{not json"}, "json is no JSON schema xgrammar takes"),
        ({"json": {"x": object()}}, "json is not JSON-serializable"),
        ({"regex": "("}, "regex does not parse: Regex parsing error at position 2"),
        ({"grammar": "root ::= x"}, 'grammar does not parse: EBNF parser error at line 1, column 10: Rule "x" is not'),
        ({"choice": []}, "choice is []; allowed: a non-empty list of strings"),
        ({"choice": ["a", "\ud800"]}, "choice does not parse: 'utf-8' codec can't encode"),
        ({"choice": ["a", 1]}, "allowed: a non-empty list of strings"),
        ({"regex": 3}, "regex is int; allowed: a string"),
        ({"json_object": "yes"}, "json_object is 'yes'; allowed: true, false or null"),
        ({"json_object": 1}, "json_object is 1; allowed: true, false or null"),
        # parses, but does not compile: found when the request comes, not in the scheduler's step
        ({"json": {"type": "string", "minLength": -1}}, "Invalid repetition range"),
        (
            {"json": _nested(MAX_SCHEMA_DEPTH)},
            f"json nests {MAX_SCHEMA_DEPTH + 1} deep; allowed: at most {MAX_SCHEMA_DEPTH}",
        ),
        ({"json_object": True, "disable_any_whitespace": 1}, "disable_any_whitespace is 1; allowed: true or false"),
        ({"regex": "a" * (MAX_SOURCE_CHARS + 1)}, f"allowed: at most {MAX_SOURCE_CHARS}"),
    ],
)
def test_a_bad_constraint_is_a_value_error_naming_it(fields, message):
    with pytest.raises(ValueError, match="structured_outputs") as err:
        StructuredOutputs(**fields).check()
    assert message in str(err.value)


def test_the_mask_bans_exactly_the_tokens_whose_bits_are_0():
    g = torch.Generator().manual_seed(0)
    for vocab in (1, 31, 32, 70, 260):
        words = (vocab + 31) // 32
        mask = torch.randint(-(2**31), 2**31, (5, words), generator=g, dtype=torch.int64).to(torch.int32)
        mask[0] = -1  # a row without a constraint
        logits = torch.randn(5, vocab, generator=g)
        want = logits.clone().double()
        for row in range(5):
            for token in range(vocab):
                if not (int(mask[row, token // 32]) >> (token % 32)) & 1:
                    want[row, token] = float("-inf")
        apply_mask(logits, mask)
        assert torch.equal(logits.double(), want)


# --- the engine ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines():
    made = {overlap: LLM("tiny", disable_overlap_schedule=not overlap, max_running_requests=8) for overlap in (1, 0)}
    yield made
    for llm in made.values():
        llm.shutdown()


PROMPTS = ["hello", "The answer is", "{", "x" * 30, "colors:"] * 2


def _run(llm, temperature):
    """Every kind, each next to a free request, in one batch."""
    params = []
    for i, (spec, _) in enumerate(KINDS):
        seed = {"seed": i} if temperature else {}
        params.append(SamplingParams(max_tokens=40, temperature=temperature, structured_outputs=spec, **seed))
        params.append(SamplingParams(max_tokens=40, temperature=temperature, **seed))
    return llm.generate(PROMPTS, params, use_tqdm=False)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_follow_their_constraint_with_overlap_on_and_off(engines, temperature):
    got = {overlap: _run(llm, temperature) for overlap, llm in engines.items()}
    for overlap in got:
        for i, (spec, follows) in enumerate(KINDS):
            _check_output(spec, follows, got[overlap][2 * i].outputs[0])
    # the same tokens either way (the constrained ones too: with overlap, their step samples
    # once the step in flight is read), and the free requests are left alone
    assert [o.outputs[0].token_ids for o in got[1]] == [o.outputs[0].token_ids for o in got[0]]
    free = _run_free(engines[0], temperature)
    assert [o.outputs[0].token_ids for o in got[0][1::2]] == free
    if temperature == 0:  # at least two kinds end by themselves on the tiny model
        assert sum(o.outputs[0].finish_reason == "stop" for o in got[0][0::2]) >= 2


def _run_free(llm, temperature):
    params = [
        SamplingParams(max_tokens=40, temperature=temperature, **({"seed": i} if temperature else {}))
        for i in range(len(KINDS))
    ]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS[1::2], params, use_tqdm=False)]


def test_a_complete_output_stops_also_with_ignore_eos(engines):
    spec = StructuredOutputs(choice=["yes", "no"])
    for llm in engines.values():
        (out,) = llm.generate(
            ["ok?"],
            SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, structured_outputs=spec),
            use_tqdm=False,
        )
        o = out.outputs[0]
        assert o.finish_reason == "stop" and o.text in ("yes", "no") and o.token_ids[-1] in (EOS_ID, 259)


def test_a_token_the_grammar_cannot_take_frees_the_request_with_a_warning(engines, caplog):
    # min_tokens bans the end the complete grammar allows: every logit is -inf, the argmax is token 0
    spec = StructuredOutputs(choice=["a"])
    params = SamplingParams(max_tokens=6, min_tokens=4, temperature=0, structured_outputs=spec)
    with caplog.at_level(logging.WARNING, logger="minengine.structured"):
        (out,) = engines[1].generate(["x"], params, use_tqdm=False)
    o = out.outputs[0]
    assert o.token_ids[:2] == [ord("a"), 0] and o.finish_reason in ("length", "stop")
    assert "output token 0 is not allowed by the grammar" in caplog.text


def test_a_deep_schema_within_the_bound_compiles():
    StructuredOutputs(json=_nested(MAX_SCHEMA_DEPTH - 1)).check()


def test_a_step_sampled_after_a_request_ended_makes_none_of_its_state_again(engines):
    # with overlap, the step after the one that ends a request samples once that one is read: the
    # finished request's penalty counts, prompt marks and bad-word tail stay dropped
    engine = engines[1].engine
    spec = StructuredOutputs(choice=["ab"])
    reqs = [
        engine.add_request(
            [65, 66], SamplingParams(max_tokens=8, temperature=0, frequency_penalty=0.5, structured_outputs=spec)
        ),
        engine.add_request(
            [67, 68],
            SamplingParams(
                max_tokens=8, temperature=0, repetition_penalty=1.2, bad_words=["zz"], stop_token_ids=list(range(260))
            ),
        ),
    ]
    while engine.has_unfinished():
        engine.step()
    assert [r.finish_reason for r in reqs] == ["stop", "stop"] and reqs[0].output_ids[:2] == [ord("a"), ord("b")]
    assert all(r.output_counts is None and r.prompt_seen is None and r.output_tail is None for r in reqs)


def test_a_bad_constraint_is_refused_before_it_runs(engines):
    llm = engines[1]
    with pytest.raises(ValueError, match="structured_outputs regex does not parse"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputs(regex="[")), use_tqdm=False)
    assert not llm.engine.has_unfinished()


# --- a real server -------------------------------------------------------------------------------


def test_response_format_and_structured_outputs_through_the_api(client):
    ask = [{"role": "user", "content": "Give me a unit."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "unit", "schema": SCHEMA}}
    body = dict(model="tiny", messages=ask, temperature=0, max_tokens=60, response_format=fmt)
    whole = client.chat.completions.create(**body).choices[0]
    streamed = client.chat.completions.create(**body, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole.message.content
    if whole.finish_reason == "stop":
        assert _follows_schema(json.loads(whole.message.content))
    else:  # (any whitespace between JSON tokens: a random model may go on with it)
        assert whole.message.content.startswith("{")
    # vLLM's structured_outputs, in the chat and the completions API
    out = client.chat.completions.create(
        model="tiny", messages=ask, temperature=0, max_tokens=20, extra_body={"structured_outputs": {"choice": COLORS}}
    )
    assert out.choices[0].message.content in COLORS and out.choices[0].finish_reason == "stop"
    out = client.completions.create(
        model="tiny",
        prompt="id:",
        max_tokens=20,
        n=3,
        seed=1,
        extra_body={"structured_outputs": {"regex": "[a-c]{2,4}-[0-9]"}},
    )
    assert all(re.fullmatch("[a-c]{2,4}-[0-9]", c.text) and c.finish_reason == "stop" for c in out.choices)
    out = client.chat.completions.create(
        model="tiny", messages=ask, temperature=0, max_tokens=30, response_format={"type": "json_object"}
    )
    assert out.choices[0].message.content.startswith("{")
    out = client.chat.completions.create(model="tiny", messages=ask, max_tokens=2, response_format={"type": "text"})
    assert out.choices[0].finish_reason == "length"


def test_tool_choice_required_runs_under_its_schema(client):
    unit = {
        "type": "function",
        "function": {
            "name": "set_unit",
            "parameters": {"type": "object", "properties": {"u": {"enum": ["c", "f"]}}, "required": ["u"]},
        },
    }
    body = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], tools=[unit], temperature=0, max_tokens=60)
    for choice in ("required", {"type": "function", "function": {"name": "set_unit"}}):
        out = client.chat.completions.create(**body, tool_choice=choice).choices[0]
        if out.message.tool_calls:  # the output ended by itself: calls, as the schema has them
            assert out.finish_reason == ("tool_calls" if choice == "required" else "stop")
            assert all(json.loads(c.function.arguments)["u"] in ("c", "f") for c in out.message.tool_calls)
        else:  # cut short (whitespace may go on): its JSON so far, as content
            assert out.finish_reason == "length" and out.message.content.lstrip().startswith(
                "[" if choice == "required" else "{"
            )


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", '"schema"'),
        ({"response_format": {"type": "structural_tag"}}, "response_format", '"text", "json_object" or "json_schema"'),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}},
            "response_format",
            'response_format schema is no JSON schema xgrammar takes: Unsupported type "bogus"',
        ),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs", "regex does not parse"),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", 'has field "regexp"; allowed: json, regex'),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern"),
        ({"structured_outputs": {}}, "structured_outputs", "gives no constraint"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "response_format",
            "structured_outputs and response_format both constrain the output",
        ),
        ({"guided_json": {"type": "object"}}, "guided_json", "does not support it"),
    ],
)
def test_a_bad_constraint_is_a_400_and_the_server_goes_on(server, fields, param, message):
    for path, extra in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("/v1/completions", {"prompt": "x"}),
    ):
        r = httpx.post(server + path, json={"model": "tiny", "max_tokens": 2, **extra, **fields})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and message in error["message"], error
    assert (
        httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}).status_code
        == 200
    )
