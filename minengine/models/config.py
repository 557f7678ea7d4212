"""Model hyper-parameters read from a Hugging Face ``config.json``.

Accepts both ways transformers has stored RoPE settings: ``rope_theta`` + ``rope_scaling``
(checkpoints up to transformers 4.x) and ``rope_parameters`` (5.x).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from triton_kernels.contract import MAX_HEAD_DIM, MIN_HEAD_DIM, head_dim_supported

# architecture name -> (q/k/v projections have a bias, per-head q/k RMSNorm)
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
# architectures whose q/k/v and o projections all take config.json's ``attention_bias`` (as in
# transformers; Mistral and Qwen2 ignore it), and the one whose MLP takes ``mlp_bias``
_ATTENTION_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM")
_MLP_BIAS = ("LlamaForCausalLM",)
# hidden_act values that are SiLU (transformers' ACT2FN), the only activation the MLP computes
_SILU = ("silu", "swish")
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    o_bias: bool = False  # the attention output projection has a bias
    mlp_bias: bool = False  # gate, up and down projections have biases
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], where: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or [_MODEL_TYPES.get(cfg.get("model_type", ""), "")]
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs[0] or cfg.get('model_type')!r} in {where}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        qkv_bias, qk_norm = ARCHITECTURES[arch]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope type {rope_type!r} in {where}; supported: default, llama3")
        missing = [k for k in _REQUIRED if k not in cfg]
        if rope_type == "llama3":
            missing += [k for k in ("factor", "original_max_position_embeddings") if k not in rope]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)} (needed for {arch}, rope type {rope_type})")
        act = cfg.get("hidden_act", "silu")
        if act not in _SILU:
            raise ValueError(f"unsupported hidden_act {act!r} in {where}; supported: {', '.join(_SILU)}")
        attention_bias = arch in _ATTENTION_BIAS and bool(cfg.get("attention_bias", False))
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        if not head_dim_supported(head_dim):
            raise ValueError(
                f"head dim {head_dim} in {where} is not supported; allowed: multiples of 16 from {MIN_HEAD_DIM} "
                f"to {MAX_HEAD_DIM} (head_dim, else hidden_size / num_attention_heads)"
            )
        eos = cfg.get("eos_token_id")
        use_window = cfg.get("use_sliding_window", arch == "MistralForCausalLM")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias or attention_bias,
            qk_norm=qk_norm,
            o_bias=attention_bias,
            mlp_bias=arch in _MLP_BIAS and bool(cfg.get("mlp_bias", False)),
            rope_scaling=rope if rope_type == "llama3" else None,
            sliding_window=cfg.get("sliding_window") if use_window else None,
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            bos_token_id=cfg.get("bos_token_id"),
        )
