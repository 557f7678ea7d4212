"""Tokenizer from a model directory's ``tokenizer.json``, behaving as ``AutoTokenizer`` does.

Encoding adds special tokens through the file's post-processor, as transformers 5 does (it
ignores ``add_bos_token`` / ``add_eos_token`` in ``tokenizer_config.json`` when a
``tokenizer.json`` is present, and so do we). Decoding skips special tokens. The chat template
comes from ``chat_template.jinja`` (or, without that file, ``tokenizer_config.json``), as
transformers takes it, and is rendered with jinja2 the way transformers renders it, the special
tokens as variables; without one, a ChatML template is used. Special tokens missing from
``tokenizer_config.json`` are read from ``special_tokens_map.json``, as transformers reads them.
A Llama tokenizer converted from SentencePiece (Llama 2's) gets the normalizer, pre-tokenizer
and decoder transformers 5's ``LlamaTokenizer`` builds in place of the file's (``_as_llama``).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, pre_tokenizers

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# the special tokens transformers passes a chat template by name
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_str(value: Any) -> str | None:
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def _json_file(file: Path) -> dict[str, Any]:
    return json.loads(file.read_text()) if file.is_file() else {}


def _as_llama(cfg: dict[str, Any], path: Path, text: str) -> bool:
    """Whether transformers 5 loads this tokenizer as its ``LlamaTokenizer``: the class the config
    names, for a Llama model (or a directory without a model config: another model type brings its
    own class), and a file that is not byte-level (Llama 3's, which it loads as it is)."""
    if str(cfg.get("tokenizer_class") or "").removesuffix("Fast") != "LlamaTokenizer":
        return False
    try:
        model_type = _json_file(path / "config.json").get("model_type")
    except ValueError:  # (not the tokenizer's to report: the model's loading names the file)
        model_type = None
    return model_type in (None, "llama") and '"ByteLevel"' not in text  # (tokenizer.json's text)


def _llama_pipeline(backend: HFTokenizer, cfg: dict[str, Any]) -> None:
    """transformers 5's ``LlamaTokenizer``: the file's vocabulary, merges, added tokens and
    post-processor, with no normalizer, a Metaspace pre-tokenizer that adds the leading "▁" to the
    first piece only ("first"; every piece, as SentencePiece does, with ``legacy``; none without
    ``add_prefix_space``), and the decoder that matches it."""
    prefix = cfg.get("add_prefix_space")
    prefix = True if prefix is None else bool(prefix)
    scheme = ("always" if cfg.get("legacy", False) else "first") if prefix else "never"
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))


LONG_TEXT = 16384  # characters: ``Tokenizer._encoding`` hands a text this long to ``encode_batch``


def _check_unicode(text: str) -> None:
    """ValueError for a text that is no valid Unicode (an unpaired surrogate), naming where."""
    if isinstance(text, str) and not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            at = exc.start
            raise ValueError(
                f"{text[at]!r} at character {at} is an unpaired surrogate; allowed: valid Unicode text"
            ) from None


