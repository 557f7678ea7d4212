"""Output- and prompt-token logprobs in the shapes users read them: vLLM's offline ``Logprob``
dicts, the completions API's ``logprobs`` object (with ``echo``, the prompt's tokens first), the
chat API's ``logprobs.content`` list, and vLLM's ``prompt_logprobs``.

The engine hands out one ``TokenLogprobs`` per output token, and per prompt token from the second
on (``minengine.request``): the token's logprob and rank, and the top-k tokens' ids and
logprobs, most likely first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from minengine.request import TokenLogprobs
from minengine.tokenizer import Tokenizer

# JSON has no -inf: the APIs report a token the model rules out with this floor (as vLLM)
JSON_FLOOR = -9999.0


@dataclass(frozen=True)
class Logprob:
    """vLLM's ``Logprob``: a token's log-probability, its rank in the vocabulary (1: the most
    likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def offline(ids: list[int], entries: list[TokenLogprobs], tokenizer: Tokenizer) -> list[dict[int, Logprob]]:
    """vLLM's ``CompletionOutput.logprobs``: per output token, {token id: Logprob}, the sampled
    token first, then the top tokens (one entry when the sampled token is one of them)."""
    out = []
    for token, (lp, rank, top_ids, top_lps) in zip(ids, entries, strict=True):
        step = {token: Logprob(lp, rank, tokenizer.token_text(token))}
        for r, (t, v) in enumerate(zip(top_ids, top_lps, strict=True), start=1):
            if t not in step:
                step[t] = Logprob(v, r, tokenizer.token_text(t))
        out.append(step)
    return out


def output_logprobs(
    ids: list[int], entries: list[TokenLogprobs] | None, tokenizer: Tokenizer
) -> tuple[list[dict[int, Logprob]] | None, float | None]:
    """``CompletionOutput``'s (logprobs, cumulative_logprob): the ``offline`` dicts and the sampled
    tokens' summed logprob; (None, None) for an output that did not ask for them."""
    if entries is None:
        return None, None
    return offline(ids, entries, tokenizer), sum(e[0] for e in entries)


def prompt_offline(
    prompt_ids: list[int], entries: list[TokenLogprobs] | None, tokenizer: Tokenizer
) -> list[dict[int, Logprob] | None] | None:
    """vLLM's ``RequestOutput.prompt_logprobs``: None for the first prompt token (nothing comes
    before it), then ``offline``'s dict per prompt token; None when the request did not ask."""
    if entries is None:
        return None
    return [None, *offline(prompt_ids[1:], entries, tokenizer)]


def prompt_json(prompt_ids: list[int], entries: list[TokenLogprobs], tokenizer: Tokenizer) -> list[dict | None]:
    """The APIs' ``prompt_logprobs`` (vLLM's): ``prompt_offline`` as JSON, each {token id:
    {"logprob", "rank", "decoded_token"}}, floored as JSON needs."""
    return [
        None if step is None else {t: {**vars(lp), "logprob": _floor(lp.logprob)} for t, lp in step.items()}
        for step in prompt_offline(prompt_ids, entries, tokenizer)
    ]


def _floor(value: float) -> float:
    """The value as JSON can carry it: -inf (and NaN, from a model whose logits overflowed) as
    the floor; JSON has neither."""
    return value if value >= JSON_FLOOR else JSON_FLOOR


def _namer(tokenizer: Tokenizer, as_ids: bool) -> Callable[[int], str]:
    """How the APIs name a token: its text, or (vLLM's ``return_tokens_as_token_ids``, for
    tokens whose text is no valid UTF-8 on its own) "token_id:<id>"."""
    return (lambda token: f"token_id:{token}") if as_ids else tokenizer.token_text


def completion(
    ids: list[int],
    entries: list[TokenLogprobs | None],
    tokenizer: Tokenizer,
    text_offset: int = 0,
    as_ids: bool = False,
) -> dict[str, Any]:
    """The completions API's ``logprobs`` for ``ids``: each token's text, logprob, {text: logprob}
    of the sampled and the top tokens, and character offset (the first at ``text_offset``). An
    entry None (an echoed prompt's first token) has null logprobs, as in vLLM. ``as_ids``: tokens
    named by ``_namer`` (offsets count those names, as vLLM's do)."""
    name = _namer(tokenizer, as_ids)
    tokens, token_lps, tops, offsets = [], [], [], []
    for token, entry in zip(ids, entries, strict=True):
        text = name(token)
        tokens.append(text)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
        else:
            lp, _, top_ids, top_lps = entry
            token_lps.append(_floor(lp))
            top = {text: _floor(lp)}
            for t, v in zip(top_ids, top_lps, strict=True):
                top.setdefault(name(t), _floor(v))
            tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat(
    ids: list[int], entries: list[TokenLogprobs], tokenizer: Tokenizer, as_ids: bool = False
) -> list[dict[str, Any]]:
    """The chat API's ``logprobs.content``: per token its text, logprob and UTF-8 bytes, and the
    top tokens' (``top_logprobs`` of them, most likely first); ``as_ids``: as ``completion``'s,
    where (as vLLM) a sampled token's bytes stay its text's, a top token's are its name's."""
    name = _namer(tokenizer, as_ids)

    def item(token: int, lp: float, text: str) -> dict[str, Any]:
        return {"token": name(token), "logprob": _floor(lp), "bytes": list(text.encode("utf-8", "surrogatepass"))}

    content = []
    for token, (lp, _, top_ids, top_lps) in zip(ids, entries, strict=True):
        top = [item(t, v, name(t)) for t, v in zip(top_ids, top_lps, strict=True)]
        content.append({**item(token, lp, tokenizer.token_text(token)), "top_logprobs": top})
    return content
