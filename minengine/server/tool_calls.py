"""Tool calls in a model's output, as vLLM's ``--tool-call-parser`` finds them.

A parser reads a choice's output as it streams: ``feed`` takes the next text and gives back what
can be handed out now, in order: content (strings) and complete calls (``ToolCall``); ``finish``
gives the rest at the end. A whole answer is parsed by feeding it all at once (``parse``), so a
streamed answer and a whole one have the same content and calls, however the text was split.

- ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, any number of them. The text before, between and after the calls is content, each
  stretch of it only when it is more than whitespace (an output without calls is all content). A
  block that is not a call (not JSON, no name or no arguments) stays in the content as it was
  written, so nothing is lost. A block left open at the end is a call when what follows the tag
  is one.
- ``llama3_json`` (Llama 3.1 / 3.2): an output that starts with ``{`` (or ``<|python_tag|>``) is
  one or more ``{"name": ..., "parameters": {...}}`` objects, separated by ``;``. It is held to
  the end; an output that does not parse that way is content.

A stream holds back only text that might be the start of a tag, until it is known not to be one,
and whitespace, until it is known to be content; an open block or a llama3_json output waits for
its end.

A chat's ``tool_choice`` "required" or a named function forces calls with structured outputs
(the output follows a JSON schema, ``required_calls_schema`` or the function's parameters), as
vLLM does; no ``--tool-call-parser`` is needed for them:
- ``required``: the output is a JSON list of ``{"name": ..., "parameters": {...}}``, one call each.
- ``named``: the output is the named function's arguments, one call.
Both are read at the end. An output cut short (``length``) that does not parse stays content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON text (the OpenAI API's form)
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        """The API's tool call object; ``index``: its place among the choice's calls (a stream's)."""
        out = {"index": index} if index is not None else {}
        return out | {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


Item = str | ToolCall


def _call(obj: Any) -> ToolCall | None:
    """A decoded JSON value as a call: an object with a string ``name`` and its ``arguments``
    (Llama's ``parameters``), as vLLM's parsers need them. None for anything else (an answer
    that is JSON with a ``name`` in it is no call)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    if key is None:
        return None
    arguments = obj[key]
    try:
        if isinstance(arguments, str):  # already JSON text: kept when it is JSON
            json.loads(arguments)
            return ToolCall(obj["name"], arguments)
        return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))
    except (ValueError, RecursionError):  # (a model can nest deeper than Python recurses)
        return None


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"
    kept_tags = (START, END)  # the tags the text must keep (decoding drops special tokens)

    def __init__(self) -> None:
        self._buffer = ""  # text not handed out yet: a possible tag's start, or an open block
        self._open = False  # inside a block
        self._searched = 0  # how much of an open block's buffer has no closing tag in it
        self._called = False  # a call has been found
        # the text between calls (and before the first, and after the last) is content only when
        # it is more than whitespace: its leading whitespace is held until it is known to be
        self._space = ""
        self._text = False  # the current stretch has had more than whitespace

    def feed(self, text: str) -> list[Item]:
        self._buffer += text
        out: list[Item] = []
        while True:
            if self._open:  # (searched from where the last search stopped: a long block is read once)
                end = self._buffer.find(self.END, self._searched)
                if end < 0:
                    self._searched = max(len(self._buffer) - len(self.END) + 1, 0)
                    return out
                self._close(self._buffer[:end], self.END, out)
                self._buffer = self._buffer[end + len(self.END) :]
                continue
            start = self._buffer.find(self.START)
            if start < 0:
                keep = partial_tag(self._buffer, self.START)
                self._outside(self._buffer[: len(self._buffer) - keep], out)
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return out
            self._outside(self._buffer[:start], out)
            self._buffer, self._open = self._buffer[start + len(self.START) :], True

    def finish(self) -> list[Item]:
        out: list[Item] = []
        if self._open:
            self._close(self._buffer, "", out)
        else:
            self._outside(self._buffer, out)
        if self._space and not self._called:  # no calls: the output is the content, all of it
            out.append(self._space)
        self._buffer = self._space = ""
        return out

    def _outside(self, text: str, out: list[Item]) -> None:
        if self._text:
            if text:
                out.append(text)
            return
        self._space += text
        if self._space.strip():
            out.append(self._space)
            self._space, self._text = "", True

    def _close(self, body: str, end: str, out: list[Item]) -> None:
        self._open, self._searched = False, 0
        try:
            call = _call(json.loads(body))
        except (ValueError, RecursionError):
            call = None
        if call is None:  # not a call: the block stays in the content, as written
            out.append(self._space + self.START + body + end)
            self._space, self._text = "", True
        else:  # the whitespace around a call is no content
            out.append(call)
            self._called, self._space, self._text = True, "", False


class Llama3JsonParser:
    TAG = "<|python_tag|>"
    kept_tags = ()  # (the calls parse without the tag: it may be dropped)

    def __init__(self) -> None:
        self._buffer = ""
        self._json: bool | None = None  # the output is calls (None: not known yet)

    def feed(self, text: str) -> list[Item]:
        if self._json is False:
            return [text] if text else []
        self._buffer += text
        if self._json:  # calls: held to the end
            return []
        head = self._buffer.lstrip()  # (not known yet: whitespace, or the start of the tag, so far)
        if head:
            if head.startswith(("{", self.TAG)):
                self._json = True
            elif not self.TAG.startswith(head):
                self._json, out, self._buffer = False, [self._buffer], ""
                return out
        return []

    def finish(self) -> list[Item]:
        text, self._buffer = self._buffer, ""
        if self._json:
            calls = self._calls(text)
            if calls is not None:
                return calls
        return [text] if text else []

    def _calls(self, text: str) -> list[ToolCall] | None:
        rest = text.strip()
        rest = rest[len(self.TAG) :].lstrip() if rest.startswith(self.TAG) else rest
        decoder, calls = json.JSONDecoder(), []
        while rest:
            try:
                obj, end = decoder.raw_decode(rest)
            except (ValueError, RecursionError):
                return None
            call = _call(obj)
            if call is None:
                return None
            calls.append(call)
            rest = rest[end:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return None
        return calls or None


class _WholeOutput:
    """An output that is calls only as a whole: held to the end, content if it does not parse."""

    kept_tags = ()

    def __init__(self) -> None:
        self._buffer = ""

    def feed(self, text: str) -> list[Item]:
        self._buffer += text
        return []

    def finish(self) -> list[Item]:
        text, self._buffer = self._buffer, ""
        try:
            calls = self._calls(json.loads(text))
        except (ValueError, RecursionError):
            calls = None
        return calls if calls is not None else [text] if text else []


class RequiredParser(_WholeOutput):
    """``tool_choice`` "required": a JSON list of calls (``required_calls_schema``)."""

    def _calls(self, value: Any) -> list[ToolCall] | None:
        if not isinstance(value, list) or not value:
            return None
        calls = [_call(item) for item in value]
        return None if None in calls else calls


class NamedParser(_WholeOutput):
    """``tool_choice`` naming function ``name``: the output is its arguments (a JSON object)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _calls(self, value: Any) -> list[ToolCall] | None:
        return [ToolCall(self.name, json.dumps(value, ensure_ascii=False))] if isinstance(value, dict) else None


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
# the parsers of the tool_choice values carried out with structured outputs (a named one's takes
# the function's name)
FORCED = {"required": RequiredParser, "named": NamedParser}


def required_calls_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of ``tool_choice`` "required"'s output, as vLLM's: a non-empty list of
    calls, each ``{"name": <one of the functions>, "parameters": <its arguments>}``. Each function
    is a dict with its ``name`` and ``parameters`` (a JSON schema; none: any object). Definitions
    (``$defs``) of the functions' schemas are gathered at the top, where their references point."""
    defs: dict[str, Any] = {}
    options = []
    for fn in functions:
        params = dict(fn.get("parameters") or {"type": "object", "properties": {}})
        own = params.pop("$defs", {})
        if not isinstance(own, dict):
            raise ValueError(f"tools function {fn['name']!r} has $defs {own!r:.40}; allowed: an object")
        for name, schema in own.items():
            if defs.setdefault(name, schema) != schema:
                raise ValueError(f"tools define $defs {name!r} twice, differently; allowed: one schema per name")
        options.append(
            {
                "properties": {"name": {"type": "string", "enum": [fn["name"]]}, "parameters": params},
                "required": ["name", "parameters"],
            }
        )
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    return schema | ({"$defs": defs} if defs else {})


def finish_reason(parser: str, reason: str | None, called: bool) -> str | None:
    """A choice's finish reason once its output, parsed by ``parser``, has (``called``) calls; as
    vLLM and the OpenAI API: ``tool_calls`` for calls found by a parser (also when cut short) and
    for "required" ones when the output ended itself; a named function's call keeps ``stop``."""
    if not called or reason in (None, "abort") or parser == "named":
        return reason
    if parser == "required":
        return "tool_calls" if reason == "stop" else reason
    return "tool_calls"


class ToolCallStream:
    """A choice's output, parsed by parser ``name`` (or one of ``FORCED``, ``function`` naming a
    named one's) as it streams, at most ``max_calls`` calls kept (None: all; later ones are
    dropped, as ``parallel_tool_calls`` false asks)."""

    def __init__(self, name: str, max_calls: int | None = None, function: str | None = None):
        self._parser = NamedParser(function) if name == "named" else (PARSERS | FORCED)[name]()
        self.max_calls = max_calls
        self.calls = 0  # calls handed out so far

    def feed(self, text: str, last: bool = False) -> tuple[str, list[tuple[int, ToolCall]]]:
        """The content and the (index, call)s that the next ``text`` completes; ``last``: the
        output ends with it (all that is held comes out)."""
        items = self._parser.feed(text) if text else []
        if last:
            items += self._parser.finish()
        calls = []
        for call in items:
            if isinstance(call, ToolCall) and (self.max_calls is None or self.calls < self.max_calls):
                calls.append((self.calls, call))
                self.calls += 1
        return "".join(x for x in items if isinstance(x, str)), calls


def parse_tool_calls(
    name: str, text: str, max_calls: int | None = None, function: str | None = None
) -> tuple[str | None, list[ToolCall]]:
    """A whole output's (content, calls): what a stream of it gives, all together. The content is
    None when there are calls and nothing else."""
    content, calls = ToolCallStream(name, max_calls, function).feed(text, last=True)
    return (content or None) if calls else content, [call for _, call in calls]