class Tokenizer:
    def __init__(self, backend: HFTokenizer, special: dict[str, str | None], chat_template: str | None):
        self.backend = backend
        self.special_tokens = {k: v for k, v in special.items() if v is not None}
        self.bos_token, self.eos_token = special.get("bos_token"), special.get("eos_token")
        self.chat_template = chat_template or DEFAULT_CHAT_TEMPLATE
        self.eos_token_id = backend.token_to_id(self.eos_token) if self.eos_token else None
        # decoding skips these, so a stream of them adds no text
        self.special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self._token_texts: dict[int, str] = {}
        self._ends: tuple[list[int], list[int]] | None | bool = False  # _special_ends', once found
        self._compiled: tuple[str, jinja2.Template] | None = None  # chat_template, compiled

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        text = file.read_text(encoding="utf-8")
        backend = HFTokenizer.from_str(text)
        cfg = _json_file(path / "tokenizer_config.json")
        if _as_llama(cfg, path, text):
            _llama_pipeline(backend, cfg)
        older = _json_file(path / "special_tokens_map.json")  # (an older checkpoint's only record of them)
        special = {k: _token_str(cfg.get(k)) or _token_str(older.get(k)) for k in SPECIAL_TOKENS}
        if (path / "chat_template.jinja").is_file():  # the file comes first, as in transformers
            template = (path / "chat_template.jinja").read_text()
        else:
            template = cfg.get("chat_template")
            if isinstance(template, list):  # named templates: take the default one
                named = (t["template"] for t in template if t.get("name") == "default")
                template = next(named, template[0]["template"])
        return cls(backend, special, template)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, truncate_left: int | None = None) -> list[int]:
        """``truncate_left``: at most that many tokens, the last ones, as transformers truncates on
        the left (vLLM's ``truncate_prompt_tokens``): the text's tokens are cut first, then the
        special tokens (a BOS) are added, so they stay. ValueError for a text that is no valid
        Unicode (an unpaired surrogate)."""
        if truncate_left is not None:
            return self.encode_truncated(text, truncate_left, add_special_tokens)[0]
        _check_unicode(text)
        return self._encoding(text, add_special_tokens).ids

    def encode_truncated(self, text: str, keep: int, add_special_tokens: bool = True) -> tuple[list[int], bool]:
        """``encode(text, add_special_tokens, truncate_left=keep)`` in one pass over the text, and
        whether it cut any of it."""
        _check_unicode(text)
        encoding = self._encoding(text, False)
        ends = self._special_ends() if add_special_tokens else ([], [])
        added = len(ends[0]) + len(ends[1]) if ends is not None else self.backend.num_special_tokens_to_add(False)
        cut = len(encoding) + added > keep
        if cut and ends is not None:  # the text's last tokens between the special ones
            tail = max(keep - added, 0)
            return ends[0] + (encoding.ids[-tail:] if tail else []) + ends[1], True
        if cut:  # (Encoding.truncate keeps what it cuts as pieces that post_process goes over:
            encoding.truncate(max(keep - added, 0), direction="left")  # 11 s for a 12 MB text)
        return self.backend.post_process(encoding, add_special_tokens=add_special_tokens).ids, cut

    def _special_ends(self) -> tuple[list[int], list[int]] | None:
        """The special tokens the backend's post-processor puts before and after a text's own (a
        BOS; an EOS), found once on a probe text; None if it does more than add them."""
        if self._ends is False:
            probe = self.backend.encode("a b", add_special_tokens=False)
            own, full = probe.ids, self.backend.post_process(probe, add_special_tokens=True).ids
            at = next((i for i in range(len(full) - len(own) + 1) if full[i : i + len(own)] == own), None)
            self._ends = None if not own or at is None else (full[:at], full[at + len(own) :])
        return self._ends

    def _encoding(self, text: str, add_special_tokens: bool):
        """The backend's encoding of ``text``; a long text through ``encode_batch``, which lets go
        of the GIL while it works (``encode`` holds it: a server's event loop, with the tokenizing
        in another thread, stood still for the 2.4 s a 3.6 MB text took)."""
        if len(text) < LONG_TEXT:
            return self.backend.encode(text, add_special_tokens=add_special_tokens)
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text on its own, special tokens included (for logprobs); a piece of a
        multi-byte character decodes to U+FFFD, as in vLLM."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.backend.decode([token_id], skip_special_tokens=False)
        return text

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """transformers' ``apply_chat_template(..., tokenize=False)``: ``continue_final_message``
        ends the prompt inside the last message (its closing tokens cut), for the model to go on
        with it; ``chat_template``: a template to use instead of the checkpoint's; ``kwargs``:
        further template variables (vLLM's ``chat_template_kwargs``, e.g. enable_thinking)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if chat_template is not None:
            template = compile_chat_template(chat_template)
        else:  # the tokenizer's own, compiled once (kept out of the cache of other templates)
            if self._compiled is None or self._compiled[0] is not self.chat_template:
                self._compiled = (self.chat_template, _compile(self.chat_template))
            template = self._compiled[1]
        if continue_final_message:
            messages, final = _tag_final_message(messages)
        # tools and documents as transformers passes them when a request has none
        context = {"bos_token": "", "eos_token": "", **self.special_tokens}
        context |= {"tools": None, "documents": None, **kwargs}
        text = template.render(context, messages=messages, add_generation_prompt=add_generation_prompt)
        if continue_final_message:
            text = _cut_at_tag(text, final)
        return text

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
    ) -> str:
        """A conversation as a prompt: its content parts joined (``chat_messages``), rendered with
        the assistant's turn opened (``add_generation_prompt``; None: unless
        ``continue_final_message``), by ``chat_template`` (None: the checkpoint's), with the
        caller's template variables (vLLM's ``chat_template_kwargs``). ValueError for what the
        caller got wrong, its message starting with the field's name where it is one of these
        (``messages`` otherwise): a part that is not text, a variable that would replace one of
        the arguments, a template that does not parse, messages the template refuses."""
        extra = dict(chat_template_kwargs or {})
        reserved = [k for k in ("messages", *CHAT_ARGUMENTS) if k in extra]
        if reserved:
            own = "" if reserved[0] == "messages" else f"; it is a field of its own: set {reserved[0]} itself"
            raise ValueError(f"chat_template_kwargs may not set {reserved[0]}{own}")
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if chat_template is not None:
            if not chat_template:
                raise ValueError("chat_template is empty; allowed: a Jinja template, or null for the model's")
            try:
                compile_chat_template(chat_template)
            except Exception as exc:  # a TemplateSyntaxError; a SyntaxError or RecursionError when nested deep
                raise ValueError(f"chat_template does not parse as a Jinja template: {_why(exc)}") from None
        messages = chat_messages(messages)
        try:
            return self.apply_chat_template(
                messages, add_generation_prompt, continue_final_message, chat_template, **extra
            )
        except FinalMessageError:
            raise
        except Exception as exc:  # a template may raise on messages it does not accept
            whose = "the chat template" if chat_template is None else "chat_template"
            raise ValueError(f"{whose} failed on these messages: {_why(exc)}") from None


# render_chat's arguments, which chat_template_kwargs may not set
CHAT_ARGUMENTS = ("add_generation_prompt", "continue_final_message", "chat_template")


class FinalMessageError(ValueError):
    """continue_final_message cannot be done: no text to continue, or the template drops it."""


def _tag_final_message(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """(``messages`` with a tag after the last message's text, that text): as transformers marks
    where the prompt of ``continue_final_message`` ends (a list content: its last text part)."""
    last = dict(messages[-1]) if messages else {}
    content = last.get("content")
    if isinstance(content, str):
        last["content"] = content + _CONTINUE_TAG
        return [*messages[:-1], last], content
    if isinstance(content, list):
        for i in reversed(range(len(content))):
            part = content[i]
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                last["content"] = [*content[:i], {**part, "text": part["text"] + _CONTINUE_TAG}, *content[i + 1 :]]
                return [*messages[:-1], last], part["text"]
    raise FinalMessageError("continue_final_message is true, but the final message has no text to continue")


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _cut_at_tag(text: str, final: str) -> str:
    """A rendered conversation cut where ``_tag_final_message``'s tag is (and where the template
    trimmed the tag's space, the message's trailing spaces cut too), as transformers cuts it."""
    if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise FinalMessageError("continue_final_message is true, but the template drops part of the final message")
    at = text.rindex(_CONTINUE_TAG.strip())
    return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def _why(exc: BaseException) -> str:
    """An exception as an error message's end: its text, or its kind when it has none."""
    return str(exc) or type(exc).__name__


@functools.lru_cache(maxsize=8)  # a few of the requests' own templates
def compile_chat_template(source: str) -> jinja2.Template:
    """``_compile``, cached."""
    return _compile(source)


def _compile(source: str) -> jinja2.Template:
    """``source`` compiled in the environment transformers renders templates in: sandboxed,
    {% break %} / {% continue %}, a tojson that does not HTML-escape, strftime_now and
    raise_exception. jinja2.TemplateSyntaxError when it does not parse (a SyntaxError or a
    RecursionError when it nests too deep for Python)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def load_chat_template(value: str) -> str:
    """vLLM's ``--chat-template``: a file's path, or the template itself (text with a brace or a
    newline in it), whose backslash escapes (``\\n``) are decoded as vLLM decodes them.
    ValueError for anything else, or a template that does not parse."""
    try:
        is_file = Path(value).is_file()
    except (OSError, ValueError):  # a name too long for the file system, a NUL: no file's
        is_file = False
    if is_file:
        try:
            value = Path(value).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{value!r} cannot be read: {exc}") from None
    elif not any(c in value for c in "{}\n"):
        raise ValueError(f"{value!r:.80} is no file, nor a template (no braces or newlines in it)")
    else:  # (characters past Latin-1 go through as escapes of their own)
        try:
            value = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
        except UnicodeDecodeError as exc:  # a broken escape: "\\x4"
            raise ValueError(f"the template has a broken backslash escape: {exc}") from None
    try:
        _compile(value)
    except Exception as exc:
        raise ValueError(f"the template does not parse: {_why(exc)}") from None
    return value


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the chat template sees them: content parts (text only) joined by newlines, as
    vLLM joins them; ``None`` content is empty; tool calls' arguments decoded; ``reasoning`` also
    as ``reasoning_content`` and the other way round. ValueError names a part that is not text,
    or arguments that are not JSON."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                where = f"messages.{i}.content.{j}"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f'{where}.type is {json.dumps(kind)}; allowed: "text" (a text-only model)')
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"{where}.text is missing or not a string")
                texts.append(part["text"])
            content = "\n".join(texts)
        out.append({**m, "content": content or ""})
        # an answer's reasoning, sent back: under both of its names (as vLLM; Qwen3's templates
        # read reasoning_content, the API's answers carry reasoning)
        for name, other in (("reasoning", "reasoning_content"), ("reasoning_content", "reasoning")):
            if isinstance(m.get(name), str) and other not in m:
                out[-1][other] = m[name]
        if isinstance(m.get("tool_calls"), list):
            out[-1]["tool_calls"] = [
                _decoded_arguments(call, f"messages.{i}.tool_calls.{j}") for j, call in enumerate(m["tool_calls"])
            ]
    return out


def _decoded_arguments(call: Any, where: str) -> Any:
    """An earlier tool call of the conversation with its ``function.arguments`` (JSON text, as
    the API carries them) decoded, as vLLM hands them to the template (templates expect a
    mapping; none or empty: ``{}``). ValueError names arguments that are no JSON."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments", ""), str | None):
        return call
    if not function.get("arguments"):  # none, null or "": a call without arguments (as vLLM reads it)
        return {**call, "function": {**function, "arguments": {}}}
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{where}.function.arguments is not JSON: {_why(exc)}") from None
    return {**call, "function": {**function, "arguments": arguments}}
