"""Sampling: greedy, temperature, top-k, top-p, min-p; per-request seeds are reproducible.

Tokens are drawn with the exponential race (argmax of p / E, E ~ Exp(1)), which samples from p
without normalising it. A request with a seed draws its noise from its own generator, so its
tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from minengine.memory.kv_pool import to_device
from minengine.request import Request


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device).manual_seed(seed)

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
        do not decode greedily are overwritten in it. Decisions use host values only, so sampling
        never waits for the device."""
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
        return tokens


def filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Softmax(logits / temperature) with top-k, top-p and min-p masks applied (not renormalised).
    Which filters run is decided on the host values of ``params``."""
    device, vocab = logits.device, logits.shape[-1]

    def column(values: list[float]) -> torch.Tensor:
        return to_device(values, torch.float32, device)[:, None]

    logits = logits / column([p.temperature for p in params])
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:
        k = to_device(top_k, torch.int64, device)
        kth = logits.sort(-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if any(p.top_p < 1 for p in params):
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > column(
            [p.top_p for p in params]
        )  # keep the smallest set reaching top_p
        probs = probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))
    if any(p.min_p > 0 for p in params):
        floor = column([p.min_p for p in params]) * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs
