"""Structured outputs (vLLM's ``structured_outputs``, the OpenAI API's ``response_format``): the
output follows a JSON schema, is any JSON object, matches a regular expression, is one of given
strings, or follows an EBNF grammar. Grammars are xgrammar's (vLLM's and SGLang's default
backend), an optional dependency: ``pip install xgrammar``.

How a request is constrained:
- ``StructuredOutputs.check`` parses its grammar without the tokenizer when the request is made,
  so a bad schema, regex or grammar is a ValueError (a 400) that names the field.
- ``Grammars.start`` compiles it for the tokenizer in a background thread from then on (xgrammar
  caches compiled grammars, so a repeated schema compiles once); the request's prefill runs
  meanwhile, all but its last token: the scheduler holds back the token that samples (and a
  decode) until the grammar is compiled (``Matcher.ready``), so one slow grammar never holds a step
  (vLLM keeps such a request out of scheduling).
- Before each of its tokens is sampled, its matcher takes the output tokens it has not seen yet
  (``Request.output_ids`` is the truth: a disaggregated decode server's first token, sampled by
  the prefill server, is taken the same way) and fills the request's row of a bitmask of allowed
  tokens, which the sampler applies to the logits before its other adjustments.
- With overlap scheduling, step N+1 is launched before step N's tokens are read. A step that
  samples a constrained request with a token in N therefore runs its forward at once but samples
  only after N is read (``Engine.step``): the device computes N+1's logits while the host reads N.
  A request whose first token it samples has none in N, and one whose output still reasons needs
  none read: its mask is all tokens, or the grammar's first mask if N's token is its
  ``</think>``, which the device chooses (``apply_grammars``). So a batch with reasoning requests
  keeps overlap on until their grammars start (once compiled: while a grammar compiles, a request
  that reasons samples every other step, ``Matcher.ready``).
- Once the grammar is complete it allows only the end-of-sequence tokens; the request stops when
  one is sampled, also with ``ignore_eos`` (``Engine.stop_reason``).
- After reasoning (``StructuredOutputs.reasoning``, which the chat server sets with
  ``--reasoning-parser``, as vLLM applies a grammar): an output that reasons is free up to its
  ``</think>`` token, and the grammar takes the tokens after it.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from minengine.memory.kv_pool import to_device_packed

logger = logging.getLogger(__name__)

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# where the grammar starts (``StructuredOutputs.reasoning``): after the </think> of a block the
# output starts in ("open"), or that its first token may open ("may_open")
REASONING = ("open", "may_open")
THINK_TAGS = ("<think>", "</think>")
GRAMMAR_CACHE_BYTES = 512 << 20  # compiled grammars kept for reuse (vLLM's default too)
# characters a request's schema, regex, grammar or choices may take together, and the nesting
# depth of a schema: xgrammar's time grows with both (cubically with the depth: 0.02 s at 64, 4.5 s
# at 400), and a request's grammar is compiled in the scheduler process, so they bound what one
# request can make it do
MAX_SOURCE_CHARS = 1 << 16
MAX_SCHEMA_DEPTH = 64


@dataclass(frozen=True)
class StructuredOutputs:
    """vLLM's ``StructuredOutputsParams``: exactly one of ``json`` (a JSON schema, as a dict or
    JSON text), ``regex``, ``choice`` (the output is one of these strings), ``grammar`` (EBNF, as
    xgrammar reads it) and ``json_object`` (any JSON object). ``disable_any_whitespace``: JSON
    without whitespace between its tokens (a schema's and ``json_object``'s).

    ``reasoning``: where the grammar starts, for a model that reasons in a ``<think>`` block (both
    tags single tokens of its tokenizer): None, at the first output token; "open", after the
    ``</think>`` token of the block the output starts in (the prompt opened it; the reasoning is
    free); "may_open", as "open" if the first output token is ``<think>`` (which the grammar then
    allows too), else at the first token. The chat server sets it with ``--reasoning-parser``."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    reasoning: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs gives {' and '.join(given) or 'no constraint'}; allowed: exactly one of "
                + ", ".join(KINDS)
            )
        if isinstance(self.json, dict):  # kept as JSON text: one form to compare, cache and send
            try:
                object.__setattr__(self, "json", json.dumps(self.json, ensure_ascii=False))
            except (TypeError, ValueError, RecursionError):
                raise ValueError("structured_outputs json is not JSON-serializable") from None
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs {name} is {type(value).__name__}; allowed: a string")
        if not any(self.json_object is v for v in (None, True, False)):
            raise ValueError(f"structured_outputs json_object is {self.json_object!r}; allowed: true, false or null")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(f"structured_outputs choice is {self.choice!r:.80}; allowed: a non-empty list of strings")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                f"structured_outputs disable_any_whitespace is {self.disable_any_whitespace!r}; allowed: true or false"
            )
        if self.reasoning is not None and self.reasoning not in REASONING:
            allowed = ", ".join(f'"{r}"' for r in REASONING)
            raise ValueError(f"structured_outputs reasoning is {self.reasoning!r:.40}; allowed: null, {allowed}")
        size = len(self.source)
        if size > MAX_SOURCE_CHARS:
            what = f"structured_outputs {self.kind} has {size} characters"
            raise ValueError(f"{what}; allowed: at most {MAX_SOURCE_CHARS}")
        if self.json is not None:
            depth = _depth(self.json)
            if depth > MAX_SCHEMA_DEPTH:
                raise ValueError(f"structured_outputs json nests {depth} deep; allowed: at most {MAX_SCHEMA_DEPTH}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def source(self) -> str:
        """The constraint as one text: a schema, a regex, or an EBNF grammar (a choice's made here)."""
        if self.kind == "choice":
            return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
        if self.kind == "json_object":  # (as vLLM: any object, not any JSON value)
            return '{"type": "object"}'
        return getattr(self, self.kind)

    @property
    def key(self) -> tuple[str, str, bool]:
        """What its compiled grammar depends on: (how to read ``source``, ``source``, any whitespace)."""
        kind = {"choice": "grammar", "json_object": "json"}.get(self.kind, self.kind)
        return kind, self.source, not self.disable_any_whitespace

    def check(self) -> None:
        """ValueError, naming the field, if the constraint does not compile (checked against an
        empty vocabulary: no tokenizer needed, and compiling it for one cannot fail after this)."""
        _parse(self.kind, *self.key)


def think_ids(tokenizer) -> tuple[int, int] | None:
    """The ids of ``<think>`` and ``</think>`` when both are single tokens of ``tokenizer`` (as in
    Qwen3's and DeepSeek-R1's); None otherwise."""
    ids = tuple(tokenizer.backend.token_to_id(tag) for tag in THINK_TAGS)
    return ids if None not in ids else None


def check_reasoning(spec: StructuredOutputs, tokenizer, vocab_size: int) -> tuple[int, int] | None:
    """``think_ids(tokenizer)`` for a ``spec`` that starts after reasoning (None for one that does
    not); ValueError naming the field if the tokenizer has no such tags, or the model's
    vocabulary (``vocab_size``) not their ids."""
    if spec.reasoning is None:
        return None
    ids = think_ids(tokenizer)
    what = f"structured_outputs reasoning is {spec.reasoning!r}; it needs <think> and </think> as single tokens"
    if ids is None:
        raise ValueError(what + ", which the tokenizer does not have (allowed: null)")
    if max(ids) >= vocab_size:
        raise ValueError(what + f" of the model: their ids {ids} are outside its vocabulary [0, {vocab_size})")
    return ids


def _depth(text: str) -> int:
    """How deep the brackets of JSON text nest (strings skipped)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def xgrammar() -> Any:
    """The xgrammar module; ValueError naming the package when it is not installed."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise ValueError("structured outputs need the xgrammar package (pip install xgrammar)") from None
    return xgr


@lru_cache(maxsize=256)
def _parse(name: str, kind: str, source: str, any_whitespace: bool) -> None:
    """Compile (``kind``, ``source``, ``any_whitespace``); a ValueError naming the request's field
    ``name`` if it does not, or if it is a schema with keywords the grammar would not enforce."""
    try:
        _compile(_empty_compiler(), (kind, source, any_whitespace))
    except (RuntimeError, ValueError, TypeError) as exc:
        what = "json is no JSON schema xgrammar takes" if kind == "json" else f"{name} does not parse"
        raise ValueError(f"structured_outputs {what}: {_first_line(exc)}") from None
    if kind == "json" and (found := unenforced(json.loads(source))) is not None:
        keyword, where = found
        raise ValueError(
            f"structured_outputs json uses {keyword} at {where or '/'}, which minengine cannot enforce "
            "(its output could break it); allowed: schemas without it"
        )


# Keywords xgrammar (0.2.8, measured: a violating value is accepted) compiles without enforcing.
# vLLM refuses some of them the same way with its xgrammar backend.
_IGNORED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies")
_IGNORED += ("contains", "minContains", "maxContains")
# keywords that hold schemas (walked into, below)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("additionalProperties", "unevaluatedProperties", "items", "unevaluatedItems")
# keywords of one type, which xgrammar ignores in a schema whose type it does not know (no
# ``type``, and none of the keywords it infers a type from)
_TYPED = {"minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum"}
_TYPED |= {"exclusiveMaximum", "multipleOf", "minItems", "maxItems", "required", "minProperties", "maxProperties"}
_TYPED |= {"patternProperties", "propertyNames"}
_INFERS_TYPE = {"type", "properties", "additionalProperties", "items", "prefixItems"}
# keywords that constrain the value (the others, annotations and unknown ones, constrain nothing);
# xgrammar reads $ref, allOf, anyOf and oneOf alone, dropping these beside them (a ``type`` beside
# anyOf or oneOf too: kept there, where it only restates the branches' type, as in tool schemas)
_VALIDATION = {*_TYPED, *_INFERS_TYPE, *_IGNORED, *_SCHEMA_LISTS, *_SCHEMA_VALUES, "enum", "const", "$ref"}
_VALIDATION.add("uniqueItems")
_READ_ALONE = {"$ref": set(), "allOf": set(), "anyOf": {"type"}, "oneOf": {"type"}}


def unenforced(schema: Any, where: str = "") -> tuple[str, str] | None:
    """The first (keyword, JSON pointer) in ``schema`` that a grammar compiled from it would not
    enforce (so a constrained output could break the schema); None if there is none."""
    if not isinstance(schema, dict):
        return None
    keys = set(schema)
    for keyword in _IGNORED:
        if keyword in keys:
            return keyword, where
    if schema.get("uniqueItems") is True:
        return "uniqueItems", where
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"$ref {ref!r:.80} (only references into the schema itself are read)", where
    for alone, kept in _READ_ALONE.items():
        if alone in keys and (beside := sorted(keys & _VALIDATION - kept - {alone})):
            return f"{alone} beside {beside[0]} (read alone)", where
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "allOf with more than one schema", where
    typed = sorted(keys & _TYPED)
    if typed and ("enum" in keys or "const" in keys):
        return f"{typed[0]} beside {'enum' if 'enum' in keys else 'const'}", where
    if typed and not keys & _INFERS_TYPE:
        return f"{typed[0]} without a type", where
    if "multipleOf" in keys and schema.get("type") != "integer":
        return "multipleOf on a type other than integer", where
    required, properties = schema.get("required"), schema.get("properties")
    if isinstance(required, list):
        named = properties if isinstance(properties, dict) else {}
        if (missing := next((r for r in required if r not in named), None)) is not None:
            return f"required {missing!r:.40} without a schema in properties", where
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                if (found := unenforced(sub, f"{where}/{key}/{_pointer(name)}")) is not None:
                    return found
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                if (found := unenforced(sub, f"{where}/{key}/{i}")) is not None:
                    return found
    for key in _SCHEMA_VALUES:
        if (found := unenforced(schema.get(key), f"{where}/{key}")) is not None:
            return found
    names = schema.get("propertyNames")  # (a schema of strings: its type goes without saying)
    if isinstance(names, dict):
        return unenforced({"type": "string"} | names, f"{where}/propertyNames")
    return None


def _pointer(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


@lru_cache(maxsize=1)
def _empty_compiler():
    """A compiler over no vocabulary: it checks that a grammar compiles, at little cost."""
    xgr = xgrammar()
    return xgr.GrammarCompiler(xgr.TokenizerInfo([]), max_threads=1, cache_enabled=False)


def _compile(compiler, key: tuple[str, str, bool]):
    kind, source, any_whitespace = key
    if kind == "json":
        return compiler.compile_json_schema(source, any_whitespace=any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(source)
    return compiler.compile_grammar(source)


def _first_line(exc: BaseException) -> str:
    """xgrammar's message without its source location (``[time] file.cc:line: message``)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    head, sep, rest = text.partition(": ")
    return rest if sep and ".cc:" in head else text


class Grammars:
    """Compiles requests' constraints for one tokenizer and model vocabulary, and keeps their
    matchers. Built at the first constrained request (the tokenizer's vocabulary is read then)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int]):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self._compiler = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    def start(self, spec: StructuredOutputs) -> Future:
        """The compiled grammar of ``spec``, compiling in the background. (The first call reads the
        tokenizer's vocabulary here, on the caller's thread: the tokenizer is not shared with the
        compile thread.)"""
        if self._compiler is None:
            self._compiler = self._new_compiler()
        return self._pool.submit(_compile, self._compiler, spec.key)

    def _new_compiler(self):
        xgr = xgrammar()
        from transformers import PreTrainedTokenizerFast  # (xgrammar depends on transformers)

        hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
        return xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=GRAMMAR_CACHE_BYTES)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Matcher:
    """A request's place in its grammar: its compiled grammar (maybe still compiling), where in the
    output the grammar starts (``StructuredOutputs.reasoning``: after the reasoning, when the output
    reasons), and how many output tokens from there the matcher has taken."""

    def __init__(self, compiled: Future, reasoning: str | None = None, think_ids: tuple[int, int] | None = None):
        if reasoning is not None and think_ids is None:
            raise ValueError(f"structured_outputs reasoning {reasoning!r} needs the <think> and </think> token ids")
        self.compiled = compiled  # the compiled grammar (a future)
        self._matcher = None
        self._reasoning, self._think = reasoning, think_ids
        self.start = 0 if reasoning is None else None  # the output index the grammar starts at (None: not known)
        self._scanned = 0  # output tokens looked through for the </think> that ends the reasoning
        self.taken = 0  # output tokens from ``start`` on that the matcher took
        self.broken = False  # a token the grammar does not allow was output: no longer constrained
        self._first: torch.Tensor | None = None  # the grammar's first mask, on the device (``first_mask``)

    def _start(self, output_ids: list[int]) -> int | None:
        """Where the grammar starts in the output: None while the output reasons (its next token is
        free); 0 before the first token of a "may_open" output, which may still open a block."""
        if self.start is not None:
            return self.start
        if self._reasoning == "may_open":
            if not output_ids:
                return 0
            if output_ids[0] != self._think[0]:  # no reasoning: the grammar took the first token
                self.start = 0
                return 0
            self._reasoning, self._scanned = "open", 1
        close = self._think[1]
        while self._scanned < len(output_ids):
            self._scanned += 1
            if output_ids[self._scanned - 1] == close:
                self.start = self._scanned
                return self.start
        return None

    def ready(self, output_ids: list[int], in_flight: bool) -> bool:
        """Its next sampling will not wait for the compilation: the grammar is compiled (or failed),
        or the output reasons and that token is free (the output so far, ``output_ids``, is all
        known: no token ``in_flight`` that may end the reasoning)."""
        if self._matcher is not None or self.broken or self.compiled.done():
            return True
        return not in_flight and self._start(output_ids) is None

    def waits(self, output_ids: list[int], unseen: bool) -> bool:
        """Its next sampling needs the token in flight on the host (``unseen``: the output's last
        token is sampled by the step in flight and not read yet; ``output_ids`` is the output
        without it): its grammar has started, or may have (a "may_open" output's first token), or
        still compiles. Not while the output reasons: the token in flight is then its ``</think>``,
        and the next token takes the grammar's first mask, or it is not, and the next is free; the
        device chooses (``apply_grammars``)."""
        if not unseen or self.broken:
            return False
        return self._start(output_ids) is not None or not self.compiled.done()

    def reasons(self, output_ids: list[int]) -> bool:
        """The output (``output_ids``: all of it that is known) reasons: its next token is free,
        unless the one in flight ends the reasoning."""
        return not self.broken and self._start(output_ids) is None

    def first_mask(self, vocab_size: int, device: torch.device) -> torch.Tensor | None:
        """The tokens its grammar allows first: [ceil(V / 32)] int32 on ``device`` (made once);
        None if the grammar failed to compile (the request goes on unconstrained). Waits for the
        compilation."""
        if self._first is None or self._first.device != device:
            if (matcher := self._grammar()) is None:  # (a reasoning output's: it took no token yet)
                return None
            mask = xgrammar().allocate_token_bitmask(1, vocab_size)
            matcher.fill_next_token_bitmask(mask, 0)
            self._first = mask[0].pin_memory().to(device, non_blocking=True) if device.type == "cuda" else mask[0]
        return self._first

    @property
    def end_id(self) -> int | None:
        """The ``</think>`` id that ends the reasoning (None: the grammar starts at the first token)."""
        return None if self._think is None else self._think[1]

    def also_allowed(self, output_ids: list[int]) -> int | None:
        """A token the next one may be besides the grammar's: ``<think>``, as a "may_open"
        output's first token."""
        return self._think[0] if self._reasoning == "may_open" and not output_ids else None

    def sync(self, output_ids: list[int]) -> Any | None:
        """The matcher, having taken ``output_ids`` from where the grammar starts (waits for the
        compilation); None while the output reasons, and once it has left the grammar (a token it
        does not allow was forced: the request then goes on unconstrained, with a warning; as when
        its grammar failed to compile)."""
        if self.broken or (start := self._start(output_ids)) is None or self._grammar() is None:
            return None
        for token in output_ids[start + self.taken :]:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                logger.warning("structured outputs: output token %d is not allowed by the grammar", token)
                self.broken = True
                return None
            self.taken += 1
        return self._matcher

    def _grammar(self) -> Any | None:
        """Its xgrammar matcher, made at the first call (waits for the compilation); None, and
        ``broken``, if the grammar failed to compile."""
        if self._matcher is None and not self.broken:
            try:
                self._matcher = xgrammar().GrammarMatcher(self.compiled.result())
            except Exception:  # (checked when the request came: not expected; the engine goes on)
                logger.exception("structured outputs: the grammar did not compile; the request goes on without it")
                self.broken = True
        return None if self.broken else self._matcher

    def terminated(self, output_ids: list[int]) -> bool:
        """The grammar is complete and an end token was taken: the output is done. (Only an end
        token completes a grammar: ``Engine.stop_reason`` asks only after one, so a token the
        grammar decides while it compiles never waits for it here.)"""
        matcher = self.sync(output_ids)
        return matcher is not None and matcher.is_terminated()


def allowed_mask(matchers: list[Matcher | None], outputs: list[list[int]], vocab_size: int) -> torch.Tensor | None:
    """[rows, ceil(V / 32)] int32 bitmask (host) of the tokens each row's grammar allows next
    (all, for a row without one or whose output reasons); None if no row is constrained. The rows
    are filled together, on xgrammar's threads (half the host's hardware threads)."""
    rows, filling = [], []
    for row, (m, ids) in enumerate(zip(matchers, outputs, strict=True)):
        matcher = m.sync(ids) if m is not None else None
        if matcher is not None and not matcher.is_terminated():
            rows.append(row)
            filling.append(matcher)
    if not rows:
        return None
    xgr = xgrammar()
    mask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    if len(rows) == 1:
        filling[0].fill_next_token_bitmask(mask, rows[0])
    else:
        _batch_matcher().batch_fill_next_token_bitmask(filling, mask, rows)
    for row in rows:
        if (token := matchers[row].also_allowed(outputs[row])) is not None:
            mask[row, token // 32] |= _bit(token % 32)
    return mask


def apply_grammars(logits: torch.Tensor, reqs: list, token_buffer: torch.Tensor | None = None) -> None:
    """Set ``logits`` [rows, V] (row i for ``reqs[i]``) to -inf where the request's grammar does
    not allow the token next (the bitmask of ``allowed_mask``, filled on the host).

    With overlap scheduling, a request whose output reasons samples with its last token in flight
    (``Request.num_inflight`` counts it and the token being sampled; the step did not wait for it:
    ``Matcher.waits``). Its row is then masked on the device, where that token is
    (``token_buffer`` at the request's slot): by the grammar's first mask if it is ``</think>``,
    else not at all."""
    vocab, device = logits.shape[1], logits.device
    outputs = [r.output_ids for r in reqs]
    mask = allowed_mask([r.matcher for r in reqs], outputs, vocab)
    if mask is not None:
        apply_mask(logits, mask.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else mask)
    ends, firsts = [], []
    for row, r in enumerate(reqs):
        if r.matcher is None or r.num_inflight < 2 or not r.matcher.reasons(outputs[row]):
            continue
        if (first := r.matcher.first_mask(vocab, device)) is not None:
            ends.append(row)
            firsts.append(first)
    if ends:  # (rows ``mask`` left free)
        if token_buffer is None:
            raise RuntimeError("a reasoning request samples with its last token in flight: pass the token buffer")
        rows, slots, closes = to_device_packed(
            [ends, [reqs[i].slot for i in ends], [reqs[i].matcher.end_id for i in ends]], torch.int64, device
        )
        ended = (token_buffer[slots] == closes)[:, None]
        part = logits.index_select(0, rows)
        apply_mask(part, torch.where(ended, torch.stack(firsts), -1))
        logits.index_copy_(0, rows, part)


@lru_cache(maxsize=1)
def _batch_matcher():
    return xgrammar().BatchGrammarMatcher()


def _bit(j: int) -> int:
    """Bit ``j`` of an int32 word as a Python int of that word's sign (bit 31 is negative)."""
    return (1 << j) - (1 << 32) * (j == 31)


def apply_mask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """Set ``logits`` [rows, V] to -inf where bitmask ``mask`` [rows, ceil(V / 32)] (on the same
    device) has a 0 bit."""
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (mask[:, :, None] >> shifts) & 1  # [rows, words, 32], bit j of word w: token 32 w + j
    banned = bits.view(mask.shape[0], -1)[:, : logits.shape[1]] == 0
    logits.masked_fill_(banned, float("-inf"))
