"""A request's state as the scheduler and runner see it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from minengine.detokenizer import IncrementalDetokenizer
from minengine.memory.radix_cache import Node
from minengine.sampling_params import SamplingParams
from minengine.structured import Matcher

# one output token's logprobs: (its logprob, its rank in the vocabulary from 1, the top token ids,
# their logprobs), the top ones most likely first (``SamplingParams.logprobs`` of them)
TokenLogprobs = tuple[float, int, list[int], list[float]]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    max_len: int  # prompt + max_tokens, capped by the context length
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    status: Status = Status.WAITING
    num_computed: int = 0  # leading tokens whose KV is in the cache (or being written by a launched step)
    num_inflight: int = 0  # tokens sampled by launched steps whose values the host has not read yet
    pages: list[int] = field(default_factory=list)
    cached_pages: int = 0  # leading pages owned by the radix cache (locked through `node`)
    node: Node | None = None
    slot: int | None = None
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens served by the prefix cache at its first admission
    generator: torch.Generator | None = None
    detok: IncrementalDetokenizer | None = None  # None when the caller makes the text (server)
    prefix_match: tuple | None = None  # waiting: ((radix version, tokens), pages, node) of its last match
    prefill_len: int = 0  # tokens its prefill computes: the prompt, or every known token once preempted
    num_preemptions: int = 0  # times its KV was dropped to make room (it resumes by recomputing)
    output_logprobs: list[TokenLogprobs] | None = None  # one per output token, when params.logprobs is set
    # with params.prompt_logprobs: one per prompt token from the second on, in order; the server's
    # scheduler hands them on (and empties the list) when the first output token comes
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_prompt_logprobs: int = 0  # prompt tokens from the second on whose logprobs have arrived
    # with penalties (``params.penalizes``), on the device, made by the sampler at its first token
    # there: [V] int32 counts of the sampled output tokens, and with a repetition penalty, [V] bool
    # marks of the prompt's tokens. They live with the request (a preempted one keeps them) until it finishes
    output_counts: torch.Tensor | None = None
    prompt_seen: torch.Tensor | None = None
    # ``params.bad_words`` tokenized (``SamplingParams.bad_words_token_ids``); with one of two or more
    # tokens, the sampler keeps the output's last tokens on the device ([longest - 1] int64, -1
    # before the first), made and freed as ``output_counts`` is
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    output_tail: torch.Tensor | None = None
    # the sampler's device copies of ``params.allowed_token_ids`` and of the tokens ``min_tokens``
    # bans (end-of-sequence unless ``ignore_eos``, and ``stop_token_ids``), each id once: made at
    # their first use, so a long list costs a step nothing on the host; freed with ``output_counts``
    allowed_ids: torch.Tensor | None = None
    end_ids: torch.Tensor | None = None
    matcher: Matcher | None = None  # with params.structured_outputs: its grammar's matcher

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        self.prefill_len = self.prefill_len or len(self.prompt_ids)
        if self.params.logprobs is not None and self.output_logprobs is None:
            self.output_logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = []

    def drop_sampler_state(self) -> None:
        """Free what the sampler keeps on the device for it (no step samples it again)."""
        self.output_counts = self.prompt_seen = self.output_tail = self.allowed_ids = self.end_ids = None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def text(self) -> str:
        """The output text: complete once the request finished (while it runs, only a request with
        stop strings has its text so far; the engine decodes the others once, at the end)."""
        return self.detok.text if self.detok is not None else ""

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def num_pending(self) -> int:
        """Tokens without KV yet: the rest of the prompt, or the last sampled token (known or not)."""
        num_tokens = len(self.token_ids) + self.num_inflight  # self.num_tokens, without a second property
        if num_tokens >= self.max_len:
            return 0  # its last token is sampled: it finishes by length, nothing more to compute
        return num_tokens - self.num_computed

    @property
    def grammar_hold(self) -> int:
        """1 while the grammar its next sampling needs is compiling (a step that sampled it would
        wait): the token that samples is held back; else 0."""
        return int(self.matcher is not None and not self.matcher.ready(self.output_ids, self.num_inflight > 0))

    @property
    def num_schedulable(self) -> int:
        """Its pending tokens a step may compute now (all but the one that samples, while
        ``grammar_hold``)."""
        n = self.num_pending
        return n - self.grammar_hold if n else 0

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens, counting those sampled on the device but not read yet."""
        return len(self.token_ids) + self.num_inflight

    @property
    def scores_prompt(self) -> bool:
        """It still needs logprobs of prompt tokens: its prefill computes every prompt position (it
        reads no KV from the prefix cache)."""
        return self.prompt_logprobs is not None and self.num_prompt_logprobs < len(self.prompt_ids) - 1

    def add_prompt_logprobs(self, first: int, entries: list[TokenLogprobs]) -> None:
        """Logprobs of prompt tokens ``first + 1``... from a step's results. A prefill recomputed
        after a preemption scores again positions whose results were already in flight: those are
        kept once."""
        assert first <= self.num_prompt_logprobs, "prompt logprobs arrive in order"
        new = entries[self.num_prompt_logprobs - first :]
        self.prompt_logprobs += new
        self.num_prompt_logprobs += len(new)

    @property
    def num_output_sampled(self) -> int:
        """Output tokens sampled so far, those in flight included."""
        return self.num_tokens - len(self.prompt_ids)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prefill_len
