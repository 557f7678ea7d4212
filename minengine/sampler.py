"""Sampling: greedy, temperature, top-k, top-p, min-p; per-request seeds are reproducible.

Tokens are drawn with the exponential race (argmax of p / E, E ~ Exp(1)), which samples from p
without normalising it. A request with a seed draws its noise from its own generator, so its
tokens do not depend on what else is in the batch.

Before that, the logits of the requests that ask for it are adjusted as vLLM does, in its order:
``logit_bias``, ``min_tokens`` (its end tokens banned), then the repetition, frequency and
presence penalties. The penalties read a per-request count of its output tokens kept on the device
and updated by each step's sampling, so with overlap scheduling the next step (launched before
this one's tokens reach the host) sees them without a device sync. Which rows are adjusted is
decided on host values, and a batch where no request asks for it pays nothing.
"""

from __future__ import annotations

import itertools

import torch

from minengine.memory.kv_pool import to_device
from minengine.request import Request


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

    def __call__(self, logits: torch.Tensor, reqs: list[Request], greedy: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row of ``logits`` [S, V] (float32), row i for ``reqs[i]``, on the device.
        ``greedy``: each row's argmax, already computed (a CUDA graph's); the rows of requests that
        do not decode greedily are overwritten in it (it is left alone when a row's logits are
        adjusted: the argmax is taken again). Decisions use host values only, so sampling never
        waits for the device."""
        adjusted = [i for i, r in enumerate(reqs) if r.params.adjusts_logits and _adjusts(r)]
        counted = None
        if adjusted:  # new logits: the raw ones stay for logprobs (and a graph's buffer untouched)
            index = to_device(adjusted, torch.int64, logits.device)
            rows_logits, counted = self._adjust(logits.index_select(0, index), [reqs[i] for i in adjusted], adjusted)
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
        if counted is not None:
            self._count(tokens, *counted)
        return tokens

    def _adjust(self, logits: torch.Tensor, reqs: list[Request], rows: list[int]) -> tuple[torch.Tensor, tuple | None]:
        """``logits`` [k, V] of ``reqs`` (a copy: changed in place), rows ``rows`` of the batch,
        adjusted for sampling; and what ``_count`` needs to add the sampled tokens to the penalised
        requests' counts (None: none penalised)."""
        device, vocab = logits.device, logits.shape[-1]
        cells, bias = [], []  # (row, token) pairs
        for j, req in enumerate(reqs):
            for token, b in (req.params.logit_bias or {}).items():
                cells.append((j, token))
                bias.append(b)
        if cells:
            logits.index_put_(_indices(cells, device), to_device(bias, torch.float32, device), accumulate=True)
        banned = []
        for j, req in enumerate(reqs):
            p = req.params
            if req.num_output_sampled <= p.min_tokens:  # (this step's token counts as sampled)
                ends = set(p.stop_token_ids or ()) if p.ignore_eos else self.eos_token_ids.union(p.stop_token_ids or ())
                banned += ((j, t) for t in ends if t < vocab)
        if banned:
            logits.index_put_(_indices(banned, device), logits.new_full((len(banned),), float("-inf")))
        penalised = [j for j, req in enumerate(reqs) if req.params.penalizes]
        if not penalised:
            return logits, None
        preqs = [reqs[j] for j in penalised]
        for req in preqs:
            if req.output_counts is None:
                self._start_counts(req, vocab)
        index = to_device(penalised, torch.int64, device) if len(penalised) < len(reqs) else None
        x = logits if index is None else logits.index_select(0, index)
        counts = torch.stack([req.output_counts for req in preqs])  # [p, V] int32
        seen = counts > 0
        if any(req.params.repetition_penalty != 1 for req in preqs):
            if any(req.prompt_seen is None for req in preqs):
                none = torch.zeros(vocab, dtype=torch.bool, device=device)
            prompt = torch.stack([none if req.prompt_seen is None else req.prompt_seen for req in preqs])
            penalty = torch.where(seen | prompt, column([req.params.repetition_penalty for req in preqs], device), 1.0)
            x = torch.where(x > 0, x / penalty, x * penalty)
        if any(req.params.frequency_penalty != 0 for req in preqs):
            x = x - column([req.params.frequency_penalty for req in preqs], device) * counts
        if any(req.params.presence_penalty != 0 for req in preqs):
            x = x - column([req.params.presence_penalty for req in preqs], device) * seen
        if index is None:
            logits = x
        else:
            logits.index_copy_(0, index, x)
        return logits, (preqs, counts, [rows[j] for j in penalised])

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

    def _count(self, tokens: torch.Tensor, preqs: list[Request], counts: torch.Tensor, rows: list[int]) -> None:
        """Add the tokens sampled for ``preqs`` (rows ``rows`` of ``tokens``) to their counts
        (``counts``: theirs stacked), on the device."""
        if len(rows) < tokens.shape[0]:
            tokens = tokens.index_select(0, to_device(rows, torch.int64, tokens.device))
        counts.scatter_add_(1, tokens[:, None], torch.ones_like(counts[:, :1]))
        torch._foreach_copy_([req.output_counts for req in preqs], list(counts.unbind(0)))


def _indices(cells: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) pairs as ``index_put_``'s indices: the rows and the tokens, on the device."""
    where = to_device(itertools.chain.from_iterable(cells), torch.int64, device, count=2 * len(cells))
    return tuple(where.view(-1, 2).t())


def _adjusts(req: Request) -> bool:
    """Its logits are adjusted in this step (it is being sampled: its token is counted)."""
    p = req.params
    return p.penalizes or bool(p.logit_bias) or req.num_output_sampled <= p.min_tokens


def column(values: list[float], device: torch.device) -> torch.Tensor:
    """Per-row host values as a [rows, 1] float32 column on the device."""
    return to_device(values, torch.float32, device)[:, None]


def filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Softmax(logits / temperature) with top-k, top-p and min-p masks applied (not renormalised).
    Which filters run is decided on the host values of ``params``."""
    device, vocab = logits.device, logits.shape[-1]
    logits = logits / column([p.temperature for p in params], device)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:
        k = to_device(top_k, torch.int64, device)
        kth = logits.sort(-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if any(p.top_p < 1 for p in params):
        sorted_p, order = probs.sort(-1, descending=True)
        # keep the smallest set reaching top_p
        drop = sorted_p.cumsum(-1) - sorted_p > column([p.top_p for p in params], device)
        probs = probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))
    if any(p.min_p > 0 for p in params):
        floor = column([p.min_p for p in params], device) * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs
