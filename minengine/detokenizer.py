"""Incremental detokenization with stop strings: the one place output text is made.

Text grows as tokens arrive, decoded over a short window (not the whole output each time) and
only at complete characters (a trailing U+FFFD means a multi-byte character is still arriving).
Special tokens (which decoding skips, unless ``skip_special_tokens`` is False) never enter the
window, and a long run of invalid bytes,
whose U+FFFD never completes, is committed a few tokens behind the newest once its text is
stable, so the window stays short and the work per token bounded whatever the model emits.
With stop strings, the last ``max(len(stop)) - 1`` characters are held back, so no piece of a
stop string is ever handed out; when one appears, the text is cut before it (after it with
``include_stop``, vLLM's ``include_stop_str_in_output``). As in vLLM, no stop string ends in the
text of the first ``min_tokens`` output tokens (one may begin there and end after it).
"""

from __future__ import annotations

import functools
import itertools

from minengine.sampling_params import SamplingParams
from minengine.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"
# tokens not yet in the text before a stable part of them is committed anyway, all but the newest
# _KEEP (a UTF-8 character has at most 4 bytes). Large enough that only a run of invalid bytes
# ever gets here, so the text is a full decode's except with a byte-fallback tokenizer (it turns
# every byte of a run of byte tokens into U+FFFD once any is invalid): after such a run of over
# _PENDING tokens, its valid bytes may show as themselves
_PENDING = 64
_KEEP = 4
# prompt tokens decoded ahead of the output as its context (as vLLM primes its DecodeStream): a
# SentencePiece-style decoder strips the leading space of the first token it decodes, so without
# them the output's first word would lose its space
_CONTEXT_MIN, _CONTEXT_MAX = 4, 24


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: tuple[str, ...] = (),
        prompt_ids: list[int] = (),
        include_stop: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self._decode_ids = functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.num_output = 0  # output tokens taken (special ones too)
        self._protected = 0  # the text of the first min_tokens output tokens: no stop string ends in it
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = self._context(prompt_ids)  # the prompt's tail, then the output
        self.text = ""  # complete characters decoded so far (cut at a stop string)
        self.emitted = 0  # characters of text already handed out
        self.stopped = False  # a stop string was found
        self.stop_string: str | None = None  # which one
        self._prefix_offset = 0  # the decode window is ids[prefix_offset:]
        self._read_offset = len(self.ids)  # ids before this are in text (or are the prompt's)

    @classmethod
    def for_request(cls, tokenizer: Tokenizer, params: SamplingParams, prompt_ids: list[int]) -> IncrementalDetokenizer:
        return cls(
            tokenizer,
            params.stop_strings,
            prompt_ids,
            params.include_stop_str_in_output,
            params.min_tokens,
            params.skip_special_tokens,
        )

    def _context(self, prompt_ids: list[int]) -> list[int]:
        """The shortest tail of the prompt (at least _CONTEXT_MIN tokens where it has them) that
        decodes to complete characters; none if no short tail does."""
        special = self.tokenizer.special_ids
        tail = (t for t in reversed(prompt_ids) if t not in special)  # a prompt can be long: its end only
        ids = list(itertools.islice(tail, _CONTEXT_MAX))[::-1]
        for n in range(min(_CONTEXT_MIN, len(ids)), min(_CONTEXT_MAX, len(ids)) + 1):
            if n and _INCOMPLETE not in self.tokenizer.decode(ids[-n:]):
                return ids[-n:]
        return []

    def add(self, token_ids: list[int]) -> str:
        """Take new output tokens; returns the text that is now safe to hand out."""
        if self.stopped:
            return ""
        if self.num_output < self.min_tokens and len(token_ids) > 1:
            # one at a time up to the min_tokens-th: the text each has made bounds the stop search
            # (as vLLM decodes them), also when a character spans tokens
            short = self.min_tokens - self.num_output
            return "".join(self.add([t]) for t in token_ids[:short]) + self.add(token_ids[short:])
        self.num_output += len(token_ids)
        if self.skip_special:
            special = self.tokenizer.special_ids
            self.ids += [t for t in token_ids if t not in special]
        else:
            self.ids += token_ids
        self._decode(final=False)
        return self._emit(final=False)

    def finish(self) -> str:
        """The rest of the text at the end of the request (incomplete characters included)."""
        if not self.stopped:
            self._decode(final=True)
        return self._emit(final=True)

    def _decode(self, final: bool) -> None:
        decode = self._decode_ids
        prefix = decode(self.ids[self._prefix_offset : self._read_offset])
        window = decode(self.ids[self._prefix_offset :])
        if len(window) > len(prefix) and (final or not window.endswith(_INCOMPLETE)):
            self._commit(window[len(prefix) :], len(self.ids))
        elif len(self.ids) - self._read_offset > _PENDING:
            # the window still ends in U+FFFD: invalid bytes, which no later byte completes. The
            # text of all but the newest tokens is final once the window's text goes past it.
            upto = len(self.ids) - _KEEP
            head = decode(self.ids[self._prefix_offset : upto])
            if len(prefix) < len(head) < len(window) and window.startswith(head):
                self._commit(head[len(prefix) :], upto)
        if self.num_output <= self.min_tokens:
            self._protected = len(self.text)
        if self.stop:
            # from the text not searched yet; a match must end past the protected text
            starts = [(s, max(self.emitted, self._protected + 1 - len(s))) for s in self.stop]
            found = [(i, s) for s, start in starts if (i := self.text.find(s, start)) >= 0]
            if found:
                cut, self.stop_string = min(found, key=lambda f: f[0])  # the first to appear
                if self.include_stop:
                    cut += len(self.stop_string)
                self.text, self.stopped = self.text[:cut], True

    def _commit(self, text: str, upto: int) -> None:
        self.text += text
        self._prefix_offset, self._read_offset = self._read_offset, upto

    def _emit(self, final: bool) -> str:
        limit = len(self.text) if final or self.stopped else len(self.text) - self.hold
        if limit <= self.emitted:
            return ""
        piece, self.emitted = self.text[self.emitted : limit], limit
        return piece


def stop_reason(
    finish_reason: str | None,
    detok: IncrementalDetokenizer | None,
    last_token: int | None,
    params: SamplingParams,
    eos_token_id: int | None,
    end_token_ids: frozenset[int] = frozenset(),
) -> str | int | None:
    """What vLLM reports as ``stop_reason``: for finish_reason "stop", the stop string or stop
    token id that ended the output; None for the tokenizer's end-of-sequence token
    (``eos_token_id``: None also when ``stop_token_ids`` lists it, as vLLM checks it first, unless
    ``ignore_eos``) and any other ending. The other end tokens the engine stops on
    (``end_token_ids``: the model's config.json and generation_config.json ``eos_token_id``, e.g.
    Qwen's ``<|im_end|>``) count as stop token ids, as vLLM adds generation_config.json's (less
    the tokenizer's EOS) to a request's ``stop_token_ids``."""
    if finish_reason != "stop":
        return None
    if detok is not None and detok.stopped:
        return detok.stop_string
    if last_token == eos_token_id and not params.ignore_eos:
        return None
    if last_token in end_token_ids and not params.ignore_eos:
        return last_token
    return last_token if last_token in (params.stop_token_ids or ()) else None
