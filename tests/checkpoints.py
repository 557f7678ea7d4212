"""Tiny random-weight Hugging Face checkpoints for tests, built with transformers (no downloads)."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest
import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size pages.",
    "Chunked prefill splits a long prompt into pieces that share a step with decodes.",
    "A radix tree caches prompt prefixes so that they are not recomputed.",
    "Überraschung! Ça marche, naïve café — 東京 and 🚀 too.",
] * 20
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer(path: Path, vocab_size: int = 400, added_tokens: tuple[str, ...] = ()) -> int:
    """A byte-level BPE ``tokenizer.json`` trained on a small corpus, with ``added_tokens`` (not
    special: decoding keeps them, as Qwen3's ``<think>``) after its vocabulary; returns its vocab
    size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens(list(added_tokens))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def build_checkpoint(
    path: Path,
    arch: str,
    seed: int = 0,
    shard: bool = False,
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    added_tokens: tuple[str, ...] = (),
    **overrides,
) -> Path:
    """A 2-layer float32 checkpoint of ``arch`` (llama | mistral | qwen2 | qwen3) with a trained tokenizer;
    ``num_heads`` query and ``num_kv_heads`` KV heads of head dim hidden_size / num_heads (qwen3: 32).
    ``added_tokens``: as ``build_tokenizer``'s. ``overrides``: more config fields (``attention_bias``, ...)."""
    import transformers

    vocab = build_tokenizer(path, added_tokens=added_tokens)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        initializer_range=0.1,
        **overrides,
    )
    if arch == "llama":  # GQA, llama3 RoPE scaling, untied
        scaling = dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        cfg = transformers.LlamaConfig(**common, rope_theta=50000.0, rope_scaling=scaling, tie_word_embeddings=False)
    elif arch == "mistral":  # a sliding window (the engine caps the context at it)
        cfg = transformers.MistralConfig(**common, sliding_window=256)
    elif arch == "qwen2":  # q/k/v bias
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False)
    elif arch == "qwen3":  # per-head q/k norm, explicit head_dim, tied embeddings
        cfg = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # biases and norms start at 0 / 1: make them random so they matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, max_shard_size="200KB" if shard else "5GB")
    return path


# engine configurations that split, preempt and overlap steps, or go through the front end
SCHEDULING_SHAPES = pytest.mark.parametrize(
    "config",
    [
        dict(page_size=4),
        dict(page_size=3, chunked_prefill_size=8, disable_overlap_schedule=True),
        dict(page_size=4, max_total_tokens=72, chunked_prefill_size=16),  # preempts and recomputes
        dict(page_size=4, dp_size=2),  # through the workers and the front end
    ],
    ids=["page4", "chunk8-no-overlap", "preempt", "dp2"],
)


def prompts_for(vocab: int) -> list[list[int]]:
    """Fresh random prompts: three that share a 23-token prefix (1, 9 and 30 tokens after it),
    and a one-token prompt."""
    rng = random.Random()
    shared = [rng.randrange(4, vocab) for _ in range(23)]
    return [shared + [rng.randrange(4, vocab) for _ in range(n)] for n in (1, 9, 30)] + [[rng.randrange(4, vocab)]]


def doubled_letter(tokenizer) -> tuple[str, int]:
    """A letter that is one token and, twice, two of that token: the word of it twice is a bad word
    of two tokens."""
    for c in string.ascii_letters:
        (token,) = ids = tokenizer.encode(c, add_special_tokens=False) or [None]
        if len(ids) == 1 and tokenizer.encode(c + c, add_special_tokens=False) == [token, token]:
            return c, token
    raise AssertionError("the tokenizer merges every doubled letter")
