"""Sampling: greedy, temperature, top-k, top-p, min-p; per-request seeds are reproducible.

Tokens are drawn with the exponential race (argmax of p / E, E ~ Exp(1)), which samples from p
without normalising it. A request with a seed draws its noise from its own generator, so its
tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from minengine.request import Request


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device).manual_seed(seed)

    def request_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """One token per row of ``logits`` [S, V] (float32), row i for ``reqs[i]``, on the device
        (no host sync)."""
        tokens = logits.argmax(-1)
        rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rows:
            params = [reqs[i].params for i in rows]
            probs = filtered_probs(logits[rows], params)
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            for j, i in enumerate(rows):
                if reqs[i].generator is not None:
                    noise[j].exponential_(generator=reqs[i].generator)
            tokens[rows] = (probs / noise).argmax(-1)
        return tokens


def filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Softmax(logits / temperature) with top-k, top-p and min-p masks applied (not renormalised)."""
    device, vocab = logits.device, logits.shape[-1]
    temp = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temp[:, None]
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    if min(top_k) < vocab:
        k = torch.tensor(top_k, device=device).clamp(max=vocab)
        kth = logits.sort(-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    if (top_p < 1).any():
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p[:, None]  # keeps the smallest set reaching top_p
        probs = probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))
    min_p = torch.tensor([p.min_p for p in params], device=device)
    if (min_p > 0).any():
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0.0)
    return probs
