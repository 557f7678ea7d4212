"""Per-request sampling and stopping parameters (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from minengine.structured import StructuredOutputs

# seeds torch.Generator.manual_seed takes
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# most alternatives a token's logprobs may list (vLLM's default max_logprobs)
MAX_LOGPROBS = 20
# the range of presence_penalty and frequency_penalty, as in vLLM and the OpenAI API
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # the OpenAI API's
# at most this many bad words a request, and tokens in all their tokenizations together (vLLM's
# model runner caps the second at 1024 too): each step compares the output's tail with them
MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS = 128, 1024
MAX_CACHE_SALT = 1024  # characters
# temperatures below this sample greedily, as in vLLM: dividing logits by a smaller one overflows
GREEDY_TEMPERATURE = 1e-5
# the sampler divides float32 logits by temperature and repetition_penalty: a value float32 turns into
# inf (or 0) makes a -inf of allowed_token_ids / bad_words / min_tokens NaN, which argmax and the
# sampling then pick (token 0)
FLOAT32_MAX, FLOAT32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: the rest of the context (as vLLM)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1  # sequences per prompt; sequence j samples with seed + j (with a seed)
    include_stop_str_in_output: bool = False
    # False: special tokens (``<|im_end|>``, ...) are in the output text too, as vLLM's; the token
    # that ends the output stays out of it either way, unless ``include_stop_str_in_output``
    skip_special_tokens: bool = True
    # per output token: the sampled token's log-probability and rank, and the ``logprobs`` most
    # likely tokens' (None: none). Of the model's raw distribution, before temperature and the
    # top-k / top-p / min-p filters, as vLLM's default ``raw_logprobs``
    logprobs: int | None = None
    # per prompt token after the first: its log-probability given the tokens before it, its rank,
    # and the ``prompt_logprobs`` most likely tokens' there (None: none). As in vLLM, such a request
    # computes its whole prompt: it reads no KV from the prefix cache
    prompt_logprobs: int | None = None
    # As vLLM (and in its order): ``logit_bias`` is added to the logits of the tokens it names;
    # while fewer than ``min_tokens`` tokens are out, end-of-sequence (unless ``ignore_eos``) and
    # ``stop_token_ids`` cannot be sampled and no stop string ends in their text; then the penalties:
    # a logit of a token seen in the prompt or the output is divided by ``repetition_penalty`` (if
    # positive, else multiplied), and each output occurrence subtracts ``frequency_penalty``, any
    # subtracts ``presence_penalty`` once. Greedy decoding takes the argmax of the adjusted logits;
    # logprobs stay the model's raw ones
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    # As vLLM, before the rest: only ``allowed_token_ids`` can be sampled (None: any token); and no
    # output has a ``bad_words`` word in it as tokenized. Each word is tokenized as it would begin a
    # text and after a space (``bad_words_token_ids``), and the last token of a tokenization is
    # banned whenever the output (not the prompt) ends in the tokens before it
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: as many as the context length takes)
    truncate_prompt_tokens: int | None = None
    # vLLM's (there a prompt's key): the request shares prefix-cache KV only with requests of the
    # same salt (None: with those of none), so one tenant cannot tell what another's prompts were
    # from how fast its own come back
    cache_salt: str | None = None
    # vLLM's: the output follows a JSON schema, a regex, a grammar, ... (``minengine.structured``)
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(
                f"max_tokens is {self.max_tokens!r}; allowed: an integer >= 1, or None (the rest of the context)"
            )
        if not _number(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            raise ValueError(f"temperature is {self.temperature!r}; allowed: a number in [0, {FLOAT32_MAX:.6g}]")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p is {self.top_p!r}; allowed: a number in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k is {self.top_k!r}; allowed: -1 or 0 (disabled), or an integer >= 1")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p is {self.min_p!r}; allowed: a number in [0, 1]")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise ValueError(f"seed is {self.seed!r}; allowed: an integer in [{SEED_MIN}, {SEED_MAX}] or None")
        stops = [self.stop] if isinstance(self.stop, str) else [] if self.stop is None else self.stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop is {self.stop!r}; allowed: a non-empty string or a list of them")
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(
                f"stop_token_ids is {self.stop_token_ids!r:.80}; allowed: a list of token ids (integers >= 0)"
            )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} is {getattr(self, name)!r}; allowed: True or False")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n is {self.n!r}; allowed: an integer >= 1")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} is {k!r}; allowed: None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                raise ValueError(f"{name} is {value!r}; allowed: a number in [{PENALTY_RANGE[0]}, {PENALTY_RANGE[1]}]")
        if not _number(self.repetition_penalty) or not FLOAT32_TINY <= self.repetition_penalty <= FLOAT32_MAX:
            raise ValueError(
                f"repetition_penalty is {self.repetition_penalty!r}; allowed: a number in "
                f"[{FLOAT32_TINY:.6g}, {FLOAT32_MAX:.6g}] (> 0, finite in float32)"
            )
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens is {self.min_tokens!r}; allowed: an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens is {self.min_tokens}; allowed: an integer in [0, max_tokens] = [0, {self.max_tokens}]"
            )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias is {self.logit_bias!r}; allowed: a dict of token id to bias, or None")
            lo, hi = LOGIT_BIAS_RANGE
            for token, bias in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise ValueError(f"logit_bias has token id {token!r}; allowed: an integer >= 0")
                if not _number(bias) or not lo <= bias <= hi:
                    raise ValueError(f"logit_bias of token {token} is {bias!r}; allowed: a number in [{lo}, {hi}]")
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, list)
            or not allowed
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in allowed)
        ):
            raise ValueError(
                f"allowed_token_ids is {allowed!r:.80}; allowed: None or a non-empty list of token ids (integers >= 0)"
            )
        words = self.bad_words
        if words is not None:
            if not isinstance(words, list) or len(words) > MAX_BAD_WORDS:
                raise ValueError(
                    f"bad_words is {words!r:.80}; allowed: None or a list of at most {MAX_BAD_WORDS} strings"
                )
            bad = next((w for w in words if not isinstance(w, str) or not w.strip()), None)
            if bad is not None:
                raise ValueError(f"bad_words has {bad!r:.80}; allowed: strings with a character that is not a space")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not (k >= 1 or k == -1)):
            raise ValueError(
                f"truncate_prompt_tokens is {k!r}; allowed: None, -1 (the context length) or an integer >= 1"
            )
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT):
            raise ValueError(f"cache_salt is {salt!r:.80}; allowed: None or a string of 1..{MAX_CACHE_SALT} characters")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputs):
            raise ValueError(f"structured_outputs is {so!r:.80}; allowed: None or a StructuredOutputs")
        if self.seed is not None and self.seed + self.n - 1 > SEED_MAX:
            raise ValueError(f"seed is {self.seed} with n {self.n}; allowed: seed + n - 1 <= {SEED_MAX}")

    def per_sequence(self) -> list[SamplingParams]:
        """The ``n`` sequences' own parameters (``n`` = 1 each): sequence j samples with seed + j,
        so each is reproducible alone and none repeats another."""
        if self.n == 1:
            return [self]
        seed = self.seed
        return [replace(self, n=1, seed=None if seed is None else seed + j) for j in range(self.n)]

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @cached_property
    def stop_token_set(self) -> frozenset[int]:
        """``stop_token_ids`` as a set: each sampled token is looked up in it (a list may be long,
        and may repeat ids)."""
        return frozenset(self.stop_token_ids or ())

    def min_tokens_bans(self, eos_token_ids: frozenset[int]) -> frozenset[int]:
        """The tokens that cannot be sampled while ``min_tokens`` is not reached: ``stop_token_ids``,
        and the model's end-of-sequence ids unless ``ignore_eos``."""
        return self.stop_token_set if self.ignore_eos else self.stop_token_set | eos_token_ids

    @cached_property
    def penalizes(self) -> bool:
        """Presence, frequency or repetition penalties apply: the sampler keeps a count of this
        request's output tokens on the device."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @cached_property
    def adjusts_logits(self) -> bool:
        """The logits are changed before sampling (``min_tokens`` only while it is not reached)."""
        return (
            self.penalizes
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
            or self.structured_outputs is not None
        )

    def first_token_only(self) -> SamplingParams:
        """These parameters for the first output token alone (a disaggregated prefill server's
        part): ``max_tokens`` 1, and ``min_tokens`` at most 1 (so that token is no end)."""
        return replace(self, max_tokens=1, min_tokens=min(self.min_tokens, 1))

    def bad_words_token_ids(self, tokenizer, vocab_size: int) -> tuple[tuple[int, ...], ...]:
        """``bad_words`` tokenized by ``tokenizer`` (no special tokens), as vLLM does: each word
        without its leading spaces, then after one space where that gives other tokens of the same
        number. ValueError if a token is outside the model's vocabulary [0, ``vocab_size``) or the
        tokenizations take more than ``MAX_BAD_WORD_TOKENS`` tokens together."""
        out: list[tuple[int, ...]] = []
        for word in self.bad_words or ():
            try:
                alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
                spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            except ValueError as exc:  # (no valid Unicode)
                raise ValueError(f"bad_words has {word!r:.80}: {exc}") from None
            if not alone or not spaced:
                raise ValueError(f"bad_words has {word!r:.80}, which the tokenizer makes no tokens of")
            out.append(alone)
            if spaced[0] != alone[0] and len(spaced) == len(alone):  # a word that begins with its own space
                out.append(spaced)
        bad = next((t for ids in out for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise ValueError(f"bad_words token id {bad} is outside the vocabulary [0, {vocab_size})")
        total = sum(map(len, out))
        if total > MAX_BAD_WORD_TOKENS:
            raise ValueError(f"bad_words take {total} tokens; allowed: at most {MAX_BAD_WORD_TOKENS}")
        return tuple(out)

    @property
    def greedy(self) -> bool:
        """Argmax sampling: temperature 0, or one so small that dividing by it would overflow."""
        return self.temperature < GREEDY_TEMPERATURE


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN
