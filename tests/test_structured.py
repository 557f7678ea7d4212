"""Structured outputs (vLLM's ``structured_outputs``, the OpenAI API's ``response_format``): the
constraint's checks, the bitmask against a reference, the engine (every kind, greedy and sampled,
overlap on and off, constrained and free requests in one batch, ``ignore_eos``, a token the grammar
cannot take), and a real server through the openai client."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import httpx
import pytest
import torch
import xgrammar as xgr

from minengine import LLM
from minengine.models.tiny import EOS_ID, tiny_tokenizer
from minengine.sampling_params import SamplingParams
from minengine.structured import (
    MAX_SCHEMA_DEPTH,
    MAX_SOURCE_CHARS,
    Matcher,
    StructuredOutputs,
    _compile,
    allowed_mask,
    apply_grammars,
    apply_mask,
    check_reasoning,
)

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


def _compiled_of(spec: StructuredOutputs):
    """``spec`` compiled for the tiny model, apart from the engine's compiler."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer().backend)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=260, stop_token_ids=[EOS_ID, 259])
    return _compile(xgr.GrammarCompiler(info), spec.key)


def _matcher(spec: StructuredOutputs):
    """A fresh matcher of ``spec`` for the tiny model, compiled apart from the engine's."""
    return xgr.GrammarMatcher(_compiled_of(spec))


def _done(spec: StructuredOutputs) -> Future:
    """``spec`` compiled, as ``Grammars.start`` gives it once done."""
    future = Future()
    future.set_result(_compiled_of(spec))
    return future


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
        ({"regex": "a", "reasoning": "closed"}, 'reasoning is \'closed\'; allowed: null, "open", "may_open"'),
    ],
)
def test_a_bad_constraint_is_a_value_error_naming_it(fields, message):
    with pytest.raises(ValueError, match="structured_outputs") as err:
        StructuredOutputs(**fields).check()
    assert message in str(err.value)


OBJ_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"not": {"type": "string"}}, "uses not at /,"),
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "uses not at /properties/a,"),
        (OBJ_AB | {"if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, "uses if at /,"),
        (OBJ_AB | {"dependentRequired": {"a": ["b"]}}, "uses dependentRequired"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uses uniqueItems"),
        ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "uses contains"),
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "uses allOf with more than one schema"),
        (OBJ_AB | {"allOf": [{"required": ["a"]}]}, "uses allOf beside properties (read alone)"),
        ({"$ref": "https://example.com/s.json"}, "uses $ref 'https://example.com/s.json' (only references into"),
        ({"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i", "minimum": 5}, "uses $ref beside minimum"),
        ({"minLength": 3}, "uses minLength without a type at /,"),
        (OBJ_AB | {"anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, "uses anyOf beside properties (read alone)"),
        ({"anyOf": [{"required": ["a"]}, {"type": "null"}]}, "uses required without a type at /anyOf/0,"),
        ({"type": "string", "enum": ["abc"], "maxLength": 1}, "uses maxLength beside enum"),
        ({"$defs": {"a/b": {"maxItems": 1}}, "type": "integer"}, "uses maxItems without a type at /$defs/a~1b,"),
        ({"type": "string", "maxLength": 2, "anyOf": [{"type": "string"}]}, "uses anyOf beside maxLength (read alone)"),
        (OBJ_AB | {"required": ["c"]}, "uses required 'c' without a schema in properties"),
        ({"type": "number", "multipleOf": 0.01}, "uses multipleOf on a type other than integer"),
        ({"type": "object", "propertyNames": {"not": {"const": "a"}}}, "uses not at /propertyNames,"),
    ],
)
def test_a_schema_keyword_the_grammar_would_not_enforce_is_refused(schema, message):
    """xgrammar compiles these without enforcing them (a value that breaks the schema is
    accepted): the request is refused, naming the keyword and where it is, not run unchecked."""
    with pytest.raises(ValueError, match="which minengine cannot enforce") as err:
        StructuredOutputs(json=schema).check()
    assert f"structured_outputs json {message}" in str(err.value)


@pytest.mark.parametrize(
    "schema, breaks",
    [
        ({"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i", "description": "pydantic's"}, "s"),
        ({"$defs": {"i": {"type": "integer"}}, "allOf": [{"$ref": "#/$defs/i"}], "title": "T"}, "s"),
        ({"anyOf": [{"type": "string", "maxLength": 2}, {"type": "null"}], "default": None}, "abc"),
        ({"type": "string", "enum": ["a", "b"], "description": "d"}, "c"),
        ({"properties": {"a": {"type": "integer"}}, "required": ["a"]}, {}),
        ({"type": "object", "additionalProperties": False, "properties": {"a": {"type": "integer"}}}, {"a": 1, "b": 2}),
        ({"type": ["string", "null"], "minLength": 3}, "a"),
        ({"type": "object", "propertyNames": {"pattern": "^a"}}, {"b": 1}),
        ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, True),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": False}, ["s"]),
        ({"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i", "x-order": 1}, "s"),  # (unknown: no constraint)
        ({"type": "integer", "multipleOf": 3}, 4),
        (
            {
                "oneOf": [OBJ_AB | {"properties": {"a": {"const": 1}}, "required": ["a"]}, {"type": "string"}],
                "discriminator": {"propertyName": "a"},
            },
            {"a": 2},
        ),
        (OBJ_AB | {"required": ["a"]}, {"b": 1}),
    ],
)
def test_a_schema_that_is_allowed_is_enforced(schema, breaks):
    """What passes the check is enforced: a value that breaks the schema is not accepted."""
    from minengine.structured import _empty_compiler

    StructuredOutputs(json=schema).check()
    grammar = _empty_compiler().compile_json_schema(json.dumps(schema), any_whitespace=False)
    matcher = xgr.GrammarMatcher(grammar)
    assert not (matcher.accept_string(json.dumps(breaks)) and matcher.is_completed())


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


def _allowed(mask: torch.Tensor | None, row: int, vocab: int = 260) -> set[int]:
    if mask is None:
        return set(range(vocab))
    return {t for t in range(vocab) if (int(mask[row, t // 32]) >> (t % 32)) & 1}


def test_after_reasoning_the_grammar_takes_the_tokens_after_the_end_tag():
    """A matcher whose grammar starts after reasoning, against one that starts at the first token:
    free while the output reasons, then the grammar's tokens; the open tag is allowed only as a
    "may_open" output's first token. Tags at ids 63 and 95 (bit 31 of their words: the sign bit)."""
    compiled = _done(StructuredOutputs(choice=["ab", "b"]))
    think = (63, 95)
    grammar_first = {ord("a"), ord("b")}

    def allowed(matcher, output):
        return _allowed(allowed_mask([matcher, None], [output, [1, 2]], 260), 0)

    may = Matcher(compiled, "may_open", think)
    assert allowed(may, []) == grammar_first | {63} and may.start is None
    assert allowed(may, [63]) == set(range(260))  # it opened a block: free
    assert allowed(may, [63, 63, 7]) == set(range(260)) and may.start is None  # (a second <think> ends nothing)
    assert allowed(may, [63, 63, 7, 95]) == grammar_first and may.start == 4
    assert allowed(may, [63, 63, 7, 95, ord("a")]) == {ord("b")}
    assert not may.terminated([63, 63, 7, 95, ord("a"), ord("b")])
    assert may.terminated([63, 63, 7, 95, ord("a"), ord("b"), EOS_ID])

    skipped = Matcher(compiled, "may_open", think)  # no block: the grammar took the first token
    assert allowed(skipped, [ord("a")]) == {ord("b")} and skipped.start == 0
    assert allowed(skipped, [ord("a"), ord("b")]) == {EOS_ID, 259}  # the end tokens; <think> no more

    opened = Matcher(compiled, "open", think)
    assert allowed(opened, []) == set(range(260)) and allowed(opened, [95]) == grammar_first
    assert opened.terminated([95, ord("b"), EOS_ID]) and not opened.broken

    with pytest.raises(ValueError, match="needs the <think> and </think> token ids"):
        Matcher(compiled, "open")


def test_the_rows_filled_together_equal_each_row_filled_alone():
    """``allowed_mask`` fills its constrained rows in one xgrammar batch call (rows between them
    free or reasoning); each row equals a matcher's own fill, the open tag's bit added."""
    spec = StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)
    path = list(json.dumps({"unit": "c", "ok": True}).encode())  # (xgrammar: ", " and ": " without whitespace)
    compiled = _done(spec)
    think = (63, 95)
    matchers = [Matcher(compiled), None, Matcher(compiled, "may_open", think), Matcher(compiled, "open", think)]
    matchers += [Matcher(compiled) for _ in range(3)]
    outputs = [path[:3], [5], [], [1, 2], path[:7], path[:1], path[: len(path)]]
    mask = allowed_mask(matchers, outputs, 260)
    for row, (m, out) in enumerate(zip(matchers, outputs, strict=True)):
        if m is None or row == 3:  # free; reasoning
            assert _allowed(mask, row) == set(range(260))
            continue
        ref = _matcher(spec)
        assert all(ref.accept_token(t) for t in out)
        alone = xgr.allocate_token_bitmask(1, 260)
        ref.fill_next_token_bitmask(alone, 0)
        assert _allowed(mask, row) == _allowed(alone, 0) | ({63} if row == 2 else set()), row


def test_a_reasoning_row_with_its_token_in_flight_is_masked_on_the_device():
    """With overlap, a request that reasons samples before its last token is read: its row is the
    grammar's first mask if that token (in the token buffer, at its slot) is </think>, else all
    tokens. The other rows are the host's, as ``allowed_mask`` fills them (``torch.isfinite``: what
    is allowed)."""
    compiled = _done(StructuredOutputs(choice=["ab", "b"]))
    think = (63, 95)
    grammar_first = {ord("a"), ord("b")}

    def req(matcher, output, inflight, slot):
        return SimpleNamespace(matcher=matcher, output_ids=output, num_inflight=inflight, slot=slot)

    buffer = torch.tensor([7, 0, 95, 95, 63])
    reqs = [
        req(Matcher(compiled, "open", think), [1, 2], 2, 3),  # in flight: </think>
        req(Matcher(compiled, "open", think), [1], 2, 0),  # in flight: a free token
        req(Matcher(compiled), [ord("a")], 1, 1),  # all read; the grammar's
        req(None, [5], 2, 4),  # free
        req(Matcher(compiled, "open", think), [1, 2], 1, 2),  # all read (the slot's token: a stale one)
        req(Matcher(compiled, "open", think), [95], 1, 2),  # all read: the grammar started
    ]
    want = [grammar_first, set(range(260)), {ord("b")}, set(range(260)), set(range(260)), grammar_first]

    def allowed(rows):
        logits = torch.randn(len(rows), 260, dtype=torch.float64)
        apply_grammars(logits, rows, buffer)
        return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]

    assert allowed(reqs) == want
    assert allowed(reqs[1::-1]) == want[1::-1]  # only rows in flight
    with pytest.raises(RuntimeError, match="pass the token buffer"):
        apply_grammars(torch.zeros(1, 260), reqs[:1])

    # which samplings wait for the token in flight: those whose grammar has started or may have,
    # or still compiles
    reasons = Matcher(compiled, "open", think)
    assert not reasons.waits([1, 2], True) and reasons.waits([1, 2, 95], True) and not reasons.waits([1, 2, 95], False)
    assert Matcher(compiled).waits([], True) and Matcher(compiled, "may_open", think).waits([], True)
    assert Matcher(Future(), "open", think).waits([1], True)
    assert not Matcher(compiled, "may_open", think).waits([63], True)


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


def structured_outputs_run(tmp_path, **config) -> None:
    """Constrained requests beside free ones, with overlap off and on (both with CUDA graphs where
    the device has them): a choice, a regex and a JSON schema from the first token, and choices
    after reasoning ("open", "may_open"; biased to reason a few tokens), greedy and seeded. Each
    output follows its grammar, and the tokens are the same either way."""
    from checkpoints import build_checkpoint

    path = build_checkpoint(tmp_path / "thinker", "qwen3", added_tokens=("<think>", "</think>"))
    choice = ["red", "green", "blue"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    kinds = [
        StructuredOutputs(choice=choice),
        StructuredOutputs(regex="[a-e]{2,4}-[0-9]"),
        StructuredOutputs(json=schema, disable_any_whitespace=True),
        StructuredOutputs(choice=choice, reasoning="open"),
        StructuredOutputs(choice=choice, reasoning="may_open"),
        None,
    ]
    got = {}
    for overlap in (0, 1):
        llm = LLM(str(path), disable_overlap_schedule=not overlap, max_running_requests=16, **config)
        try:
            end = llm.engine.tokenizer.backend.token_to_id("</think>")
            params = [
                SamplingParams(
                    max_tokens=24,
                    temperature=i % 2,
                    seed=i,
                    structured_outputs=kinds[i % len(kinds)],
                    logit_bias={end: 4} if i % len(kinds) in (3, 4) else None,
                )
                for i in range(2 * len(kinds) + 2)
            ]
            prompts = [f"hello {'x ' * (i % 5)}" for i in range(len(params))]
            got[overlap] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
            if config["device"] == "cuda":
                assert llm.engine.runner.graphs is not None
            decode = llm.engine.tokenizer.decode
        finally:
            llm.shutdown()
    assert [o.token_ids for o in got[1]] == [o.token_ids for o in got[0]]
    stopped = 0
    for i, out in enumerate(got[1]):
        spec = kinds[i % len(kinds)]
        if spec is None or out.finish_reason != "stop":
            continue
        stopped += 1
        ids = out.token_ids[:-1]  # (its end token)
        if spec.reasoning is not None and end in ids:
            ids = ids[ids.index(end) + 1 :]
        text = decode(ids)
        if spec.choice:
            assert text in choice, (i, out.token_ids)
        elif spec.regex:
            assert re.fullmatch(spec.regex, text), (i, text)
        else:
            assert json.loads(text) in ({"ok": True}, {"ok": False}), (i, text)
    assert stopped >= len(kinds)


def test_the_gpu_test_of_structured_outputs_runs_on_cpu(tmp_path):
    """``test_gpu_engine``'s structured outputs run, on CPU: it stays runnable between GPU sessions."""
    structured_outputs_run(tmp_path, device="cpu", dtype="float32", attention_backend="torch")


@pytest.fixture(scope="module")
def thinkers(tmp_path_factory):
    """A model whose tokenizer has <think> and </think> as tokens, with overlap on and off."""
    from checkpoints import build_checkpoint

    path = build_checkpoint(tmp_path_factory.mktemp("thinker"), "qwen3", added_tokens=("<think>", "</think>"))
    made = {overlap: LLM(str(path), disable_overlap_schedule=not overlap, max_running_requests=8) for overlap in (1, 0)}
    yield made
    for llm in made.values():
        llm.shutdown()


def test_a_grammar_after_reasoning_starts_after_the_end_tag(thinkers):
    """The reasoning is free; the grammar takes the tokens after ``</think>``; a "may_open"
    output's first token may be ``<think>``, else the grammar's. Biases make the model reason
    (a random model never would); the same tokens with overlap on and off."""
    tok = thinkers[1].engine.tokenizer
    think, end = (tok.backend.token_to_id(t) for t in ("<think>", "</think>"))
    choice = ["red", "green", "blue"]

    def spec(reasoning):
        return StructuredOutputs(choice=choice, reasoning=reasoning)

    params = [
        SamplingParams(max_tokens=20, temperature=0, structured_outputs=spec("open"), logit_bias={end: 100}),
        SamplingParams(max_tokens=20, temperature=0, structured_outputs=spec("open")),  # reasons to the end
        SamplingParams(max_tokens=20, temperature=0),
        SamplingParams(
            max_tokens=20, temperature=0, structured_outputs=spec("may_open"), logit_bias={think: 50, end: 100}
        ),
        SamplingParams(max_tokens=20, temperature=0, structured_outputs=spec("may_open"), logit_bias={think: -100}),
        SamplingParams(max_tokens=20, temperature=0, structured_outputs=spec(None)),
    ]
    sampled = [  # reasons for a few tokens, mostly
        SamplingParams(max_tokens=20, temperature=1, seed=i, structured_outputs=spec("open"), logit_bias={end: 4})
        for i in range(6)
    ]
    params += sampled
    got = {
        o: [r.outputs[0] for r in llm.generate(["hello"] * len(params), params, use_tqdm=False)]
        for o, llm in thinkers.items()
    }
    assert [o.token_ids for o in got[1]] == [o.token_ids for o in got[0]]
    closed, free, plain, opened, skipped, first, *sampled = got[1]
    # "open": </think> first (biased), then one of the choices
    assert closed.token_ids[0] == end and closed.text[len("</think>") :] in choice and closed.finish_reason == "stop"
    # "open" without </think>: the reasoning runs to max_tokens, as a free request's output
    assert end not in free.token_ids and free.token_ids == plain.token_ids and free.finish_reason == "length"
    # "may_open": <think> first (allowed only there, and biased), </think>, then a choice
    assert opened.token_ids[:2] == [think, end] and opened.text[len("<think></think>") :] in choice
    # "may_open" with no block: the grammar from the first token, as without reasoning
    assert skipped.token_ids == first.token_ids and first.text in choice and first.finish_reason == "stop"
    # sampled: what follows the first </think> is a choice, however long the reasoning ran
    reasoned = 0
    for o in sampled:
        if end in o.token_ids and o.finish_reason == "stop":
            at = o.token_ids.index(end) + 1
            assert tok.decode(o.token_ids[at:-1]) in choice, o.token_ids
            reasoned += at > 1
    assert reasoned >= 3


def test_a_grammar_after_reasoning_needs_the_tags_as_tokens(engines, thinkers):
    spec = StructuredOutputs(choice=["a"], reasoning="open")
    with pytest.raises(ValueError, match="reasoning is 'open'; it needs <think> and </think> as single tokens"):
        engines[1].generate(["x"], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert not engines[1].engine.has_unfinished()
    # tags the tokenizer has, past a model's vocabulary (added tokens a checkpoint's embedding lacks)
    tok = thinkers[1].engine.tokenizer
    assert check_reasoning(spec, tok, 402) == (400, 401)
    with pytest.raises(ValueError, match=r"their ids \(400, 401\) are outside its vocabulary \[0, 401\)"):
        check_reasoning(spec, tok, 401)


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


def _gate_compiling(engine, monkeypatch) -> threading.Event:
    """Make the grammars ``engine`` compiles from now on ready only once the returned event is set
    (or after 10 s: a step that waits for one then fails its test instead of hanging it)."""
    gate, real = threading.Event(), engine.grammars.start

    def gated(spec):
        compiled, held = real(spec), Future()
        threading.Thread(target=lambda: (gate.wait(10), held.set_result(compiled.result())), daemon=True).start()
        return held

    monkeypatch.setattr(engine.grammars, "start", gated)
    return gate


@pytest.mark.parametrize("prompt_len", [40, 1])
def test_a_request_whose_grammar_compiles_is_held_back_not_waited_for(engines, monkeypatch, prompt_len):
    """As vLLM: while a request's grammar compiles, its steps compute all but the token that
    samples (a request with nothing else to compute is not admitted: later ones pass it), and no
    step waits for the compilation: the other requests run on, their prefill chunks too. Then it
    runs as a request whose grammar was ready."""
    spec = StructuredOutputs(choice=COLORS)
    params = SamplingParams(max_tokens=10, temperature=0, structured_outputs=spec)
    prompt = list(range(65, 65 + prompt_len))
    for llm in engines.values():
        engine = llm.engine
        (want,) = llm.generate([prompt], params, use_tqdm=False)  # (its grammar compiled, and cached)
        gate = _gate_compiling(engine, monkeypatch)
        waits = []
        real_wait = engine._wait_for_grammars
        monkeypatch.setattr(engine, "_wait_for_grammars", lambda w=waits, real=real_wait: (w.append(1), real()))
        monkeypatch.setattr(engine.scheduler, "chunked_prefill_size", 16)  # the free one's prefill: chunks
        held = engine.add_request(prompt, params)
        free = engine.add_request(list(range(66, 126)), SamplingParams(max_tokens=5, temperature=0))
        start = time.perf_counter()
        while not free.finished:
            engine.step()
        assert time.perf_counter() - start < 5 and not waits  # no step waited, none slept
        for _ in range(3):  # idle but for the held request: a pass waits a little for its grammar
            assert engine.step() == []
        assert len(waits) == 3 and held.output_ids == [] and not held.finished
        assert held.num_computed == len(prompt) - 1 and (held in engine.scheduler.waiting) == (prompt_len == 1)
        gate.set()
        while engine.has_unfinished():
            engine.step()
        assert held.output_ids == want.outputs[0].token_ids and held.finish_reason == "stop"
        monkeypatch.undo()


def test_a_request_that_reasons_is_held_only_once_its_grammar_is_next(thinkers, monkeypatch):
    """While its grammar compiles, an output that reasons samples on (its tokens are free); once
    its </think> is read, it is held until the grammar is ready; no step waits for it."""
    tok = thinkers[1].engine.tokenizer
    end = tok.backend.token_to_id("</think>")
    spec = StructuredOutputs(choice=["red", "green"], reasoning="open")
    params = SamplingParams(max_tokens=12, temperature=0, structured_outputs=spec, logit_bias={end: 3})
    for llm in thinkers.values():
        engine = llm.engine
        (want,) = llm.generate(["hello"], params, use_tqdm=False)
        at = want.outputs[0].token_ids.index(end)
        assert at > 0  # it reasons first
        gate = _gate_compiling(engine, monkeypatch)
        held = engine.add_request(tok.encode("hello"), params)
        free = engine.add_request(tok.encode("a free one"), SamplingParams(max_tokens=20, temperature=0))
        start = time.perf_counter()
        while not free.finished:
            engine.step()
        assert time.perf_counter() - start < 5
        assert held.output_ids == want.outputs[0].token_ids[: at + 1] and not held.finished
        gate.set()
        while engine.has_unfinished():
            engine.step()
        assert held.output_ids == want.outputs[0].token_ids
        monkeypatch.undo()


def test_overlap_stays_on_while_an_output_reasons(thinkers, monkeypatch):
    """With overlap, a step samples before the step in flight is read while a constrained output
    reasons (its mask is chosen on the device), the step whose token in flight is its </think>
    too; only once the grammar has started does a step wait to sample. The same tokens as with
    overlap off."""
    tok = thinkers[1].engine.tokenizer
    end = tok.backend.token_to_id("</think>")
    spec = StructuredOutputs(choice=["red", "green"], reasoning="open")
    params = SamplingParams(max_tokens=12, temperature=0, structured_outputs=spec, logit_bias={end: 3})
    (want,) = thinkers[0].generate(["hello"], params, use_tqdm=False)
    want = want.outputs[0].token_ids
    at = want.index(end)
    assert at > 0  # it reasons first
    engine = thinkers[1].engine
    req = engine.add_request(tok.encode("hello"), params)
    req.matcher.compiled.result()  # (compiled: never held, whatever ran before)
    free = engine.add_request(tok.encode("a free one"), SamplingParams(max_tokens=20, temperature=0))
    launches, real = [], engine.runner.launch

    def launch(fb, samplers, prompt=None, sample=True):
        if req in samplers:  # (the output index of the token this step samples, and whether it waited)
            launches.append((req.num_output_sampled - 1, sample, req.num_inflight > 1))
        return real(fb, samplers, prompt, sample)

    monkeypatch.setattr(engine.runner, "launch", launch)
    while engine.has_unfinished():
        engine.step()
    assert req.output_ids == want and free.finished
    # tokens 1 to at + 1 sampled with the token before them in flight, without waiting; then waits
    in_flight = [(i, sample) for i, sample, unread in launches if unread and i < len(want)]
    assert in_flight == [(i, i <= at + 1) for i in range(1, len(want))]


def test_a_first_token_samples_at_launch_with_a_step_in_flight(engines, monkeypatch):
    """With overlap, a constrained request that joins while a step runs samples its first token at
    launch (it has no token in flight for its grammar to see); its next tokens wait for theirs."""
    engine = engines[1].engine
    spec = StructuredOutputs(choice=COLORS)
    params = SamplingParams(max_tokens=10, temperature=0, structured_outputs=spec)
    (want,) = engines[0].generate([[70, 71]], params, use_tqdm=False)
    free = engine.add_request([66, 67], SamplingParams(max_tokens=30, temperature=0))
    engine.step()
    engine.step()
    assert engine.in_flight_event() is None and engine._in_flight is not None  # (CPU: no event; a step in flight)
    req = engine.add_request([70, 71], params)
    req.matcher.compiled.result()
    launches, real = [], engine.runner.launch

    def launch(fb, samplers, prompt=None, sample=True):
        if req in samplers:
            launches.append(sample)
        return real(fb, samplers, prompt, sample)

    monkeypatch.setattr(engine.runner, "launch", launch)
    try:
        while not req.finished:
            engine.step()
        assert req.output_ids == want.outputs[0].token_ids and not free.finished
        assert launches[0] and not any(launches[1:]) and len(launches) >= 3
    finally:  # (the engine is the module's)
        while engine.has_unfinished():
            engine.step()


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
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {"type": "string"}}}}},
            "response_format",
            "response_format schema uses not at /, which minengine cannot enforce",
        ),
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
