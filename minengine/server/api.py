"""OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health, metrics.

Requests are parsed and validated here, so every bad input is a 400 (or 404 for an unknown
model) in the OpenAI / vLLM error shape, never FastAPI's 422; the server keeps serving after each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from minengine import __version__
from minengine import logprobs as logprob_format
from minengine.engine import check_prompt, resolve_max_tokens, truncation
from minengine.profiling import ProfileSpec, new_profile_name
from minengine.sampling_params import MAX_LOGPROBS, SamplingParams
from minengine.server.frontend import (
    Piece,
    ProfileFailed,
    RequestFailed,
    SchedulerClient,
    SchedulerDied,
    generate,
)
from minengine.server.metrics import Metrics
from minengine.server.protocol import DECODE_ABORTED, Bootstrap, StartProfile, StopProfile
from minengine.server.reasoning import (
    ReasoningStream,
    grammar_after_reasoning,
    prompt_opens_reasoning,
    split_reasoning,
)
from minengine.server.tool_calls import (
    FORCED,
    PARSERS,
    ToolCallStream,
    finish_reason,
    parse_tool_calls,
    required_calls_schema,
)
from minengine.structured import KINDS, StructuredOutputs
from minengine.tokenizer import Tokenizer, chat_messages

DRAIN_SECONDS = 5.0
MAX_N = 128  # choices per prompt (OpenAI's limit)
MAX_SEQUENCES = 2048  # prompts x n: the requests one API call may start
MAX_CHAT_TEMPLATE = 65536  # characters of a request's own chat template


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
}


def _summary(exc: Exception) -> str:
    """An error for a client: a scheduler's traceback (it is in the server log) cut to its first
    line and the exception it ended with."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines[:1] + lines[-1:]) if len(lines) > 2 else " ".join(lines)


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    # a request's lone surrogate (valid JSON: "\\ud800") quoted back would make the body unencodable
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if param is not None:  # (a field's own name may hold one)
        param = param.encode("utf-8", "backslashreplace").decode("utf-8")
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


# --- request schemas --------------------------------------------------------------------------


# strict: JSON types as given (true is not the integer 1, 1.5 is not an integer); ints still pass
# for floats


class _NullIsDefault(BaseModel):
    """``null`` for a field that has a default means that default, as the OpenAI API and vLLM
    read it (the openai SDK sends ``temperature=None`` as ``null``); but for the fields in
    ``_null_kept``, where vLLM reads ``null`` as None."""

    _null_kept: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields, kept = cls.model_fields, cls._null_kept
        return {
            k: v for k, v in data.items() if v is not None or k not in fields or k in kept or fields[k].is_required()
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    # as vLLM: stream_options {} sends usage, {"include_usage": null} does not
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, every chunk has a choice's usage so far


class _Sampling(_NullIsDefault):
    model_config = ConfigDict(extra="allow", strict=True)  # extras: only checked by _check_unsupported

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # vLLM's
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's
    min_tokens: int = 0  # vLLM's
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias
    allowed_token_ids: list[int] | None = None  # vLLM's
    bad_words: list[str] | None = None  # vLLM's
    truncate_prompt_tokens: int | None = None  # vLLM's: the prompt's last k tokens (-1: the context length's)
    # vLLM's: logprobs name tokens "token_id:<id>", not their text (None: --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool = False  # vLLM's: the prompt's and the output's token ids in the answer
    cache_salt: str | None = None  # vLLM's: prefix-cache KV shared only with requests of the same salt
    # the output follows a JSON schema or is a JSON object (the OpenAI API's), or vLLM's
    # constraints: {"json" | "regex" | "choice" | "grammar" | "json_object": ...} (``structured_for``)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    request_id: str | None = None  # vLLM's: the answer's id ends in it (an X-Request-Id header wins)
    # vLLM's: per prompt token from the second on, its logprob and the top ones (a stream takes only 0, and sends none)
    prompt_logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # disaggregation (set by minengine.router): where the KV comes from, and the pairing id
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


class CompletionRequest(_Sampling):
    # as vLLM: 16 when left out, all the room the prompt leaves when null
    _null_kept: ClassVar[frozenset[str]] = frozenset({"max_tokens"})
    max_tokens: int | None = 16
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    add_special_tokens: bool = True  # vLLM's: a text prompt's BOS (as the tokenizer adds it)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments


class Tool(BaseModel):
    """A tool a chat request offers the model (the OpenAI API's: a function)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _ChatTemplateFields(_NullIsDefault):
    """vLLM's fields for rendering ``messages`` (``chat_prompt``), shared by the chat API and
    ``/tokenize``."""

    model_config = ConfigDict(extra="allow", strict=True)
    chat_template_kwargs: dict[str, Any] | None = None  # as vLLM: extra variables for the chat template
    # open the answer's turn (None: unless continue_final_message); end the prompt inside the last
    # message, for the answer to go on with it; this request's own template (with
    # --trust-request-chat-template); documents, for a template that cites them (RAG)
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template: str | None = None
    documents: list[dict[str, str]] | None = None
    tools: list[Tool] | None = None  # for the template to show the model (as the request gave them)


class ChatCompletionRequest(_Sampling, _ChatTemplateFields):
    messages: list[ChatMessage]
    echo: bool = False  # vLLM's: the answer starts with the last message, when that has the answer's role
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens too, on top of the template's
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None  # with logprobs: the most likely tokens listed per token
    # "none", "auto" (the default with tools: calls found in the output by --tool-call-parser),
    # "required" (the output is a JSON list of calls) or {"type": "function", "function": {"name":
    # ...}} (the output is that function's arguments): those two through structured outputs
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # false: at most one call per answer (the first)
    include_reasoning: bool = True  # vLLM's: with --reasoning-parser, the answer's reasoning too


class TokenizeRequest(_ChatTemplateFields):
    """vLLM's ``/tokenize``: a ``prompt`` or chat ``messages`` (with the chat API's template fields)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (as vLLM)
    return_token_strs: bool = False  # the tokens' strings in the vocabulary too


class DetokenizeRequest(_NullIsDefault):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    tokens: list[int]


class ProfileRequest(_NullIsDefault):
    """SGLang's /start_profile fields that minengine takes (the traces' folder is the server's)."""

    model_config = ConfigDict(extra="allow", strict=True)
    num_steps: int | None = None  # forward passes, then the trace is written (null: until /stop_profile)
    activities: list[str] | None = None  # profiling.ACTIVITIES (null: CPU, and GPU on CUDA)
    record_shapes: bool = False
    with_stack: bool = True  # (SGLang's and vLLM's default)


# --- state ------------------------------------------------------------------------------------


@dataclass
class ServerState:
    client: SchedulerClient
    tokenizer: Tokenizer
    served_model_name: str
    metrics: Metrics
    mode: str = "null"  # disaggregation mode: null | prefill | decode
    bootstrap_port: int | None = None  # a prefill server's: where decode servers reach it
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # for the fields a request leaves out
    # vLLM's flags of the same names
    trust_request_chat_template: bool = False
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # a name in tool_calls.PARSERS
    reasoning_parser: str | None = None  # a name in reasoning.PARSERS
    torch_profiler_dir: str | None = None  # where /start_profile's traces go (None: profiling off)
    shutting_down: bool = False
    inflight: int = 0
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    # long prompts are parsed and tokenized here, off the event loop (as vLLM's one tokenizer thread)
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="minengine-tokenize")
    )

    @property
    def healthy(self) -> bool:
        return not self.shutting_down and self.client.dead is None and self.client.ready is not None

    async def begin_shutdown(self) -> None:
        """New requests get 503; in-flight ones end (finish or ``abort``); wait for them a while."""
        self.shutting_down = True
        self.client.shutdown()
        if self.inflight:
            self.drained.clear()
            with contextlib.suppress(asyncio.TimeoutError):  # (TimeoutError itself from Python 3.11)
                await asyncio.wait_for(self.drained.wait(), DRAIN_SECONDS)

    def enter(self) -> None:
        self.inflight += 1

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.drained.set()


# --- helpers ----------------------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e400: a JSON number, but no float
        raise ValueError(f"{_shown(text)} is out of range; allowed: a finite number up to about 1.8e308")
    return value


def load_json_object(body: bytes) -> dict:
    """A request body as a JSON object; ``APIError`` 400 for anything else (NaN and Infinity
    included: they are not JSON, and re-sending them as JSON would fail)."""
    try:
        data = json.loads(body, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise APIError(400, f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if _may_hold_a_surrogate(body) and (found := _unpaired_surrogate(data)) is not None:
        path, text, at = found
        name = ".".join(map(str, path))
        raise APIError(
            400,
            f"{name} is {_shown(text)}: an unpaired surrogate ({text[at]!r}) at character {at}; "
            "allowed: valid Unicode text (a surrogate escape only in a pair)",
            str(path[0]),
        )
    return data


# a UTF-16 surrogate in a UTF-8 body: JSON's escape of one, or its bytes (json.loads decodes
# with surrogatepass); bodies in UTF-16 or UTF-32 (json.loads detects them) are scanned whole
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _may_hold_a_surrogate(body: bytes) -> bool:
    return json.detect_encoding(body) != "utf-8" or _SURROGATE.search(body) is not None


def _unpaired_surrogate(data: dict) -> tuple[tuple, str, int] | None:
    """A string of a parsed JSON object (a key or a value) that is not valid Unicode
    (``"\\ud800"`` parses to an unpaired surrogate, which no tokenizer, template or JSON encoder
    takes): its path, the string, and where the surrogate is. One encode of the whole object
    first (C speed); the walk, linear in the items (about 0.1 s a million), only when that fails."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
        return None
    except (UnicodeEncodeError, RecursionError):  # (deeper than the encoder goes: the walk has no limit)
        pass
    stack = [(None, None, data)]  # (parent entry, key, container): a path is built only for the one found
    while stack:
        entry = stack.pop()
        container = entry[2]
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, item in items:
            for text in (key, item) if isinstance(key, str) else (item,):
                if isinstance(text, str) and not text.isascii():
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError as exc:
                        path = [key]
                        while entry[0] is not None:
                            path.append(entry[1])
                            entry = entry[0]
                        return tuple(reversed(path)), text, exc.start
            if isinstance(item, (dict, list)):
                stack.append((entry, key, item))
    return None


# A body or text at least this long is parsed or tokenized in ``ServerState.tokenize_pool``: on the
# event loop it would stall every stream and health check (a 1.2 MB prompt: 1.9 s on this CPU);
# shorter ones take less time there than the hop to the thread.
OFF_LOOP_CHARS = 16384


async def off_loop(state: ServerState, size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, in the tokenizer thread when ``size`` (characters or bytes) is at
    least ``OFF_LOOP_CHARS``; its exceptions (an ``APIError``) are raised here."""
    if size < OFF_LOOP_CHARS:
        return fn(*args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, lambda: fn(*args, **kwargs))


async def parse_body(state: ServerState, raw: Request, schema: type[BaseModel]) -> Any:
    body = await raw.body()
    return await off_loop(state, len(body), _parse, body, schema)


def _parse(body: bytes, schema: type[BaseModel]) -> Any:
    data = load_json_object(body)
    try:
        req = schema.model_validate(data)
    except ValidationError as exc:
        raise APIError(400, *_validation_message(exc.errors())) from None
    if isinstance(req, _Sampling):  # (/tokenize ignores a chat body's sampling fields, as vLLM does)
        _check_unsupported(req)
    return req


# What a field that takes several JSON types takes (pydantic reports one error per type).
_ALLOWED_TYPES = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string, a list of content parts, or null",
}


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors: the first bad field, its value and what it allows."""
    first = errors[0]
    loc = first["loc"]
    # the path without pydantic's union-member tags ("prompt.str", "prompt.list[int].0")
    path = [str(x) for x in loc if not (isinstance(x, str) and (x in ("str", "int") or "[" in x))]
    name = ".".join(path) or "body"
    param = str(loc[0]) if loc else None
    value = _shown(first.get("input"))
    if first["type"] == "missing":
        return f"{name}: a required field is missing", param
    field_errors = [e for e in errors if e["loc"][: len(path)] == loc[: len(path)]] if path else [first]
    allowed = _ALLOWED_TYPES.get(path[-1] if path else "")
    if len(field_errors) > 1 and allowed:  # no type of the union took it
        return f"{name} is {value}; allowed: {allowed}", param
    return f"{name} is {value}: {first['msg'][0].lower()}{first['msg'][1:]}", param


# Sampling fields of the OpenAI / vLLM APIs minengine does not implement, with the value that
# means "off": any other value is a 400, never silently ignored. (Fields it does not know at all,
# such as ``user``, are ignored, as vLLM ignores them.)
_UNSUPPORTED = {
    "length_penalty": (1, 1.0),
    "use_beam_search": (False,),
    "suffix": ("",),
    "top_logprobs": (0,),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "logits_processors": (),
    "tools": ([],),  # (the completions API's: the chat API takes them)
    "tool_choice": ("none",),
    "priority": (0,),  # (vLLM's, with --scheduling-policy priority)
    "functions": ([],),
    "function_call": ("none",),
}


def _check_unsupported(req: _Sampling) -> None:
    for name, value in (req.model_extra or {}).items():
        off = (1, req.n) if name == "best_of" else _UNSUPPORTED.get(name)  # the best n of n: no selection
        if off is None or value is None or any(value == v and type(value) is type(v) for v in off):
            continue
        allowed = " or ".join(dict.fromkeys(json.dumps(v) for v in off)) or "null"
        raise APIError(400, f"{name} is {_shown(value)}; minengine does not support it (allowed: {allowed})", name)


def _check_profiling(state: ServerState) -> None:
    if state.torch_profiler_dir is None:
        raise APIError(400, "profiling is off; start the server with --torch-profiler-dir DIR to take profiles")


async def _profile_call(state: ServerState, msg: StartProfile | StopProfile) -> list[str]:
    """The traces' paths (``SchedulerClient.profile_traces``): a 400 for what a worker refused, a
    500 for what failed there, a 503 while shutting down, a 504 when they do not answer in time."""
    if state.shutting_down:
        raise APIError(503, "shutting down")
    try:
        return await state.client.profile_traces(msg)
    except ProfileFailed as exc:
        raise APIError(400 if exc.user_error else 500, str(exc)) from None
    except TimeoutError as exc:
        raise APIError(504, str(exc)) from None
    except SchedulerDied:
        if state.shutting_down:
            raise APIError(503, "shutting down") from None
        raise


def _shown(value: Any) -> str:
    """A request's value as JSON, cut to 80 characters, for an error message."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."


def sampling_params(
    req: _Sampling,
    max_tokens: int | None,
    max_tokens_field: str = "max_tokens",
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    forced: tuple[StructuredOutputs, str] | None = None,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """``req``'s sampling parameters; ``max_tokens`` came from the field ``max_tokens_field``;
    ``logprobs``: the top tokens to list per output token (None: no logprobs);
    ``prompt_logprobs``: per prompt token (None: ``req.prompt_logprobs``, which a stream accepts
    only as 0 and then computes none, as vLLM); ``forced``: the structured outputs a chat's
    ``tool_choice`` asks for, and that field's name; ``defaults``: values for the fields the
    request left out (the model's generation_config.json's, ``sampling_defaults``)."""
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n is {req.n}; allowed: 1..{MAX_N}", "n")
    asked = req.prompt_logprobs
    if asked is not None and req.stream:  # as vLLM: a stream has no place for them; 0 asks for none
        if asked != 0:
            raise APIError(400, f"prompt_logprobs is {asked}; with stream: true allowed: null or 0", "prompt_logprobs")
        asked = None
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    structured = structured_for(req, forced)
    chosen = {k: getattr(req, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    chosen |= {k: v for k, v in (defaults or {}).items() if k not in req.model_fields_set}  # (null: left out)
    try:
        params = SamplingParams(
            max_tokens=max_tokens,  # (None: all the room each prompt leaves, ``_choices``)
            **chosen,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            n=req.n,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=asked if prompt_logprobs is None else prompt_logprobs,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            min_tokens=req.min_tokens,
            logit_bias=_logit_bias(req.logit_bias),
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words or None,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            cache_salt=req.cache_salt,
            structured_outputs=structured,
        )
    except ValueError as exc:
        message, field_name = str(exc), str(exc).split(" ", 1)[0]
        if field_name == "max_tokens" and max_tokens_field != "max_tokens":
            message, field_name = max_tokens_field + message[len("max_tokens") :], max_tokens_field
        elif field_name == "min_tokens":  # its bound, as the request named it
            message = message.replace("max_tokens]", f"{max_tokens_field}]")
        raise APIError(400, message, field_name) from None
    return params


# vLLM's structured_outputs fields, and those minengine takes only at their default (as "off")
_STRUCTURED_FIELDS = (*KINDS, "disable_any_whitespace")
_STRUCTURED_OFF = {
    "disable_fallback": False,
    "disable_additional_properties": False,
    "whitespace_pattern": None,
    "structural_tag": None,
}


def structured_for(req: _Sampling, forced: tuple[StructuredOutputs, str] | None = None) -> StructuredOutputs | None:
    """The request's structured outputs, from one of ``structured_outputs`` (vLLM's),
    ``response_format`` (the OpenAI API's: ``text``, ``json_object`` or ``json_schema``) and a
    chat's ``tool_choice`` ("required" or a named function: ``forced``); a 400 naming the field for
    a bad one, or for two at once."""
    given: list[tuple[StructuredOutputs, str]] = [] if forced is None else [forced]
    so = req.structured_outputs
    if so is not None:
        extra = next((k for k in so if k not in _STRUCTURED_FIELDS and k not in _STRUCTURED_OFF), None)
        if extra is not None:
            why = f"structured_outputs has field {_shown(extra)}; allowed: " + ", ".join(_STRUCTURED_FIELDS)
            raise APIError(400, why, "structured_outputs")
        off = next((k for k, v in _STRUCTURED_OFF.items() if so.get(k, v) != v), None)
        if off is not None:
            why = f"structured_outputs {off} is {_shown(so[off])}; minengine does not support it (allowed: "
            raise APIError(400, why + f"{json.dumps(_STRUCTURED_OFF[off])})", "structured_outputs")
        given.append(
            (
                _structured(lambda: StructuredOutputs(**{k: so[k] for k in _STRUCTURED_FIELDS if k in so})),
                "structured_outputs",
            )
        )
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            given.append((_structured(lambda: StructuredOutputs(json_object=True)), "response_format"))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                why = 'response_format json_schema needs a "schema" (a JSON schema object)'
                raise APIError(400, why, "response_format")
            given.append((_structured(lambda: StructuredOutputs(json=schema), "response_format"), "response_format"))
        elif kind != "text":
            why = f'response_format type is {_shown(kind)}; allowed: "text", "json_object" or "json_schema"'
            raise APIError(400, why, "response_format")
    if len(given) > 1:
        why = f"{given[0][1]} and {given[1][1]} both constrain the output; allowed: one of them"
        raise APIError(400, why, given[1][1])
    return given[0][0] if given else None


def _structured(make, field_name: str = "structured_outputs") -> StructuredOutputs:
    """``make()``'s structured outputs, checked (its grammar parses); a 400 naming ``field_name``."""
    try:
        spec = make()
        spec.check()
    except (TypeError, ValueError) as exc:
        message = str(exc)
        if field_name != "structured_outputs":
            message = message.replace("structured_outputs json", f"{field_name} schema", 1)
        raise APIError(400, message, field_name) from None
    return spec


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """The request's ``logit_bias`` keyed by token id (its JSON keys are the ids as strings)."""
    if bias is None:
        return None
    bad = next((key for key in bias if not re.fullmatch(r"-?[0-9]{1,18}", key)), None)
    if bad is not None:
        why = f"logit_bias has key {_shown(bad)}; allowed: token ids (integers, as strings)"
        raise APIError(400, why, "logit_bias")
    return {int(key): value for key, value in bias.items()}


def chat_prompt(state: ServerState, req: ChatCompletionRequest | TokenizeRequest) -> tuple[str, str]:
    """The request's conversation rendered by the chat template (``Tokenizer.render_chat``), and
    the answer's role (vLLM's: the server's --response-role when the answer's turn is opened, else
    the last message's). A request's own template: checked by ``render_chat`` first."""
    messages = [_message(m) for m in req.messages]
    variables = req.chat_template_kwargs
    given = {"documents": req.documents, "tools": _tool_dicts(req.tools)}
    given = {k: v for k, v in given.items() if v is not None}
    if given:  # (as vLLM: chat_template_kwargs may give its own)
        variables = given | (variables or {})
    try:
        text = state.tokenizer.render_chat(
            messages, variables, req.add_generation_prompt, req.continue_final_message, req.chat_template
        )
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), name if name in _CHAT_FIELDS else "messages") from None
    opened = req.add_generation_prompt if req.add_generation_prompt is not None else not req.continue_final_message
    return text, state.response_role if opened else req.messages[-1].role


async def render_chat(state: ServerState, req: ChatCompletionRequest | TokenizeRequest) -> tuple[str, str]:
    """``chat_prompt``; a request's own template renders in the default thread pool (it may take
    a while: the event loop goes on serving)."""
    if req.chat_template is not None:
        _check_template(state, req.chat_template)  # (before the thread: a refusal needs none)
        return await asyncio.to_thread(chat_prompt, state, req)
    return chat_prompt(state, req)


def _check_template(state: ServerState, template: str | None) -> None:
    """A 400 for a request's own chat template the server does not take: without
    --trust-request-chat-template, or longer than ``MAX_CHAT_TEMPLATE``."""
    if template is None:
        return
    if not state.trust_request_chat_template:
        why = "chat_template is given, but the server was not started with --trust-request-chat-template"
        raise APIError(400, why, "chat_template")
    if len(template) > MAX_CHAT_TEMPLATE:
        why = f"chat_template has {len(template)} characters; allowed: at most {MAX_CHAT_TEMPLATE}"
        raise APIError(400, why, "chat_template")


def _tool_dicts(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The request's tools as it gave them (no fields it left out), for the template."""
    return None if tools is None else [{"type": t.type, **t.model_dump(exclude_unset=True)} for t in tools]


def tool_parser(state: ServerState, req: ChatCompletionRequest) -> str | None:
    """The parser that finds the tool calls in a request's answer (None: the answer has none),
    from its ``tool_choice`` (as vLLM: "auto" when it gives tools and no choice): "auto" takes
    --tool-call-parser, "required" and a named function (``forced_tool``) their own; a 400 for a
    choice this server cannot carry out. A prefill server checks the choice alone: its answer is
    one token, which the router drops (the decode server's flags decide)."""
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
    if choice == "none" or (choice == "auto" and req.tools == []):  # (as vLLM: nothing to call)
        return None
    if not req.tools:
        why = f'tool_choice is {_shown(choice)}, but no tools are given; allowed: "none"'
        raise APIError(400, why, "tool_choice")
    if choice == "required" or isinstance(choice, dict):
        _named_function(req)  # (checked)
        return None if state.mode == "prefill" else "required" if choice == "required" else "named"
    if choice != "auto":
        why = f'tool_choice is {_shown(choice)}; allowed: "none", "auto", "required" or a named function'
        raise APIError(400, why, "tool_choice")
    if state.mode == "prefill":
        return None
    if not state.enable_auto_tool_choice or state.tool_call_parser is None:
        why = (
            'tool_choice is "auto" (the default with tools), but the server was not started with '
            "--enable-auto-tool-choice and --tool-call-parser"
        )
        raise APIError(400, why, "tool_choice")
    return state.tool_call_parser


def _named_function(req: ChatCompletionRequest) -> FunctionDefinition | None:
    """The tool a named ``tool_choice`` names (None for "required"); a 400 for a malformed one or
    a name that is not among the tools."""
    choice = req.tool_choice
    if not isinstance(choice, dict):
        return None
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str):
        why = f'tool_choice is {_shown(choice)}; allowed: {{"type": "function", "function": {{"name": ...}}}}'
        raise APIError(400, why, "tool_choice")
    tool = next((t.function for t in req.tools if t.function.name == name), None)
    if tool is None:
        names = ", ".join(json.dumps(t.function.name) for t in req.tools)
        why = f"tool_choice names function {_shown(name)}; allowed: one of the tools ({names})"
        raise APIError(400, why, "tool_choice")
    return tool


def forced_tool(req: ChatCompletionRequest, named: FunctionDefinition | None) -> tuple[StructuredOutputs, str] | None:
    """The structured outputs that a ``tool_choice`` of "required" or a named function
    (``named``, from ``_named_function``) asks for (``sampling_params``'s ``forced``); None for
    any other choice."""
    if not req.tools or not (req.tool_choice == "required" or named is not None):
        return None
    try:
        if named is not None:
            schema = named.parameters or {"type": "object", "properties": {}}
        else:
            schema = required_calls_schema([t.function.model_dump() for t in req.tools])
    except ValueError as exc:
        raise APIError(400, str(exc), "tools") from None
    return _structured(lambda: StructuredOutputs(json=schema), "tool_choice"), "tool_choice"


def _message(m: ChatMessage) -> dict[str, Any]:
    return {**(m.model_extra or {}), "role": m.role, "content": m.content}


def chat_echo(req: ChatCompletionRequest, role: str) -> str | None:
    """What vLLM's chat ``echo`` puts before the answer: the last message (its parts joined) when
    it has the answer's ``role``; None for nothing."""
    last = req.messages[-1]
    if not req.echo or last.role != role:
        return None
    return chat_messages([_message(last)])[0]["content"] or None


# the fields render_chat's messages start with (the others are about the messages)
_CHAT_FIELDS = ("chat_template_kwargs", "continue_final_message", "chat_template")


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    bootstrap: Bootstrap | None = None
    echo: str | None = None  # echo: the prompt's text (the chat API's: the last message's), output first
    prompt_only: bool = False  # echo with max_tokens 0: the prompt alone (its one token is dropped)
    tool_parser: str | None = None  # a chat answer's: what finds its tool calls (tool_calls.PARSERS or FORCED)
    tool_function: str | None = None  # a named tool_choice's function
    max_tool_calls: int | None = None  # parallel_tool_calls false: 1
    reasoning_parser: str | None = None  # a chat answer's: what finds its reasoning (reasoning.PARSERS)
    prompt_opens_reasoning: bool = False  # the output goes on reasoning (reasoning.prompt_opens_reasoning)
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out of the answer

    def reasoning(self) -> ReasoningStream | None:
        """A reasoning parser for this choice's output, or None when it has no reasoning to find."""
        if self.reasoning_parser is None:
            return None
        return ReasoningStream(self.reasoning_parser, self.prompt_opens_reasoning)

    def tool_calls(self) -> ToolCallStream | None:
        """A parser for this choice's output, or None when its output has no tool calls."""
        if self.tool_parser is None:
            return None
        return ToolCallStream(self.tool_parser, self.max_tool_calls, self.tool_function)


ROOM_LIMIT = 2**63


def bootstrap_of(state: ServerState, req: _Sampling, num_prompts: int) -> Bootstrap | None:
    """The disaggregation fields of a request, checked against the server's mode."""
    bootstrap = _bootstrap_fields(state, req)
    if bootstrap is not None and (req.n != 1 or num_prompts != 1):
        raise APIError(400, f"a disaggregated request takes one prompt and n=1; got {num_prompts} and n={req.n}", "n")
    return bootstrap


@contextlib.contextmanager
def _peer_told(state: ServerState, req: _Sampling) -> Iterator[None]:
    """A disaggregated request refused here: the other server, which waits for its half, is told
    at once (instead of failing it after its bootstrap timeout)."""
    try:
        yield
    except APIError as exc:
        try:
            bootstrap = _bootstrap_fields(state, req)
        except APIError:  # no usable address or room: nothing to tell
            bootstrap = None
        if bootstrap is not None:
            state.client.fail_room(bootstrap, exc.message)
        raise


def _bootstrap_fields(state: ServerState, req: _Sampling) -> Bootstrap | None:
    fields = {"bootstrap_host": req.bootstrap_host, "bootstrap_port": req.bootstrap_port}
    fields["bootstrap_room"] = req.bootstrap_room
    if state.mode == "null":
        given = next((k for k, v in fields.items() if v is not None), None)
        if given is not None:
            why = f"{given} is only accepted by a server in --disaggregation-mode prefill or decode"
            raise APIError(400, why, given)
        return None
    room = req.bootstrap_room
    if room is None:
        raise APIError(
            400,
            f"bootstrap_room is required on a {state.mode} server; send requests through minengine.router",
            "bootstrap_room",
        )
    if not 0 <= room < ROOM_LIMIT:
        raise APIError(400, f"bootstrap_room is {room}; allowed: 0..{ROOM_LIMIT - 1}", "bootstrap_room")
    host, port = req.bootstrap_host, req.bootstrap_port
    if state.mode == "decode":
        if not host:
            raise APIError(400, "bootstrap_host is required on a decode server", "bootstrap_host")
        if port is None or not 1 <= port <= 65535:
            raise APIError(400, f"bootstrap_port is {port}; allowed: 1..65535", "bootstrap_port")
    return Bootstrap(host or "", port or 0, room)


# --- the app ----------------------------------------------------------------------------------


def openai_errors(app: FastAPI) -> None:
    """Routing errors (an unknown path: 404, a wrong method: 405) in the OpenAI error shape too."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(raw: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code in (404, 405):
            detail = f"{raw.method} {raw.url.path}: {exc.detail}"
            return error_response(exc.status_code, detail, None, getattr(exc, "headers", None))
        return error_response(exc.status_code, str(exc.detail), None, getattr(exc, "headers", None))


class _InFlight:
    """ASGI middleware: each HTTP request counts as in flight from its arrival until its response,
    a stream's last chunk included, has gone out, so a shutdown waits for the requests it accepted
    (one still rendering its chat template too: it has not reached the scheduler yet)."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.state.shutting_down:  # (one that comes later gets a 503)
            await self.app(scope, receive, send)
            return
        self.state.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.leave()


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="minengine", docs_url=None, redoc_url=None)
    app.add_middleware(_InFlight, state=state)
    openai_errors(app)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(SchedulerDied)
    async def _dead(_: Request, exc: SchedulerDied) -> JSONResponse:
        return error_response(500, f"the scheduler is not running: {_summary(exc)}")

    @app.exception_handler(RequestFailed)
    async def _failed(_: Request, exc: RequestFailed) -> JSONResponse:
        return error_response(499 if str(exc) == DECODE_ABORTED else 500, f"the request failed: {exc}")

    @app.api_route("/health", methods=["GET", "HEAD"])  # (HEAD: load balancers' probes)
    async def health() -> Response:
        if state.healthy:
            return Response(status_code=200)
        return error_response(503, "shutting down" if state.shutting_down else "the scheduler is not running")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> dict[str, Any]:
        """vLLM's: the token ids a prompt, or a conversation through the chat template, runs as."""
        req = await parse_body(state, raw, TokenizeRequest)
        _check_open(state, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give either prompt or messages (one of them)", "prompt")
        if req.messages is not None:
            if not req.messages:
                raise APIError(400, "messages is empty", "messages")
            text, _ = await render_chat(state, req)
            name, special = "messages", bool(req.add_special_tokens)
        else:
            text, name, special = req.prompt, "prompt", req.add_special_tokens is not False
        ids, _ = await off_loop(state, len(text), _encode, state.tokenizer, text, name, special)
        strs = [state.tokenizer.backend.id_to_token(i) for i in ids] if req.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": state.client.ready.context_length,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> dict[str, Any]:
        """vLLM's: the text of token ids (special tokens included)."""
        req = await parse_body(state, raw, DetokenizeRequest)
        _check_open(state, req.model)
        vocab = state.client.ready.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens.{bad} is {req.tokens[bad]}; allowed: token ids 0..{vocab - 1}", "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile(raw: Request) -> dict[str, Any]:
        """SGLang's: profile the running engines (every data-parallel worker) until /stop_profile
        or for ``num_steps`` forward passes; a Chrome trace per worker in --torch-profiler-dir."""
        _check_profiling(state)
        body = await raw.body()
        req = ProfileRequest() if not body.strip() else await off_loop(state, len(body), _parse, body, ProfileRequest)
        for name in req.model_extra or {}:
            where = " (the server's --torch-profiler-dir)" if name == "output_dir" else ""
            raise APIError(400, f"{name} is not a field minengine's /start_profile takes{where}", name)
        try:
            activities = None if req.activities is None else tuple(req.activities)
            spec = ProfileSpec(
                state.torch_profiler_dir,
                new_profile_name(),
                activities,
                req.num_steps,
                req.record_shapes,
                req.with_stack,
            )
        except ValueError as exc:
            raise APIError(400, str(exc), str(exc).split(" ", 1)[0]) from None
        traces = await _profile_call(state, StartProfile(spec))
        return {"status": "started", "num_steps": req.num_steps, "traces": traces}

    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile() -> dict[str, Any]:
        """SGLang's: stop the profile /start_profile began (on a worker that ``num_steps`` stopped,
        take the trace it wrote) and answer once the traces are written, with their paths."""
        _check_profiling(state)
        return {"status": "stopped", "traces": await _profile_call(state, StopProfile())}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        """What a router checks before pairing this server (SGLang has an endpoint of this name)."""
        return {
            "version": __version__,
            "served_model_name": state.served_model_name,
            "disaggregation_mode": state.mode,
            "disaggregation_bootstrap_port": state.bootstrap_port,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        ready = state.client.ready
        card = {
            "id": state.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "minengine",
            "max_model_len": ready.context_length if ready else None,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        req = await parse_body(state, raw, CompletionRequest)
        with _peer_told(state, req):
            _check_open(state, req.model)
            keep = _keep(state, req.truncate_prompt_tokens)
            size = sum(
                len(p) for p in ([req.prompt] if isinstance(req.prompt, str) else req.prompt) if isinstance(p, str)
            )
            prompts, texts = await off_loop(
                state, size, _completion_prompts, state.tokenizer, req.prompt, keep, req.add_special_tokens
            )
            bootstrap = bootstrap_of(state, req, len(prompts))
            # as vLLM: echo with logprobs lists the prompt's tokens too, scored with ``prompt_logprobs``
            # top tokens when given (0 with stream too), else ``logprobs``
            echo_logprobs = None
            if req.echo and req.logprobs is not None:
                echo_logprobs = req.logprobs if req.prompt_logprobs is None else req.prompt_logprobs
            # as vLLM: echo with max_tokens 0 answers with the prompt alone (scoring it); it runs
            # with one token, which the answer leaves out
            prompt_only = req.echo and req.max_tokens == 0
            if req.max_tokens == 0 and not prompt_only:
                why = "max_tokens is 0; allowed: an integer >= 1, or 0 with echo (the prompt alone)"
                raise APIError(400, why, "max_tokens")
            max_tokens = 1 if prompt_only else req.max_tokens
            params = sampling_params(
                req, max_tokens, logprobs=req.logprobs, prompt_logprobs=echo_logprobs, defaults=state.sampling_defaults
            )
            choices = _choices(state, prompts, params, bootstrap, echo=texts if req.echo else None)
            for c in choices:
                c.prompt_only = prompt_only
        return await _respond(state, raw, req, choices, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        req = await parse_body(state, raw, ChatCompletionRequest)
        with _peer_told(state, req):
            _check_open(state, req.model)
            if req.top_logprobs and not req.logprobs:  # as vLLM: 0 without logprobs is no request
                raise APIError(400, f"top_logprobs is {req.top_logprobs}; it needs logprobs: true", "top_logprobs")
            if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                why = f"top_logprobs is {req.top_logprobs}; allowed: 0..{MAX_LOGPROBS}"
                raise APIError(400, why, "top_logprobs")
            if not req.messages:
                raise APIError(400, "messages is empty", "messages")
            parser = tool_parser(state, req)
            if parser is not None and _special_tags(state.tokenizer, parser):
                req.skip_special_tokens = False  # (as vLLM: the calls' tags are in the text)
            text, role = await render_chat(state, req)
            echo = chat_echo(req, role)
            keep = _keep(state, req.truncate_prompt_tokens)
            prompt_ids, _ = await off_loop(
                state, len(text), _encode, state.tokenizer, text, "messages", req.add_special_tokens, keep
            )
            field_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            bootstrap = bootstrap_of(state, req, 1)
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            named = _named_function(req)  # (tool_parser checked it)
            forced = forced_tool(req, named)
            params = sampling_params(
                req, max_tokens, field_name, logprobs, forced=forced, defaults=state.sampling_defaults
            )
            final = chat_messages([_message(req.messages[-1])])[0]["content"] if req.continue_final_message else None
            opens = state.reasoning_parser is not None and prompt_opens_reasoning(text, final)
            # (a prefill server's too: the first token it samples is the grammar's only after reasoning)
            params = grammar_after_reasoning(params, state.reasoning_parser, opens, state.tokenizer)
            echoed = None if echo is None else [echo]
            choices = _choices(state, [prompt_ids], params, bootstrap, "messages", field_name, echoed)
            reasoning = state.reasoning_parser if state.mode != "prefill" else None
            for c in choices:
                c.tool_parser, c.max_tool_calls = parser, None if req.parallel_tool_calls else 1
                c.tool_function = named.name if named is not None else None
                c.reasoning_parser, c.include_reasoning = reasoning, req.include_reasoning
                c.prompt_opens_reasoning = reasoning is not None and opens
        return await _respond(state, raw, req, choices, chat=True, role=role)

    return app


def _special_tags(tokenizer: Tokenizer, parser: str) -> bool:
    """Whether a tag that tool parser ``parser`` needs in the text is a special token of
    ``tokenizer`` (which decoding would drop)."""
    tags = (PARSERS | FORCED)[parser].kept_tags
    return any(tokenizer.backend.token_to_id(tag) in tokenizer.special_ids for tag in tags)


def _keep(state: ServerState, k: int | None) -> int | None:
    """How many prompt tokens ``truncate_prompt_tokens`` = ``k`` keeps (None: all), or a 400 naming it."""
    if k is None:
        return None
    try:
        SamplingParams(truncate_prompt_tokens=k)  # its range
        return truncation(k, state.client.ready.context_length)
    except ValueError as exc:
        raise APIError(400, str(exc), "truncate_prompt_tokens") from None


def _check_open(state: ServerState, model: str | None) -> None:
    if state.shutting_down:
        raise APIError(503, "the server is shutting down")
    if state.client.dead is not None:
        raise SchedulerDied(state.client.dead)
    if model is not None and model != state.served_model_name:
        raise APIError(404, f"the model {model!r} does not exist; served: {state.served_model_name!r}", "model")


def _completion_prompts(
    tokenizer: Tokenizer, prompt: str | list, keep: int | None = None, add_special_tokens: bool = True
) -> tuple[list[list[int]], list[str | None]]:
    """Each prompt's token ids and text (None where token ids were given); ``keep``: at most that
    many tokens of each, its last (a text's special tokens stay, as vLLM's tokenizer truncates);
    ``add_special_tokens``: a text's, as the tokenizer adds them (a BOS)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", "prompt")
    ids, texts = [], []
    for p in prompt:  # (as vLLM: "" runs when the tokenizer adds a BOS; no tokens at all: check_prompt's 400)
        if not isinstance(p, str):
            ids.append(list(p)[-keep:] if keep is not None else list(p))
            texts.append(None)
            continue
        kept, cut = _encode(tokenizer, p, "prompt", add_special_tokens, keep)
        ids.append(kept)
        texts.append(tokenizer.decode(kept) if cut else p)  # what ran, for echo
    return ids, texts


def _encode(
    tokenizer: Tokenizer, text: str, field_name: str, add_special_tokens: bool, keep: int | None = None
) -> tuple[list[int], bool]:
    """``text``'s token ids, at most ``keep`` (the last ones, ``Tokenizer.encode_truncated``), and
    whether it cut any; a 400 naming ``field_name`` for a text the tokenizer cannot take."""
    try:
        if keep is not None:
            return tokenizer.encode_truncated(text, keep, add_special_tokens)
        return tokenizer.encode(text, add_special_tokens), False
    except Exception as exc:  # text the tokenizer cannot take (a lone surrogate: not valid Unicode)
        raise APIError(400, f"{field_name} cannot be tokenized: {exc}", field_name) from None


# the sampling fields check_prompt names first in its message (the others are about the prompt)
_CHECKED_FIELDS = ("logit_bias", "allowed_token_ids", "bad_words", "min_tokens")


def _choices(
    state: ServerState,
    prompts: list[list[int]],
    params: SamplingParams,
    bootstrap: Bootstrap | None = None,
    prompt_field: str = "prompt",
    max_field: str = "max_tokens",
    echo: list[str | None] | None = None,
) -> list[Choice]:
    """One choice per prompt and sequence; ``prompt_field`` / ``max_field``: the request's names
    for them; ``echo``: each prompt's text to echo (None: decode its ids), or None for no echo."""
    n = params.n
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None and state.mode != "null":
            # the prefill server samples the first token: the decode server never sees its logprobs
            why = f"{name} is requested on a {state.mode} server; with prefill/decode disaggregation, allowed: off"
            raise APIError(400, why, name)
    if len(prompts) * n > MAX_SEQUENCES:
        raise APIError(
            400, f"{len(prompts)} prompts x n {n} = {len(prompts) * n} sequences; allowed: at most {MAX_SEQUENCES}", "n"
        )
    ready = state.client.ready
    per_prompt = []
    subject = "the messages take" if prompt_field == "messages" else "the prompt takes"
    for ids in prompts:
        try:
            # as vLLM: max_tokens None (or left out in chat) is all the room the prompt leaves
            p = resolve_max_tokens(ids, params, ready.context_length, ready.kv_capacity_tokens, subject)
            # a prefill server computes the prompt and one token; the decode server holds the rest
            checked = p.first_token_only() if state.mode == "prefill" else p
            check_prompt(
                ids,
                checked,
                ready.vocab_size,
                ready.context_length,
                ready.kv_capacity_tokens,
                state.tokenizer,
                ready.eos_token_ids,
            )
        except ValueError as exc:
            message = str(exc)
            if state.mode == "prefill":  # its max_tokens is 1 (see above), not the request's
                message = message.replace("max_tokens (1) =", "the first output token (this prefill server's part) =")
            message = message.replace("prompt (", f"{prompt_field} (").replace("max_tokens (", f"{max_field} (")
            message = message.replace("max_tokens]", f"{max_field}]")  # (min_tokens over the room left)
            field_name = message.split(" ", 1)[0]
            raise APIError(400, message, field_name if field_name in _CHECKED_FIELDS else prompt_field) from None
        per_prompt.append(p)
    choices = []
    for i, (ids, p) in enumerate(zip(prompts, per_prompt, strict=True)):
        text = None
        if echo is not None:
            text = echo[i] if echo[i] is not None else state.tokenizer.decode(ids, skip_special_tokens=False)
        for seq_params in p.per_sequence():
            choices.append(Choice(len(choices), ids, seq_params, bootstrap, text))
    return choices


async def _pieces(state: ServerState, choices: list[Choice]) -> AsyncIterator[tuple[int, Piece]]:
    """Every choice's pieces as they come, tagged with the choice index. Closing this iterator
    cancels the choices, which aborts them in the scheduler."""
    queue: asyncio.Queue = asyncio.Queue()

    async def run(choice: Choice) -> None:
        rid = uuid.uuid4().hex
        try:
            async for piece in generate(
                state.client, state.tokenizer, state.metrics, rid, choice.prompt_ids, choice.params, choice.bootstrap
            ):
                queue.put_nowait((choice.index, _prompt_only(piece) if choice.prompt_only else piece))
        except (SchedulerDied, RequestFailed) as exc:
            queue.put_nowait((choice.index, exc))
        finally:
            queue.put_nowait((choice.index, None))

    tasks = [asyncio.create_task(run(c)) for c in choices]
    open_choices, held = len(tasks), None
    try:
        while open_choices:
            if held is not None:
                (index, item), held = held, None
            else:
                index, item = await queue.get()
            if isinstance(item, Piece):  # with the same choice's pieces already waiting: one chunk
                item, held = _merge_waiting(index, item, queue)
            if item is None:
                open_choices -= 1
            elif isinstance(item, (SchedulerDied, RequestFailed)):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _prompt_only(piece: Piece) -> Piece:
    """A piece of a prompt-only choice (echo, max_tokens 0): no output token; it ends by length."""
    reason = piece.finish_reason if piece.finish_reason in (None, "abort") else "length"
    logprobs = None if piece.logprobs is None else []
    return Piece("", [], reason, piece.cached_tokens, None, logprobs, piece.prompt_logprobs)


def _merge_waiting(index: int, piece: Piece, queue: asyncio.Queue) -> tuple[Piece, tuple | None]:
    """``piece`` merged with the pieces of choice ``index`` queued right behind it (a stream that
    fell behind sends them as one chunk), and the first queued item it did not take. Never waits."""
    pieces = [piece]
    while pieces[-1].finish_reason is None and not queue.empty():
        item = queue.get_nowait()
        if item[0] != index or not isinstance(item[1], Piece):
            return _joined(pieces), item
        pieces.append(item[1])
    return _joined(pieces), None


def _joined(pieces: list[Piece]) -> Piece:
    if len(pieces) == 1:
        return pieces[0]
    return Piece(
        "".join(p.text for p in pieces),
        [t for p in pieces for t in p.token_ids],
        pieces[-1].finish_reason,
        sum(p.cached_tokens for p in pieces),
        pieces[-1].stop_reason,
        None if pieces[0].logprobs is None else [e for p in pieces for e in p.logprobs],
        next((p.prompt_logprobs for p in pieces if p.prompt_logprobs is not None), None),
    )


async def _respond(
    state: ServerState, raw: Request, req: _Sampling, choices: list[Choice], chat: bool, role: str = "assistant"
) -> Response:
    """The answer to a request of ``choices``, streamed or whole; ``role``: a chat answer's."""
    base = raw.headers.get("x-request-id") or req.request_id or uuid.uuid4().hex  # (as vLLM)
    rid = ("chatcmpl-" if chat else "cmpl-") + base
    created = int(time.time())
    model = state.served_model_name
    # usage counts each prompt once, though its n choices are n requests: its prompt tokens, and
    # the prefix-cache hits of its first choice
    prompt_tokens = sum(len(c.prompt_ids) for c in choices[:: req.n])
    first_choices = {c.index for c in choices[:: req.n]}
    as_ids = req.return_tokens_as_token_ids
    as_ids = state.return_tokens_as_token_ids if as_ids is None else as_ids
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and bool(req.stream_options.continuous_usage_stats)
        shape = _Shape(role if chat else None, as_ids, req.return_token_ids, continuous)
        stream = _stream(state, choices, rid, created, model, shape, include_usage, prompt_tokens, first_choices)
        return StreamingResponse(stream, media_type="text/event-stream")

    texts = [c.echo or "" for c in choices]
    token_ids: list[list[int]] = [[] for _ in choices]
    entries: list[list] = [[] for _ in choices]
    prompt_entries: list[list | None] = [None] * len(choices)
    reasons: list[str | None] = [None] * len(choices)
    stop_reasons: list[str | int | None] = [None] * len(choices)
    completion_tokens = cached = 0

    async def collect() -> None:
        nonlocal completion_tokens, cached
        async for index, piece in _pieces(state, choices):
            texts[index] += piece.text
            token_ids[index] += piece.token_ids
            entries[index] += piece.logprobs or ()
            if piece.prompt_logprobs is not None:
                prompt_entries[index] = piece.prompt_logprobs
            completion_tokens += piece.num_tokens
            cached += piece.cached_tokens if index in first_choices else 0
            if piece.finish_reason is not None:
                reasons[index], stop_reasons[index] = piece.finish_reason, piece.stop_reason

    task = asyncio.create_task(collect())
    while not task.done():  # a client that goes away aborts its requests at once
        await asyncio.wait({task}, timeout=0.05)
        if not task.done() and await raw.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return Response(status_code=499)
    task.result()
    body_choices = []
    for i, (c, t, r, sr) in enumerate(zip(choices, texts, reasons, stop_reasons, strict=True)):
        output = {"message": {"role": role, "content": t}} if chat else {"text": t}
        if chat and (c.reasoning_parser or c.tool_parser):
            output["message"], r = _chat_message(c, role, t, r)
        ids, lp_entries = token_ids[i], entries[i]
        if c.echo is not None and c.params.logprobs is not None and not chat:  # the prompt's tokens first
            ids, lp_entries = c.prompt_ids + ids, _echo_entries(c, prompt_entries[i]) + lp_entries
        lps = _logprobs(state.tokenizer, c, ids, lp_entries, chat, as_ids=as_ids)
        body_choices.append({"index": i, **output, "logprobs": lps, "finish_reason": r, "stop_reason": sr})
        if not chat:  # vLLM's field (null unless asked for)
            body_choices[-1]["prompt_logprobs"] = _prompt_logprobs(state.tokenizer, c, prompt_entries[i])
        if req.return_token_ids:  # vLLM's: the output's ids (the prompt's: a chat's at the top)
            if not chat:
                body_choices[-1]["prompt_token_ids"] = c.prompt_ids
            body_choices[-1]["token_ids"] = token_ids[i]
    body = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": body_choices,
        "usage": usage(prompt_tokens, completion_tokens, cached),
    }
    if chat:  # vLLM's: once, at the top (the prompt's; its first choice's)
        body["prompt_logprobs"] = _prompt_logprobs(state.tokenizer, choices[0], prompt_entries[0])
        if req.return_token_ids:
            body["prompt_token_ids"] = choices[0].prompt_ids
    return JSONResponse(body)


def _chat_message(c: Choice, role: str, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole chat answer's message, its output ``text`` parsed (after what echo put first):
    its reasoning (``--reasoning-parser``), then the calls in the rest (``tool_parser``); and its
    finish reason (``tool_calls`` once a call was found, as vLLM, unless it was aborted)."""
    echo = c.echo or ""
    message: dict[str, Any] = {"role": role}
    content: str | None = text[len(echo) :]
    if c.reasoning_parser is not None:  # (as vLLM: the field is there, null for none or not included)
        reasoning, content = split_reasoning(c.reasoning_parser, content, c.prompt_opens_reasoning)
        message["reasoning"] = (reasoning or None) if c.include_reasoning else None
    calls = []
    if c.tool_parser is not None:
        content, calls = parse_tool_calls(c.tool_parser, content, c.max_tool_calls, c.tool_function)
        message["tool_calls"] = [call.to_json() for call in calls]  # (as vLLM: [] for none)
    text = echo + (content or "")
    # as vLLM: no text is null once reasoning or calls were looked for apart from it
    message["content"] = text if text or not (calls or c.reasoning_parser) else None
    return message, finish_reason(c.tool_parser, reason, bool(calls)) if c.tool_parser is not None else reason


@dataclass(frozen=True)
class _Shape:
    """What a streamed answer looks like: a chat answer's ``role`` (None: a completion's), logprobs
    naming tokens by id (``as_ids``), token ids alongside the text (``token_ids``), and each
    chunk's choice's usage so far (``continuous``: vLLM's ``continuous_usage_stats``)."""

    role: str | None
    as_ids: bool = False
    token_ids: bool = False
    continuous: bool = False


def _prompt_logprobs(tokenizer: Tokenizer, choice: Choice, prompt_entries: list | None) -> list | None:
    """vLLM's ``prompt_logprobs`` of a choice: None unless it asked for them; a None per token
    when it ended before they came (an abort before its first token)."""
    if choice.params.prompt_logprobs is None:
        return None
    if prompt_entries is None:
        return [None] * len(choice.prompt_ids)
    return logprob_format.prompt_json(choice.prompt_ids, prompt_entries, tokenizer)


def _echo_entries(choice: Choice, prompt_entries: list | None) -> list:
    """The logprobs entries of an echoed prompt's tokens: None for the first (and for all when
    the request ended before its prompt logprobs came); as vLLM, each lists at most ``logprobs``
    top tokens (``prompt_logprobs`` may have asked for more)."""
    if prompt_entries is None:
        return [None] * len(choice.prompt_ids)
    k = choice.params.logprobs
    return [None, *((lp, rank, ids[:k], lps[:k]) for lp, rank, ids, lps in prompt_entries)]


def _logprobs(
    tokenizer: Tokenizer,
    choice: Choice,
    ids: list[int],
    entries: list,
    chat: bool,
    text_offset: int = 0,
    as_ids: bool = False,
) -> dict[str, Any] | None:
    """A choice's ``logprobs`` object for the tokens ``ids`` (None when it did not ask for them);
    ``as_ids``: tokens named "token_id:<id>" (vLLM's ``return_tokens_as_token_ids``)."""
    if choice.params.logprobs is None:
        return None
    if chat:
        return {"content": logprob_format.chat(ids, entries, tokenizer, as_ids)}
    return logprob_format.completion(ids, entries, tokenizer, text_offset, as_ids)


async def _stream(
    state: ServerState,
    choices: list[Choice],
    rid: str,
    created: int,
    model: str,
    shape: _Shape,
    include_usage: bool,
    prompt_tokens: int,
    first_choices: set[int],
) -> AsyncIterator[str]:
    """The answer's chunks. With ``shape.token_ids`` (vLLM's ``return_token_ids``), each chunk
    has the output token ids it adds, and a choice's first the prompt's (a chat's: its role
    chunk, at the top)."""
    role, chat = shape.role, shape.role is not None
    kind: Literal["chat.completion.chunk", "text_completion"] = "chat.completion.chunk" if chat else "text_completion"
    done = [0] * len(choices)  # each choice's output tokens so far

    def chunk(choice_list: list[dict[str, Any]], **extra: Any) -> str:
        if shape.continuous and choice_list:  # the choice's usage so far (vLLM's: no cache details)
            prompt, out = len(choices[choice_list[0]["index"]].prompt_ids), done[choice_list[0]["index"]]
            extra["usage"] = {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}
        body = {"id": rid, "object": kind, "created": created, "model": model, "choices": choice_list, **extra}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    completion_tokens = cached = 0
    # tokens not sent yet (a piece without text sends no chunk): those logprobs are for (with
    # echo, the prompt's first), their entries, the output's; and where each choice's next token
    # starts in its text (the completions API's text_offset)
    pending: list[tuple[list[int], list, list[int]]] = [([], [], []) for _ in choices]
    offsets = [0] * len(choices)
    echoed: set[int] = set()  # the choices whose prompt the stream has echoed
    sent: set[int] = set()  # the choices a chunk has been sent for
    parsers = [c.tool_calls() for c in choices]  # each chat choice's tool call parser (None: no tools)
    reasoners = [c.reasoning() for c in choices]  # each chat choice's reasoning parser (None: none)
    try:
        if chat:  # the role comes first, once per choice
            for c in choices:
                delta = {"role": role, "content": ""}
                prompt = {"prompt_token_ids": c.prompt_ids} if shape.token_ids else {}
                yield chunk([{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}], **prompt)
        async for index, piece in _pieces(state, choices):
            completion_tokens += piece.num_tokens
            done[index] += piece.num_tokens
            cached += piece.cached_tokens if index in first_choices else 0
            ids, entries, new_ids = pending[index]
            c, text, calls, reasoning, last = choices[index], piece.text, [], "", piece.finish_reason is not None
            if (reasoner := reasoners[index]) is not None:  # the reasoning and the content this piece adds
                reasoning, text = reasoner.feed(text, last)
                reasoning = reasoning if c.include_reasoning else ""
            if (parser := parsers[index]) is not None:  # the content and the calls this piece completes
                text, calls = parser.feed(text, last)
            # what echo puts first goes in the first chunk with output (vLLM sends a chat's on its
            # own, before any token: a disaggregation router would take it for output)
            if c.echo is not None and index not in echoed:
                echoed.add(index)
                text = c.echo + text
                if c.params.logprobs is not None and not chat:  # (a completion's prompt's)
                    ids += c.prompt_ids
                    entries += _echo_entries(c, piece.prompt_logprobs)
            ids += piece.token_ids
            entries += piece.logprobs or ()
            new_ids += piece.token_ids
            if not text and not calls and not reasoning and piece.finish_reason is None:
                continue
            output = {"delta": {"content": text} if text else {}} if chat else {"text": text}
            if reasoning:
                output["delta"] = {"reasoning": reasoning, **output["delta"]}
            if calls:
                output["delta"]["tool_calls"] = [call.to_json(k) for k, call in calls]
            reason = piece.finish_reason
            if parser is not None:  # (as vLLM)
                reason = finish_reason(c.tool_parser, reason, parser.calls > 0)
            reasons = {"finish_reason": reason, "stop_reason": piece.stop_reason}
            lps = _logprobs(state.tokenizer, choices[index], ids, entries, chat, offsets[index], shape.as_ids)
            if lps is not None and ids and not chat:
                offsets[index] = lps["text_offset"][-1] + len(lps["tokens"][-1])
            pending[index] = ([], [], [])
            if shape.token_ids:  # the output's ids this chunk adds; a completion's first chunk: the prompt's
                first = not chat and index not in sent
                output |= ({"prompt_token_ids": c.prompt_ids} if first else {}) | {"token_ids": new_ids}
                sent.add(index)
            yield chunk([{"index": index, **output, "logprobs": lps, **reasons}])
        if include_usage:
            yield chunk([], usage=usage(prompt_tokens, completion_tokens, cached))
        yield "data: [DONE]\n\n"
    except (SchedulerDied, RequestFailed) as exc:
        error = {"error": {"message": _summary(exc), "type": "InternalServerError", "param": None, "code": 500}}
        yield f"data: {json.dumps(error)}\n\n"
        yield "data: [DONE]\n\n"  # the stream still ends as clients expect (vLLM does the same)
