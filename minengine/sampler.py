"""Sampling: greedy, temperature, top-k, top-p, min-p; per-request seeds are reproducible.

Tokens are drawn with the exponential race (argmax of p / E, E ~ Exp(1)), which samples from p
without normalising it. A request with a seed draws its noise from its own generator, so its
tokens do not depend on what else is in the batch.

Before that, the logits of the requests that ask for it are adjusted as vLLM does, in its order:
structured outputs (only the tokens the request's grammar allows next), ``allowed_token_ids``,
``logit_bias``, ``min_tokens`` (its end tokens banned), then the repetition, frequency and
presence penalties. The penalties read a per-request count of its output tokens kept on the device
and updated by each step's sampling, so with overlap scheduling the next step (launched before
this one's tokens reach the host) sees them without a device sync. Which rows are adjusted is
decided on host values, and a batch where no request asks for it pays nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from minengine.memory.kv_pool import to_device
from minengine.request import Request
from minengine.sampling_params import FLOAT32_MAX, GREEDY_TEMPERATURE
from minengine.structured import apply_grammars

# A sampled row's temperature is at least GREEDY_TEMPERATURE: penalised logits within this bound
# stay finite once divided by it. A +inf logit made the softmax NaN everywhere and the race drew
# token 0; a row of allowed tokens all at -inf drew it too.
PENALISED_LOGIT_BOUND = FLOAT32_MAX * GREEDY_TEMPERATURE / 2


class Sampler:
    def __init__(self, device: torch.device, seed: int, eos_token_ids: frozenset[int] = frozenset()):
        self.device = device
        self.generator = torch.Generator(device).manual_seed(seed)
        self.eos_token_ids = frozenset(eos_token_ids)  # banned while ``min_tokens`` is not reached

    def request_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(seed)

    def skip(self, req: Request, vocab_size: int) -> None:
        """Advance a seeded request's generator past one token's draw (a token sampled elsewhere:
        the prefill server of a disaggregated pair), so its later tokens match one server's."""
        if req.generator is not None and not req.params.greedy:
            torch.empty(vocab_size, device=self.device).exponential_(generator=req.generator)

    def __call__(
        self,
        logits: torch.Tensor,
        reqs: list[Request],
        greedy: torch.Tensor | None = None,
        token_buffer: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One token per row of ``logits`` [S, V] (float32), row i for ``reqs[i]``, on the device.
        ``greedy``: each row's argmax, already computed (a CUDA graph's); the rows of requests that
        do not decode greedily are overwritten in it (it is left alone when a row's logits are
        adjusted: the argmax is taken again). ``token_buffer``: each request's last sampled token,
        at its slot (the engine's future map: the structured outputs of reasoning requests read
        it). Decisions use host values only, so sampling never waits for the device."""
        adjusted = [i for i, r in enumerate(reqs) if r.params.adjusts_logits and _adjusts(r)]
        state = None
        if adjusted:  # new logits: the raw ones stay for logprobs (and a graph's buffer untouched)
            index = to_device(adjusted, torch.int64, logits.device)
            rows_logits, state = self._adjust(
                logits.index_select(0, index), [reqs[i] for i in adjusted], adjusted, token_buffer
            )
            logits, greedy = logits.index_copy(0, index, rows_logits), None
        tokens = logits.argmax(-1) if greedy is None else greedy
        rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rows:
            params = [reqs[i].params for i in rows]
            index = to_device(rows, torch.int64, logits.device)
            probs = filtered_probs(logits.index_select(0, index), params)
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            for j, i in enumerate(rows):
                if reqs[i].generator is not None:
                    noise[j].exponential_(generator=reqs[i].generator)
            tokens.index_copy_(0, index, (probs / noise).argmax(-1))
        if state is not None:
            self._record(tokens, state)
        return tokens

    def _adjust(
        self, logits: torch.Tensor, reqs: list[Request], rows: list[int], token_buffer: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, _State | None]:
        """``logits`` [k, V] of ``reqs`` (a copy: changed in place), rows ``rows`` of the batch,
        adjusted for sampling; and the device state ``_record`` adds the sampled tokens to (None:
        no request keeps any)."""
        device, vocab = logits.device, logits.shape[-1]
        if any(req.matcher is not None for req in reqs):  # structured outputs: their grammars' tokens only
            apply_grammars(logits, reqs, token_buffer)
        limited = [j for j, req in enumerate(reqs) if req.params.allowed_token_ids is not None]
        if limited:  # every token but the allowed ones to -inf: one pass over those rows
            for j in limited:
                if reqs[j].allowed_ids is None:
                    reqs[j].allowed_ids = self._token_set(reqs[j].params.allowed_token_ids, vocab)
            where = _flat_cells([reqs[j].allowed_ids for j in limited], limited, vocab)
            kept = logits.view(-1)[where]
            logits.index_fill_(0, to_device(limited, torch.int64, device), float("-inf"))
            logits.view(-1).index_copy_(0, where, kept)
        cells, bias = [], []  # flat (row, token) cells: one per key, so none twice
        for j, req in enumerate(reqs):
            for token, b in (req.params.logit_bias or {}).items():
                cells.append(j * vocab + token)
                bias.append(b)
        if cells:
            _add_at(logits, to_device(cells, torch.int64, device), to_device(bias, torch.float32, device))
        banned, ending, tailed = [], [], []  # flat cells (host), rows under min_tokens, rows with long bad words
        for j, req in enumerate(reqs):
            p = req.params
            if req.num_output_sampled <= p.min_tokens:  # (this step's token counts as sampled)
                if req.end_ids is None:
                    req.end_ids = self._token_set(p.min_tokens_bans(self.eos_token_ids), vocab)
                ending.append(j)
            banned += (j * vocab + ids[0] for ids in req.bad_words_ids if len(ids) == 1)
            if any(len(ids) > 1 for ids in req.bad_words_ids):
                tailed.append(j)
        cells = [_flat_cells([reqs[j].end_ids for j in ending], ending, vocab)] if ending else []
        if banned:
            cells.append(to_device(banned, torch.int64, device))
        if cells:
            logits.view(-1).index_fill_(0, cells[0] if len(cells) == 1 else torch.cat(cells), float("-inf"))
        state = _State()
        if tailed:
            self._ban_word_ends(logits, [reqs[j] for j in tailed], tailed, state)
            state.tailed_rows = [rows[j] for j in tailed]
        penalised = [j for j, req in enumerate(reqs) if req.params.penalizes]
        if penalised:
            logits = self._penalize(logits, [reqs[j] for j in penalised], penalised, state)
            state.counted_rows = [rows[j] for j in penalised]
        return logits, state if tailed or penalised else None

    def _token_set(self, ids, vocab: int) -> torch.Tensor:
        """Token ids on the device, each once, those outside the vocabulary left out (a stop id may
        be; an allowed id is checked when the request is added)."""
        return to_device(sorted({t for t in ids if t < vocab}), torch.int64, self.device)

    def _ban_word_ends(self, logits: torch.Tensor, reqs: list[Request], rows: list[int], state: _State) -> None:
        """For each bad word of two or more tokens of ``reqs`` (rows ``rows`` of ``logits``): its last
        token to -inf where the request's output ends in the tokens before it. Compared on the
        device, with each request's output tail (``Request.output_tail``), which ``_record`` moves on.
        The host work is per request, not per token (each request's word plan is cached)."""
        device = logits.device
        plans = [_word_plan(req.bad_words_ids) for req in reqs]
        for req, plan in zip(reqs, plans, strict=True):
            if req.output_tail is None:
                known = req.output_ids[-plan.width :]  # (a decode server's first token: the prefill server's)
                req.output_tail = to_device([-1] * (plan.width - len(known)) + known, torch.int64, self.device)
        tails = [req.output_tail for req in reqs]
        ends = np.cumsum([plan.width for plan in plans])  # where each tail ends in ``flat``
        firsts = np.cumsum([0] + [len(plan.last) for plan in plans[:-1]])  # each one's first word
        host = np.concatenate(
            [plan.where + end for plan, end in zip(plans, ends, strict=True)]
            + [plan.expected for plan in plans]
            + [plan.word + first for plan, first in zip(plans, firsts, strict=True)]
            # each word's last token, as a flat cell of ``logits``
            + [row * logits.shape[-1] + plan.last for row, plan in zip(rows, plans, strict=True)]
        )
        prefix, words = sum(len(plan.expected) for plan in plans), sum(len(plan.last) for plan in plans)
        where, expected, word_of, end_cells = to_device(host, torch.int64, device).split(
            [prefix, prefix, prefix, words]
        )
        flat = torch.cat(tails)
        differ = torch.zeros(words, dtype=torch.int32, device=device)
        differ.index_add_(0, word_of, (flat[where] != expected).int())
        # added, so that two words ending in one token (one matched, one not) cannot undo each other
        ban = torch.where(differ == 0, float("-inf"), 0.0)
        _add_at(logits, end_cells, ban)
        state.tails, state.flat_tails = tails, flat

    def _penalize(self, logits: torch.Tensor, reqs: list[Request], rows: list[int], state: _State) -> torch.Tensor:
        """The repetition, frequency and presence penalties of ``reqs`` (rows ``rows`` of ``logits``),
        from their output counts on the device."""
        device, vocab = logits.device, logits.shape[-1]
        for req in reqs:
            if req.output_counts is None:
                self._start_counts(req, vocab)
        index = to_device(rows, torch.int64, device) if len(rows) < logits.shape[0] else None
        x = logits if index is None else logits.index_select(0, index)
        counts = torch.stack([req.output_counts for req in reqs])  # [p, V] int32
        seen = counts > 0
        if any(req.params.repetition_penalty != 1 for req in reqs):
            if any(req.prompt_seen is None for req in reqs):
                none = torch.zeros(vocab, dtype=torch.bool, device=device)
            prompt = torch.stack([none if req.prompt_seen is None else req.prompt_seen for req in reqs])
            penalty = torch.where(seen | prompt, column([req.params.repetition_penalty for req in reqs], device), 1.0)
            bound = PENALISED_LOGIT_BOUND  # (a masked -inf stays: it is a ban)
            x = torch.where(x.isfinite(), torch.where(x > 0, x / penalty, x * penalty).clamp(-bound, bound), x)
        if any(req.params.frequency_penalty != 0 for req in reqs):
            x = x - column([req.params.frequency_penalty for req in reqs], device) * counts
        if any(req.params.presence_penalty != 0 for req in reqs):
            x = x - column([req.params.presence_penalty for req in reqs], device) * seen
        state.counted, state.counts = reqs, counts
        if index is None:
            return x
        return logits.index_copy_(0, index, x)

    def _start_counts(self, req: Request, vocab: int) -> None:
        """The request's first token here: count the output it already has (a disaggregated decode
        server's first token, sampled by the prefill server), mark its prompt's tokens."""
        req.output_counts = torch.zeros(vocab, dtype=torch.int32, device=self.device)
        if known := req.output_ids:
            ones = torch.ones(len(known), dtype=torch.int32, device=self.device)
            req.output_counts.index_add_(0, to_device(known, torch.int64, self.device), ones)
        if req.params.repetition_penalty != 1:
            req.prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            req.prompt_seen.index_fill_(0, to_device(req.prompt_ids, torch.int64, self.device), True)

    def _record(self, tokens: torch.Tensor, state: _State) -> None:
        """Add the sampled ``tokens`` to the device state of the requests ``_adjust`` found: the
        penalised ones' counts, and the output tails of those with bad words; on the device."""
        if state.counted_rows:
            mine = _rows(tokens, state.counted_rows)
            state.counts.scatter_add_(1, mine[:, None], torch.ones_like(state.counts[:, :1]))
            torch._foreach_copy_([req.output_counts for req in state.counted], list(state.counts.unbind(0)))
        if state.tailed_rows:
            shift, end = [], state.flat_tails.shape[0]  # each tail without its first token, then the new one
            offset = 0
            for k, tail in enumerate(state.tails):
                shift += range(offset + 1, offset + tail.shape[0])
                shift.append(end + k)
                offset += tail.shape[0]
            moved = torch.cat([state.flat_tails, _rows(tokens, state.tailed_rows)])
            moved = moved.index_select(0, to_device(shift, torch.int64, tokens.device))
            torch._foreach_copy_(state.tails, list(moved.split([t.shape[0] for t in state.tails])))


@dataclass
class _State:
    """What ``Sampler._adjust`` leaves for ``Sampler._record``: of the penalised requests, their
    batch rows and counts stacked; of those with bad words, their batch rows, output tails and those
    concatenated."""

    counted_rows: list[int] = field(default_factory=list)
    counted: list[Request] = field(default_factory=list)
    counts: torch.Tensor | None = None
    tailed_rows: list[int] = field(default_factory=list)
    tails: list[torch.Tensor] = field(default_factory=list)
    flat_tails: torch.Tensor | None = None


@dataclass(frozen=True)
class _WordPlan:
    """A request's bad words of two or more tokens, as ``Sampler._ban_word_ends`` compares them:
    per token before a word's last, its place counted back from the end of the output tail
    (-1: the newest output token), its value and its word (numbered in the request); per word,
    its last token."""

    width: int  # the tail: the longest word's tokens but its last
    where: np.ndarray
    expected: np.ndarray
    word: np.ndarray
    last: np.ndarray


@functools.lru_cache(maxsize=4096)
def _word_plan(words: tuple[tuple[int, ...], ...]) -> _WordPlan:
    """The plan of ``Request.bad_words_ids`` (requests with the same words share it)."""
    longer = [ids for ids in words if len(ids) > 1]
    where = [k - len(ids) + 1 for ids in longer for k in range(len(ids) - 1)]
    expected = [t for ids in longer for t in ids[:-1]]
    word = [w for w, ids in enumerate(longer) for _ in range(len(ids) - 1)]
    arrays = (np.asarray(x, dtype=np.int64) for x in (where, expected, word, [ids[-1] for ids in longer]))
    return _WordPlan(max(map(len, longer)) - 1, *arrays)


def _rows(tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``tokens`` [S] at batch rows ``rows`` (all of it when they are all the rows, in order)."""
    if len(rows) == tokens.shape[0]:  # (rows are in order, each once)
        return tokens
    return tokens.index_select(0, to_device(rows, torch.int64, tokens.device))


def _flat_cells(ids: list[torch.Tensor], rows: list[int], vocab: int) -> torch.Tensor:
    """Token ids of several rows (a device tensor each) as flat cells ``row * vocab + id``: a few
    kernels, however many rows (sizes are known on the host: no sync)."""
    if len(ids) == 1:
        return ids[0] + rows[0] * vocab
    sizes = [t.numel() for t in ids]
    device = ids[0].device
    starts = to_device([row * vocab for row in rows], torch.int64, device)
    offsets = torch.repeat_interleave(starts, to_device(sizes, torch.int64, device), output_size=sum(sizes))
    return torch.cat(ids) + offsets


def _add_at(logits: torch.Tensor, cells: torch.Tensor, values: torch.Tensor) -> None:
    """Add ``values`` to ``logits``' flat ``cells`` (``row * V + token``; a cell may repeat).
    ``index_add_``, not ``index_put_(accumulate=True)``: on CUDA, torch versions that range-check
    the latter's indices on the host (``max().item()``) would wait for the device each step."""
    logits.view(-1).index_add_(0, cells, values)


def _adjusts(req: Request) -> bool:
    """Its logits are adjusted in this step (it is being sampled: its token is counted). Not once
    it has finished (a step sampled after the step that finished it: its token is dropped, and the
    state it dropped at its end is not made again)."""
    p = req.params
    return not req.finished and (
        (req.matcher is not None and not req.matcher.broken)
        or p.penalizes
        or bool(p.logit_bias)
        or p.allowed_token_ids is not None
        or bool(req.bad_words_ids)
        or req.num_output_sampled <= p.min_tokens
    )


def column(values: list[float], device: torch.device) -> torch.Tensor:
    """Per-row host values as a [rows, 1] float32 column on the device."""
    return to_device(values, torch.float32, device)[:, None]


def filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Softmax(logits / temperature) with top-k, min-p and top-p masks applied, as vLLM applies
    them: min-p (a ratio to the top token's probability, so it commutes with top-k) before top-p,
    whose mass is a share of what top-k and min-p kept (the result is not renormalised). Which
    filters run is decided on the host values of ``params``."""
    device, vocab = logits.device, logits.shape[-1]
    logits = logits / column([p.temperature for p in params], device)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:
        k = to_device(top_k, torch.int64, device)
        kth = logits.sort(-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    kept = None  # the mass min-p kept (rows without min-p: 1 up to rounding)
    if any(p.min_p > 0 for p in params):
        floor = column([p.min_p for p in params], device) * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        kept = probs.sum(-1, keepdim=True)
    if any(p.top_p < 1 for p in params):
        top_p = column([p.top_p for p in params], device)
        sorted_p, order = probs.sort(-1, descending=True)
        # keep the smallest set reaching top_p (of what min-p kept)
        drop = sorted_p.cumsum(-1) - sorted_p > (top_p if kept is None else top_p * kept)
        probs = probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))
    return probs
