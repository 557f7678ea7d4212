"""One Llama-style decoder for every supported architecture.

Llama and Mistral are the plain form; Qwen2 adds a bias to the q/k/v projections; Qwen3 adds a
per-head RMSNorm on q and k (and states head_dim explicitly). Parameter names follow the Hugging
Face checkpoints, except that q/k/v and gate/up are each one merged projection (one matmul, the
input read once): ``CausalLM.checkpoint_tensors`` maps every checkpoint name to its parameter or
to its rows of a merged one, and loading copies name for name into those.

Attention reads and writes the paged KV cache through ``minengine.ops`` kernels; the batch is the
engine's mixed batch (prefill chunks first, then decodes) described by ``ForwardBatch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minengine.models.config import ModelConfig
from minengine.models.layers import MLP, MergedLinear, RMSNorm, RotaryEmbedding
from minengine.ops import KernelSet


@dataclass
class ForwardBatch:
    """Device tensors describing one step's mixed batch, shared by every layer."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, KV slot of each new token
    block_tables: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32, KV length after this step
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    max_seqlen_q: int
    logits_indices: torch.Tensor  # [S] int64, rows whose logits are sampled


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        parts = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
        self.qkv_proj = MergedLinear(cfg.hidden_size, parts, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary = [rotary]  # shared; a list keeps it out of this module's parameters

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, kv: tuple[torch.Tensor, torch.Tensor], kernels: KernelSet
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)  # views: rows strided
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        norms = (self.q_norm, self.k_norm) if hasattr(self, "q_norm") else None
        q, k = self.rotary[0](batch.positions, q, k, kernels.layers, norms)
        k_cache, v_cache = kv
        kernels.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        o = kernels.paged_attention(
            q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, batch.max_seqlen_q
        )
        return self.o_proj(o.view(t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, kv, kernels: KernelSet
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output and the residual stream before it is added (the next norm adds it,
        fused): the stream after the layer is their sum. ``residual`` None: ``x`` is the stream."""
        layers = kernels.layers
        if residual is None:
            residual, h = x, self.input_layernorm(x, layers=layers)
        else:
            h = self.input_layernorm(x, residual, layers)
        h = self.self_attn(h, batch, kv, kernels)
        h = self.post_attention_layernorm(h, residual, layers)
        return self.mlp(h, layers), residual


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rotary) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """``model.*`` and ``lm_head`` as in Hugging Face checkpoints; tied embeddings share a tensor."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.model = Model(cfg, max_positions)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Hugging Face checkpoint name -> the tensor it fills: a parameter, or a merged parameter's
        rows (a view), in parameter order (a merged parameter's parts in its order); a tied
        ``lm_head.weight`` is left out, as ``named_parameters`` leaves it."""
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for prefix, module in self.named_modules():
            for name, param in module.named_parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                if isinstance(module, MergedLinear):
                    parent = prefix.rpartition(".")[0]
                    for part, view in module.part_views(param).items():
                        out[f"{parent}.{part}.{name}"] = view
                else:
                    out[f"{prefix}.{name}" if prefix else name] = param
        return out

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], kernels: KernelSet):
        """Logits (float32) of the rows in ``batch.logits_indices``."""
        return self.logits(self.hidden(batch, kv_caches, kernels))

    @torch.inference_mode()
    def hidden(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], kernels: KernelSet):
        """The final (normed) hidden states of the rows in ``batch.logits_indices``."""
        x, residual = self.model.embed_tokens(batch.input_ids), None
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, batch, kv, kernels)
        rows = batch.logits_indices
        return self.model.norm(x[rows], None if residual is None else residual[rows], kernels.layers)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (float32) of final hidden states."""
        return self.lm_head(hidden).float()
