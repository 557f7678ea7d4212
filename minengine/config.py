"""Engine configuration: one frozen dataclass whose fields are the CLI flags.

``chunked_prefill_size`` is ``--chunked-prefill-size``, and so on. Defaults live here and only
here. Every field is validated on construction; an invalid value raises ``ValueError`` naming
the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from minengine.sampling_params import SEED_MAX

DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cuda", "flashinfer")
LAYER_KERNELS = ("auto", "torch", "triton")
LOAD_FORMATS = ("auto", "dummy")
LOAD_BALANCE_METHODS = ("round_robin", "least_loaded")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("nixl", "fake")
KV_ADMISSIONS = ("preempt", "reserve")
GENERATION_CONFIGS = ("auto", "vllm")
# fields whose values come from a fixed list (the CLI offers them as choices)
CHOICES = {
    "device": DEVICES,
    "dtype": DTYPES,
    "attention_backend": ATTENTION_BACKENDS,
    "layer_kernels": LAYER_KERNELS,
    "load_format": LOAD_FORMATS,
    "load_balance_method": LOAD_BALANCE_METHODS,
    "disaggregation_mode": DISAGGREGATION_MODES,
    "disaggregation_transfer_backend": TRANSFER_BACKENDS,
    "kv_admission": KV_ADMISSIONS,
    "generation_config": GENERATION_CONFIGS,
}


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"
    tokenizer: str | None = None  # defaults to the model directory
    load_format: str = "auto"  # "dummy": seeded random weights, only config.json needed (benchmarks)
    # as vLLM's: "auto", a request that leaves out temperature, top_p, top_k, min_p or
    # repetition_penalty takes the model's generation_config.json value; "vllm": SamplingParams' defaults
    generation_config: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    # RMSNorm + residual add, rotary, SiLU-and-mul: "triton" (one launch each), "torch"; auto: triton on CUDA
    layer_kernels: str = "auto"
    page_size: int = 16
    max_running_requests: int = 256
    chunked_prefill_size: int = 8192
    long_prefill_token_threshold: int | None = None
    # "preempt": admit on the KV a request needs now, preempt the newest by recompute when KV runs
    # out (vLLM V1); "reserve": admit only if its whole prompt + max_tokens fits (never preempts)
    kv_admission: str = "preempt"
    max_total_tokens: int | None = None  # KV capacity in tokens; None: from memory (CUDA) or 65536 (CPU)
    mem_fraction_static: float = 0.85
    context_length: int | None = None  # None: the model's max_position_embeddings
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 256  # largest decode batch replayed from a graph (capped at max_running_requests)
    enable_prefill_delayer: bool = False
    prefill_delayer_max_delay_passes: int = 30
    prefill_delayer_token_usage_low_watermark: float | None = None  # KV usage in [0, 1]
    dp_size: int = 1  # data-parallel scheduler workers, each with its own model and KV pool
    base_gpu_id: int = 0  # worker i uses GPU base_gpu_id + i
    load_balance_method: str = "round_robin"
    seed: int = 0
    # prefill/decode disaggregation: a prefill server sends each request's KV pages to a decode server
    disaggregation_mode: str = "null"  # "prefill" | "decode": one side of a pair (see minengine.router)
    disaggregation_transfer_backend: str = "nixl"  # "fake": no data moved (queue-logic tests, warm-up)
    disaggregation_bootstrap_port: int = 8998  # the prefill server's bootstrap (KV handshake) port
    disaggregation_bootstrap_timeout: float = 30.0  # seconds a peer may stay silent before its requests fail
    disaggregation_decode_enable_radix_cache: bool = False  # decode: ask only for the KV pages it lacks
    num_reserved_decode_tokens: int = 512  # decode: KV allocated up front for generated tokens

    def __post_init__(self) -> None:
        _choice("device", self.device, DEVICES)
        _choice("dtype", self.dtype, DTYPES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _choice("layer_kernels", self.layer_kernels, LAYER_KERNELS)
        _choice("load_format", self.load_format, LOAD_FORMATS)
        _choice("generation_config", self.generation_config, GENERATION_CONFIGS)
        _choice("load_balance_method", self.load_balance_method, LOAD_BALANCE_METHODS)
        _choice("kv_admission", self.kv_admission, KV_ADMISSIONS)
        _int_at_least("prefill_delayer_max_delay_passes", self.prefill_delayer_max_delay_passes, 1)
        _int_at_least("dp_size", self.dp_size, 1)
        _int_at_least("cuda_graph_max_bs", self.cuda_graph_max_bs, 1)
        _int_at_least("base_gpu_id", self.base_gpu_id, 0)
        wm = self.prefill_delayer_token_usage_low_watermark
        if wm is not None and (isinstance(wm, bool) or not isinstance(wm, (int, float)) or not 0 <= wm <= 1):
            raise ValueError(
                f"prefill_delayer_token_usage_low_watermark is {wm!r}; allowed: a number in [0, 1] or None"
            )
        _int_at_least("page_size", self.page_size, 1)
        _int_at_least("max_running_requests", self.max_running_requests, 1)
        _int_at_least("chunked_prefill_size", self.chunked_prefill_size, 1)
        _int_at_least("long_prefill_token_threshold", self.long_prefill_token_threshold, 1, optional=True)
        _int_at_least("max_total_tokens", self.max_total_tokens, 1, optional=True)
        _int_at_least("context_length", self.context_length, 1, optional=True)
        _int_at_least("seed", self.seed, 0)
        if self.seed > SEED_MAX:
            raise ValueError(f"seed is {self.seed}; allowed: an integer in [0, {SEED_MAX}]")
        _choice("disaggregation_mode", self.disaggregation_mode, DISAGGREGATION_MODES)
        _choice("disaggregation_transfer_backend", self.disaggregation_transfer_backend, TRANSFER_BACKENDS)
        _int_at_least("disaggregation_bootstrap_port", self.disaggregation_bootstrap_port, 1)
        if self.disaggregation_bootstrap_port > 65535:
            port = self.disaggregation_bootstrap_port
            raise ValueError(f"disaggregation_bootstrap_port is {port}; allowed: 1..65535")
        _int_at_least("num_reserved_decode_tokens", self.num_reserved_decode_tokens, 0)
        t = self.disaggregation_bootstrap_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"disaggregation_bootstrap_timeout is {t!r}; allowed: a number of seconds > 0")
        if self.disaggregation_mode != "null" and self.dp_size != 1:
            raise ValueError(
                f"dp_size is {self.dp_size} with disaggregation_mode {self.disaggregation_mode!r}; "
                "allowed: dp_size 1 (run more prefill or decode servers behind the router instead)"
            )
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model is {self.model!r}; expected 'tiny' or a local model directory")
        if isinstance(self.mem_fraction_static, bool) or not (
            isinstance(self.mem_fraction_static, (int, float)) and 0 < self.mem_fraction_static < 1
        ):
            raise ValueError(f"mem_fraction_static is {self.mem_fraction_static!r}; allowed: a number in (0, 1)")
        flags = ("disable_radix_cache", "disable_overlap_schedule", "disable_cuda_graph", "enable_prefill_delayer")
        for name in (*flags, "disaggregation_decode_enable_radix_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} is {getattr(self, name)!r}; allowed: True or False")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Like the constructor, but an unknown field name is a ValueError listing the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown config field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
        return cls(**kwargs)


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} is {value!r}; allowed: {', '.join(allowed)}")


def _int_at_least(name: str, value: object, low: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        unset = " or None" if optional else ""
        raise ValueError(f"{name} is {value!r}; allowed: an integer >= {low}{unset}")
