"""Building blocks of Llama-style decoders: RMSNorm, rotary embedding (default and llama3), MLP,
and the merged projections (q/k/v, gate/up) that read the input once.

Each takes the step's ``LayerKernels`` (``minengine.ops``): None runs the torch code here (the
reference: several kernels per call), otherwise their fused kernels (one launch per call).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from minengine.ops import LayerKernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, layers: LayerKernels | None = None
    ) -> torch.Tensor:
        """The norm of ``x`` (any leading dims), or with ``residual``: ``residual`` becomes
        ``x + residual`` (in place) and the norm is of that sum."""
        if layers is not None:
            shape = x.shape
            flat = None if residual is None else residual.view(-1, shape[-1])
            return layers.rms_norm(x.reshape(-1, shape[-1]), self.weight, self.eps, flat).view(shape)
        if residual is not None:
            x = residual.add_(x)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # llama3: keep high frequencies, divide low ones by `factor`, blend in between
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, indexed per token."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        layers: LayerKernels | None = None,
        norms: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hk, D] rotated (in place by the fused kernel); with ``norms``
        (Qwen3's per-head q and k RMSNorms) each head is normalised first, fused into the same launch."""
        if layers is not None:
            if norms is None:
                layers.rotary(positions, q, k, self.cos, self.sin)
            else:  # the decoder builds both norms with the config's one eps
                q_norm, k_norm = norms
                layers.rotary(positions, q, k, self.cos, self.sin, q_norm.weight, k_norm.weight, q_norm.eps)
            return q, k
        if norms is not None:
            q, k = norms[0](q), norms[1](k)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class MergedLinear(nn.Linear):
    """Several projections of one input as one matmul: their weights (and biases) stacked along the
    output dim, in ``parts`` order. Checkpoints store the parts under their own names
    (``q_proj``, ...): ``part_views`` names the rows each one fills."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = parts

    @property
    def sizes(self) -> list[int]:
        return list(self.parts.values())

    def part_views(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each part's rows of ``param`` (this module's weight or bias), as views."""
        return dict(zip(self.parts, param.split(self.sizes), strict=True))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate}, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor, layers: LayerKernels | None = None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        if layers is not None:
            return self.down_proj(layers.silu_and_mul(gate, up))
        return self.down_proj(nn.functional.silu(gate) * up)
