"""Models: Llama / Mistral / Qwen2 / Qwen3 decoders loaded from local Hugging Face directories,
and the built-in ``tiny`` model."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from minengine.models.config import ARCHITECTURES, ModelConfig
from minengine.models.decoder import CausalLM, ForwardBatch
from minengine.models.tiny import TINY_CONFIG, init_random_weights, tiny_tokenizer
from minengine.sampling_params import SamplingParams
from minengine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
TINY = "tiny"

__all__ = [
    "ARCHITECTURES",
    "CausalLM",
    "ForwardBatch",
    "ModelConfig",
    "load_model",
    "load_model_config",
    "load_tokenizer",
    "sampling_defaults",
]


def _model_dir(model: str) -> Path:
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model directory {model!r} does not exist (use 'tiny' or a local Hugging Face directory)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model directory {model!r}")
    return path


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ValueError(f"{file} is not valid JSON: {exc}") from None


def load_model_config(model: str) -> ModelConfig:
    if model == TINY:
        return TINY_CONFIG
    path = _model_dir(model)
    cfg = _read_json(path / "config.json")
    model_cfg = ModelConfig.from_hf(cfg, where=str(path / "config.json"))
    gen_file = path / "generation_config.json"
    if gen_file.is_file():  # its eos ids (often a list) take part in stopping, as in transformers
        eos = _read_json(gen_file).get("eos_token_id")
        extra = eos if isinstance(eos, list) else [] if eos is None else [eos]
        ids = tuple(dict.fromkeys([*model_cfg.eos_token_ids, *extra]))
        model_cfg = dataclasses.replace(model_cfg, eos_token_ids=ids)
    return model_cfg


# generation_config.json's fields that become defaults of requests (vLLM's list, less max_new_tokens)
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model: str, generation_config: str = "auto") -> dict[str, Any]:
    """What vLLM's ``--generation-config auto`` takes from the model's generation_config.json: the
    ``SAMPLING_DEFAULTS`` it sets, which requests that leave them out use instead of
    ``SamplingParams``' defaults. None for "vllm", or a model without the file; ValueError naming
    the file and the field for a value ``SamplingParams`` does not take."""
    if generation_config == "vllm" or model == TINY:
        return {}
    file = _model_dir(model) / "generation_config.json"
    if not file.is_file():
        return {}
    cfg = _read_json(file)
    defaults = {k: cfg[k] for k in SAMPLING_DEFAULTS if cfg.get(k) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"{file}: {exc} (--generation-config vllm leaves the file's sampling fields out)") from None
    if defaults:
        logger.info("requests that leave them out sample with %s (%s; --generation-config vllm: not)", defaults, file)
    return defaults


def load_tokenizer(tokenizer: str) -> Tokenizer:
    return tiny_tokenizer() if tokenizer == TINY else Tokenizer.from_dir(tokenizer)


def load_model(
    model: str, cfg: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype, dummy: bool = False
) -> CausalLM:
    """The model with its weights: from safetensors, or seeded random ones (``tiny``, ``dummy``)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            net = CausalLM(cfg, max_positions)
    finally:
        torch.set_default_dtype(prev)
    if model == TINY or dummy:
        init_random_weights(net)
    else:
        _load_safetensors(net, _model_dir(model))
    return net.eval()


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index)["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise FileNotFoundError(f"missing weight files in {path}: {', '.join(missing)} (listed in {index.name})")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def _load_safetensors(net: CausalLM, path: Path) -> None:
    from safetensors import safe_open

    params = net.checkpoint_tensors()
    expected = set(params)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                # RoPE buffers some trainers save (ColossalAI: cos/sin caches); vLLM skips them too
                if name.endswith(("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")) or (
                    name == "lm_head.weight" and net.config.tie_word_embeddings
                ):
                    continue
                if name not in params:  # a part this model lacks (a bias, a layer): it would run wrong
                    unexpected.append(f"{name} ({file.name})")
                    continue
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise ValueError(
                        f"weight {name} in {file.name} has shape {tuple(tensor.shape)}; "
                        f"the config implies {tuple(params[name].shape)}"
                    )
                with torch.no_grad():
                    params[name].copy_(tensor)
                loaded.add(name)
    missing = sorted(expected - loaded - ({"lm_head.weight"} if net.config.tie_word_embeddings else set()))
    if unexpected:
        cfg = net.config
        raise ValueError(
            f"weights in {path} that a {cfg.architecture} of {cfg.num_layers} layers as its config.json "
            f"describes has no place for: {_some(unexpected)}"
        )
    if missing:
        raise ValueError(f"missing weights in {path}: {_some(missing)}")


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
