"""The engine: model, KV memory, scheduler and runner wired together, one step at a time."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable
from concurrent import futures

import torch

from minengine import ops
from minengine.config import EngineConfig
from minengine.cuda_graph import DecodeGraphs
from minengine.detokenizer import IncrementalDetokenizer
from minengine.memory import KVPool, PageTable
from minengine.models import load_model, load_model_config, load_tokenizer
from minengine.ops import flashinfer_ref
from minengine.profiling import StepProfiler, step_range
from minengine.request import Request
from minengine.runner import Launched, ModelRunner
from minengine.sampler import Sampler
from minengine.sampling_params import SamplingParams
from minengine.scheduler import Scheduler
from minengine.scheduler.prefill_delayer import DelayerConfig, PrefillDelayer
from minengine.structured import Grammars, Matcher, check_reasoning, think_ids
from minengine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
CPU_DEFAULT_MAX_TOTAL_TOKENS = 65536
# attention backends a decode step can be captured with: no host work inside, or (flashinfer) planned
# on the host around each capture and replay (KernelSet.graph_bucket)
GRAPH_SAFE = ("triton", "cuda", "tuned", "flashinfer")


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA device is available; allowed here: auto, cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def generation_room(num_tokens: int, context_length: int, kv_capacity: int, subject: str = "the prompt takes") -> int:
    """The tokens a prompt of ``num_tokens`` leaves to generate (context and KV capacity); a
    ValueError, which starts with ``subject``, if none."""
    room = min(context_length, kv_capacity)
    if num_tokens >= room:
        what = "context length" if room == context_length else "KV cache capacity"
        raise ValueError(
            f"{subject} {num_tokens} tokens, leaving no room to generate; allowed: at most {room - 1} "
            f"(the {what} is {room})"
        )
    return room - num_tokens


def resolve_max_tokens(
    prompt_ids: list[int],
    params: SamplingParams,
    context_length: int,
    kv_capacity: int,
    subject: str = "the prompt takes",
) -> SamplingParams:
    """``max_tokens=None`` as vLLM takes it: all the room the prompt leaves (``generation_room``)."""
    if params.max_tokens is not None:
        return params
    room = generation_room(len(prompt_ids), context_length, kv_capacity, subject)
    return dataclasses.replace(params, max_tokens=room)


def truncation(k: int | None, context_length: int) -> int | None:
    """How many tokens ``truncate_prompt_tokens`` = ``k`` keeps of a prompt (None: all of it; -1:
    the context length's worth); ValueError naming it if it is past the context length."""
    if k is not None and k > context_length:
        raise ValueError(
            f"truncate_prompt_tokens is {k}; allowed: -1 (the context length) or 1..{context_length} "
            "(the context length)"
        )
    return context_length if k == -1 else k


def truncate_prompt(prompt_ids: list[int], k: int | None, context_length: int) -> list[int]:
    """The prompt's last ``truncation(k, context_length)`` tokens, as vLLM truncates token ids; the
    prompt itself when that is all of it. (A text prompt is cut before its special tokens are added:
    ``Tokenizer.encode(..., truncate_left=...)``.)"""
    keep = truncation(k, context_length)
    return prompt_ids[-keep:] if keep is not None and len(prompt_ids) > keep else prompt_ids


def check_prompt(
    prompt_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    context_length: int,
    kv_capacity: int,
    tokenizer: Tokenizer,
    eos_token_ids: frozenset[int] = frozenset(),
) -> tuple[tuple[int, ...], ...]:
    """Raise ValueError if a request is malformed or can never fit; the message names the values.
    ``tokenizer`` tokenizes its ``bad_words``: returns them tokenized
    (``SamplingParams.bad_words_token_ids``). ``eos_token_ids``: the model's, which ``min_tokens``
    bans (unless ``ignore_eos``)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    bad = next((t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int)), None)
    if bad is not None:
        kind = type(bad).__name__
        raise ValueError(f"prompt token id {bad!r} is a {kind}; allowed: Python ints in [0, {vocab_size})")
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab_size})")
    bad = next((t for t in params.logit_bias or () if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})")
    bad = next((t for t in params.allowed_token_ids or () if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"allowed_token_ids has token id {bad}, outside the vocabulary [0, {vocab_size})")
    bad_words_ids = params.bad_words_token_ids(tokenizer, vocab_size)
    if params.allowed_token_ids is not None:  # (with none of them left, a row of -inf samples token 0)
        banned = {ids[0] for ids in bad_words_ids if len(ids) == 1}
        if params.min_tokens > 0:
            banned |= params.min_tokens_bans(eos_token_ids)
        if banned.issuperset(params.allowed_token_ids):
            raise ValueError(
                f"allowed_token_ids is {params.allowed_token_ids!r:.80}, and bad_words or min_tokens "
                "(it holds back end-of-sequence and stop_token_ids) ban them all; allowed: at least one "
                "token the first step may sample"
            )
    if params.structured_outputs is not None:  # (its grammar parses: compiling it cannot fail later)
        params.structured_outputs.check()
        check_reasoning(params.structured_outputs, tokenizer, vocab_size)
    total = len(prompt_ids) + params.max_tokens
    for limit, what in ((context_length, "the context length"), (kv_capacity, "the KV cache capacity of")):
        if total > limit:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds {what} {limit} tokens"
            )
    return bad_words_ids


class Engine:
    def __init__(self, config: EngineConfig, detokenize: bool = True, gather: Callable | None = None, rank: int = 0):
        """``detokenize=False``: the caller makes the output text and applies stop strings (the
        server's front end does, so the scheduler process never decodes). ``gather``: the
        prefill delayer's all_gather across data-parallel workers (None: one worker); ``rank``:
        this engine's data-parallel worker (its profiles' file names)."""
        self.config = config
        self.detokenize = detokenize
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_config = mc = load_model_config(config.model)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.context_length = config.context_length or mc.max_position_embeddings
        if self.context_length > mc.max_position_embeddings:  # positions the model was not made for
            raise ValueError(
                f"context_length is {config.context_length}; allowed: 1..{mc.max_position_embeddings} "
                "(the model's max_position_embeddings)"
            )
        if mc.sliding_window and mc.sliding_window < self.context_length:
            logger.warning("sliding window %d: context length capped to it", mc.sliding_window)
            self.context_length = mc.sliding_window
        dummy = config.load_format == "dummy"
        self.model = load_model(config.model, mc, self.context_length, self.device, self.dtype, dummy)
        kernels = ops.get_kernels(config.attention_backend, self.device)
        kernels = kernels._replace(layers=ops.get_layer_kernels(config.layer_kernels, self.device))
        self.backend = backend = ops.resolve_backend(config.attention_backend, self.device)
        self.use_cuda_graphs = self.device.type == "cuda" and not config.disable_cuda_graph and backend in GRAPH_SAFE

        ps = config.page_size
        self.num_pages = self._kv_pages(ps)
        pool = KVPool(mc.num_layers, self.num_pages, ps, mc.num_kv_heads, mc.head_dim, self.dtype, self.device)
        page_table = PageTable(config.max_running_requests, -(-self.context_length // ps), self.device)
        self.delayer = None
        if config.enable_prefill_delayer:
            cfg = DelayerConfig(
                config.max_running_requests,
                config.prefill_delayer_max_delay_passes,
                config.prefill_delayer_token_usage_low_watermark,
            )
            self.delayer = PrefillDelayer(cfg, gather)
        self.scheduler = Scheduler(
            self.num_pages,
            ps,
            page_table,
            config.max_running_requests,
            config.chunked_prefill_size,
            config.long_prefill_token_threshold,
            enable_radix_cache=not config.disable_radix_cache
            and (config.disaggregation_mode != "decode" or config.disaggregation_decode_enable_radix_cache),
            delayer=self.delayer,
            hold_kv_on_finish=config.disaggregation_mode == "prefill",
            # a prefill server reserves prompt + 1 token, all it needs; its KV must not move mid-send
            preempt=config.kv_admission == "preempt" and config.disaggregation_mode != "prefill",
        )
        self.eos_token_ids = set(mc.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        self.sampler = Sampler(self.device, config.seed, frozenset(self.eos_token_ids))
        self.grammars = Grammars(self.tokenizer, mc.vocab_size, frozenset(self.eos_token_ids))
        self.runner = ModelRunner(self.model, pool, page_table, kernels, self.sampler, config.max_running_requests)
        if self.use_cuda_graphs:
            max_bs = min(config.cuda_graph_max_bs, config.max_running_requests)
            self.runner.graphs = DecodeGraphs(self.model, pool, kernels, max_bs, page_table.table.shape[1], True)
        self.overlap = not config.disable_overlap_schedule
        self._in_flight: Launched | None = None  # overlap: the launched step whose tokens are not read yet
        # (request, tokens with KV) of the step read in the last pass: that KV is written now
        self.kv_ready: list[tuple[Request, int]] = []
        self._rids = itertools.count()
        self.profiler = StepProfiler(self.device, rank)  # (start_profile)
        logger.info(
            "engine: %s on %s (%s), %d KV pages x %d tokens, context %d",
            config.model,
            self.device,
            self.dtype,
            self.num_pages,
            ps,
            self.context_length,
        )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_pages * self.config.page_size

    def _kv_pages(self, page_size: int) -> int:
        mc, cfg = self.model_config, self.config
        if cfg.max_total_tokens is not None:
            return -(-cfg.max_total_tokens // page_size)
        if self.device.type != "cuda":
            return -(-CPU_DEFAULT_MAX_TOTAL_TOKENS // page_size)
        free, total = torch.cuda.mem_get_info(self.device)
        # memory torch's caching allocator holds but no tensor uses (an engine shut down before) is free
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        budget = int(total * cfg.mem_fraction_static) - (total - free)
        max_bs = min(cfg.cuda_graph_max_bs, cfg.max_running_requests)
        buckets = DecodeGraphs.buckets_up_to(max_bs) if self.use_cuda_graphs else []
        if buckets:  # each captured bucket keeps its float32 logits
            budget -= DecodeGraphs.logits_rows(max_bs) * mc.vocab_size * 4
        if self.backend == "flashinfer":  # its workspaces and fixed buffers, eager and per graph bucket
            num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            max_pages = -(-self.context_length // page_size)
            heads = (mc.num_heads, mc.num_kv_heads, mc.head_dim)
            budget -= flashinfer_ref.device_bytes(*heads, num_sms, buckets, max_pages)
        per_page = KVPool.bytes_per_page(mc.num_layers, page_size, mc.num_kv_heads, mc.head_dim, self.dtype)
        if budget < per_page:
            raise ValueError(
                f"no GPU memory left for the KV cache at mem_fraction_static={cfg.mem_fraction_static} "
                f"({(total - free) / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB); "
                "raise it or set max_total_tokens"
            )
        return budget // per_page

    # --- requests ----------------------------------------------------------------------------

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """Raise ValueError if the request is malformed or can never fit; returns its bad words
        tokenized (``check_prompt``)."""
        prompt_ids = truncate_prompt(prompt_ids, params.truncate_prompt_tokens, self.context_length)
        if self.config.disaggregation_mode != "null":
            # the prefill server samples the first token: the decode server never sees its logprobs
            # (and a prefill server hands on no prompt logprobs)
            for name in ("logprobs", "prompt_logprobs"):
                if getattr(params, name) is not None:
                    raise ValueError(
                        f"{name} is {getattr(params, name)}; with prefill/decode disaggregation allowed: None"
                    )
        params = resolve_max_tokens(prompt_ids, params, self.context_length, self.kv_capacity_tokens)
        vocab = self.model_config.vocab_size
        return check_prompt(
            prompt_ids, params, vocab, self.context_length, self.kv_capacity_tokens, self.tokenizer, self.eos_token_ids
        )

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        req = self.new_request(prompt_ids, params)
        self.scheduler.add(req)
        return req

    def new_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        """A checked request, not queued yet (``add_request`` queues it). One sequence: the API
        layers split ``n`` with ``SamplingParams.per_sequence``."""
        if params.n != 1:
            raise ValueError(f"n is {params.n}; a request runs one sequence (split it with per_sequence())")
        # (the front ends truncated it already: truncating it again changes nothing)
        prompt_ids = truncate_prompt(prompt_ids, params.truncate_prompt_tokens, self.context_length)
        params = resolve_max_tokens(prompt_ids, params, self.context_length, self.kv_capacity_tokens)
        bad_words_ids = self.check_request(prompt_ids, params)
        spec = params.structured_outputs
        return Request(
            rid=next(self._rids),
            prompt_ids=list(prompt_ids),
            params=params,
            max_len=len(prompt_ids) + params.max_tokens,
            generator=self.sampler.request_generator(params.seed) if params.seed is not None else None,
            detok=IncrementalDetokenizer.for_request(self.tokenizer, params, prompt_ids) if self.detokenize else None,
            bad_words_ids=bad_words_ids,
            matcher=self._matcher(spec) if spec is not None else None,
        )

    def _matcher(self, spec) -> Matcher:
        """A request's matcher, its grammar compiling from now on (``spec`` checked: ``check_prompt``)."""
        think = think_ids(self.tokenizer) if spec.reasoning is not None else None
        return Matcher(self.grammars.start(spec), spec.reasoning, think)

    def abort(self, req: Request) -> None:
        running = not req.finished
        self.scheduler.abort(req)
        if running and req.detok is not None and not req.detok.stop:
            req.detok.add(req.output_ids)  # its text so far (``stop_reason`` makes it only at the end)
        if self.delayer is not None and not self.has_unfinished():
            self.delayer.requests_left()  # no pass follows to end a wait it was held in

    def drop_prefix_cache(self) -> None:
        """Forget every cached prefix, once no request holds one: after a step cut short (Ctrl-C,
        an error), which may have handed the cache pages whose KV it never wrote."""
        cache = self.scheduler.cache
        if cache is not None and not self.scheduler.has_unfinished() and not cache.protected_pages:
            cache.reset()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[Request]:
        """One scheduling pass. Returns the requests that got a token (``token_ids[-1]``) in the
        step whose results were read in this pass; those that finished have ``finished`` set.

        Overlap on: step N+1 is scheduled and launched before step N's tokens are read, so the
        device never waits for the host; what N finishes is dropped from N+1 when N+1 is read.
        Overlap off: launch and read in the same pass.

        A step that samples a request with structured outputs whose last token is in flight (step
        N's) runs its forward at once and samples after N is read: the request's grammar must see
        that token first. Not while the request's output reasons (``Matcher.waits``): its mask is
        chosen on the device (``apply_grammars``), and overlap stays on."""
        with step_range("schedule"):
            batch = self.scheduler.schedule()
        launched = None
        if batch:
            with step_range("h2d"):
                fb, samplers, prompt = self.runner.prepare(batch)
            self.scheduler.advance(batch)
            # (a request's unread token: the one in flight; ``num_inflight`` counts this step's too)
            wait = self._in_flight is not None and any(
                r.matcher is not None and r.matcher.waits(r.output_ids, r.num_inflight > 1) for r in samplers
            )
            launched = self.runner.launch(fb, samplers, prompt, sample=not wait)
            launched.kv = [(req, req.num_computed) for req, _ in batch]
        if not self.overlap:
            self._in_flight, launched = launched, None
        with step_range("process_results"):
            done = self._commit(self._in_flight) if self._in_flight is not None else []
            self.kv_ready = self._in_flight.kv if self._in_flight is not None else []
        if launched is not None and launched.unsampled is not None:
            self.runner.sample(launched)
        self._in_flight = launched
        if batch:
            self.profiler.forward_pass()
        elif not done:
            self._wait_for_grammars()
        return done

    def _wait_for_grammars(self, timeout: float = 0.01) -> None:
        """Nothing ran: if requests wait for their grammars (``Request.grammar_hold``), block until
        one compiles (at most ``timeout`` s: the caller also takes new requests) instead of spinning."""
        held = [r.matcher.compiled for r in (*self.scheduler.running, *self.scheduler.waiting) if r.grammar_hold]
        if held:
            futures.wait(held, timeout, futures.FIRST_COMPLETED)

    def _commit(self, step: Launched) -> list[Request]:
        tokens, logprobs = self.runner.resolve(step)
        for req, first, entries in self.runner.resolve_prompt(step):
            if not req.finished:  # (an aborted request's are dropped)
                req.add_prompt_logprobs(first, entries)
        return self.scheduler.commit(step.samplers, tokens, self.stop_reason, logprobs)

    def in_flight_event(self):
        """The CUDA event of the step launched and not read yet (None: none, or not on CUDA)."""
        return self._in_flight.done if self._in_flight is not None else None

    def drain_delayer_outcomes(self) -> list:
        """The prefill delayer's per-pass outcomes since the last call (for metrics)."""
        if self.delayer is None or not self.delayer.outcomes:
            return []
        outcomes, self.delayer.outcomes = self.delayer.outcomes, []
        return outcomes

    def stats(self) -> dict[str, int]:
        """Gauges: requests running / waiting, and KV pages total / in use by requests / cached; the
        number of preemptions since start."""
        acc = self.scheduler.accounting()
        cache = self.scheduler.cache
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_pages_total": acc["total"],
            "kv_pages_in_use": acc["held_by_requests"],
            "kv_pages_cached": cache.total_pages if cache is not None else 0,
            "num_preemptions": self.scheduler.num_preemptions,  # since start (a counter)
        }

    def stop_reason(self, req: Request) -> str | None:
        """Why ``req`` stops after its newest token (None: it goes on). Text is made token by token
        only for stop strings; without them the output is decoded once, when it ends."""
        token, p = req.token_ids[-1], req.params
        # EOS or a stop token id: it is an output token, but not part of the text (as in vLLM)
        stop_token = (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_set
        incremental = req.detok is not None and bool(req.detok.stop)
        # vLLM decodes a stop token into the text only with include_stop_str_in_output
        text_token = not stop_token or p.include_stop_str_in_output
        if incremental and text_token:
            req.detok.add([token])
        reason = None
        if stop_token or (incremental and req.detok.stopped):
            reason = "stop"
        elif req.matcher is not None and token in self.eos_token_ids and req.matcher.terminated(req.output_ids):
            reason = "stop"  # the grammar is complete and took an end token (also with ignore_eos)
        elif len(req.token_ids) >= req.max_len:
            reason = "length"
        if reason is not None and req.detok is not None:
            if not incremental:
                req.detok.add(req.output_ids if text_token else req.output_ids[:-1])
            req.detok.finish()
            if req.detok.stopped:  # a stop string that ended in an unfinished character
                reason = "stop"
        return reason

    def shutdown(self) -> None:
        """Drop the model, the KV pool (held by the runner) and the scheduler's state; a profile
        still running is written first, and the traces being written are waited for."""
        self.profiler.close()  # (its failures are logged: the rest is freed all the same)
        self.grammars.shutdown()
        del self.runner, self.model, self.scheduler
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
