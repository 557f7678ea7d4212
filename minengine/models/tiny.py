"""The built-in ``tiny`` model: a Llama-style config, seeded random weights, a byte-level tokenizer.

It needs no files, so ``LLM("tiny")`` and the server run anywhere. Its output is random text.

Config: 2 layers, hidden 128, 4 query heads and 2 KV heads of dim 32 (GQA), MLP 256, vocab 260
(256 byte tokens + <|begin_of_text|>, <|end_of_text|>, <|im_start|>, <|im_end|>), RoPE theta
10000, 4096 positions, tied embeddings; weights ~ N(0, 0.02) from seed 0 (norms 1), see ``init_random_weights``.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from minengine.models.config import ModelConfig
from minengine.models.decoder import CausalLM
from minengine.tokenizer import Tokenizer

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 256, 257
SEED = 0

TINY_CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=256 + len(SPECIAL_TOKENS),
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    qkv_bias=False,
    qk_norm=False,
    eos_token_ids=(EOS_ID, SPECIAL_TOKENS.index("<|im_end|>") + 256),
    bos_token_id=BOS_ID,
)


def tiny_tokenizer() -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=_BYTE_OF.__getitem__))}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    bos = SPECIAL_TOKENS[0]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_ID)]
    )
    return Tokenizer(backend, {"bos_token": bos, "eos_token": SPECIAL_TOKENS[1]}, chat_template=None)


def _byte_table() -> dict[str, int]:
    """ByteLevel's printable stand-in character of each byte -> the byte, so token id = byte value.

    GPT-2's byte-to-unicode map: printable bytes stand for themselves, the rest shift past 255."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_table()


@torch.no_grad()
def init_random_weights(model: CausalLM, seed: int = SEED) -> None:
    """Norms 1, everything else N(0, 0.02), drawn on the parameters' device from ``seed``: one
    generator per checkpoint tensor, so merging projections does not change the weights."""
    for i, (name, param) in enumerate(model.checkpoint_tensors().items()):
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            gen = torch.Generator(param.device).manual_seed(seed + i)
            param.normal_(0.0, 0.02, generator=gen)
