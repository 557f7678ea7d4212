"""Tokenizer from a model directory's ``tokenizer.json``, behaving as ``AutoTokenizer`` does.

Encoding adds special tokens through the file's post-processor, as transformers 5 does (it
ignores ``add_bos_token`` / ``add_eos_token`` in ``tokenizer_config.json`` when a
``tokenizer.json`` is present, and so do we). Decoding skips special tokens. The chat template
comes from ``tokenizer_config.json`` (or ``chat_template.jinja``) and is rendered with jinja2
the way transformers renders it; without one, a ChatML template is used.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _token_str(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    def __init__(self, backend: HFTokenizer, special: dict[str, str | None], chat_template: str | None):
        self.backend = backend
        self.bos_token, self.eos_token = special.get("bos_token"), special.get("eos_token")
        self.chat_template = chat_template or DEFAULT_CHAT_TEMPLATE
        self.eos_token_id = backend.token_to_id(self.eos_token) if self.eos_token else None
        # decoding skips these, so a stream of them adds no text
        self.special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self._template = None
        self._token_texts: dict[int, str] = {}

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        backend = HFTokenizer.from_file(str(file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        special = {k: _token_str(cfg.get(k)) for k in ("bos_token", "eos_token")}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        return cls(backend, special, template)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, truncate_left: int | None = None) -> list[int]:
        """``truncate_left``: at most that many tokens, the last ones, as transformers truncates on
        the left (vLLM's ``truncate_prompt_tokens``): the text's tokens are cut first, then the
        special tokens (a BOS) are added, so they stay."""
        if truncate_left is None:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        encoding = self.backend.encode(text, add_special_tokens=False)
        added = self.backend.num_special_tokens_to_add(False) if add_special_tokens else 0
        encoding.truncate(max(truncate_left - added, 0), direction="left")
        return self.backend.post_process(encoding, add_special_tokens=add_special_tokens).ids

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
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """``kwargs``: further template variables (vLLM's ``chat_template_kwargs``, e.g. enable_thinking)."""
        if self._template is None:
            # the environment transformers renders templates in: {% break %} / {% continue %}, a tojson
            # that does not HTML-escape, strftime_now
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = _strftime_now
            env.filters["tojson"] = _tojson
            self._template = env.from_string(self.chat_template)
        # tools and documents as transformers passes them when a request has none
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        context |= {"tools": None, "documents": None, **kwargs}
        return self._template.render(context, messages=messages, add_generation_prompt=add_generation_prompt)

    def render_chat(self, messages: list[dict[str, Any]], chat_template_kwargs: dict[str, Any] | None = None) -> str:
        """A conversation as a prompt: its content parts joined (``chat_messages``), rendered with
        the assistant's turn opened and the caller's template variables (vLLM's
        ``chat_template_kwargs``). ValueError for what the caller got wrong: a part that is not
        text, a variable that would replace ``messages`` or ``add_generation_prompt``, messages
        the template refuses."""
        extra = dict(chat_template_kwargs or {})
        reserved = sorted({"messages", "add_generation_prompt"} & extra.keys())
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved[0]}")
        messages = chat_messages(messages)
        try:
            return self.apply_chat_template(messages, add_generation_prompt=True, **extra)
        except Exception as exc:  # a template may raise on messages it does not accept
            raise ValueError(f"the chat template failed: {exc}") from None


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
    vLLM joins them; ``None`` content is empty. ValueError names a part that is not text."""
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
    return out
