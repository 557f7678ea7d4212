"""The offline API: ``LLM(model).generate(prompts, sampling_params)``, as in vLLM.

With ``dp_size == 1`` the engine runs in this process. With ``dp_size > 1`` the requests go to
that many scheduler worker processes, exactly as the server sends them (same dispatch, same
text and stop-string handling), and this process gathers the outputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import uuid
import weakref
from dataclasses import dataclass, replace

from tqdm import tqdm

from minengine.config import EngineConfig
from minengine.detokenizer import stop_reason
from minengine.engine import Engine, check_prompt, resolve_max_tokens, truncation
from minengine.logprobs import Logprob, output_logprobs, prompt_offline
from minengine.models import load_tokenizer, sampling_defaults
from minengine.profiling import ProfileSpec, new_profile_name
from minengine.sampling_params import SamplingParams
from minengine.server.protocol import StartProfile, StopProfile


@dataclass
class CompletionOutput:
    """One generated sequence of a prompt (vLLM's ``CompletionOutput``)."""

    index: int  # which of the prompt's ``n`` sequences
    text: str
    token_ids: list[int]  # generated
    finish_reason: str  # "stop" | "length"
    # with finish_reason "stop", as in vLLM: the stop string or stop token id that ended the output
    # (None for an end-of-sequence token)
    stop_reason: str | int | None = None
    # with SamplingParams.logprobs, as in vLLM: per token {token id: Logprob} (the sampled token,
    # then the top ones), and the sampled tokens' summed logprob; None otherwise
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """One prompt's outputs, ``SamplingParams.n`` of them, as in vLLM. ``text``, ``token_ids``,
    ``finish_reason`` and ``stop_reason`` are the first output's (the only one when ``n`` is 1)."""

    request_id: str  # as vLLM's: a counter of this LLM's prompts, unique across its calls
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (its first sequence's), as vLLM
    # with SamplingParams.prompt_logprobs, as in vLLM: None for the first prompt token, then per
    # prompt token {token id: Logprob} (the prompt token, then the top ones); None otherwise
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason


class LLM:
    def __init__(self, model: str = "tiny", **config):
        self.config = EngineConfig.from_kwargs(model=model, **config)
        if self.config.disaggregation_mode != "null":
            raise ValueError(
                f"disaggregation_mode is {self.config.disaggregation_mode!r}; LLM runs whole requests, allowed: "
                "'null' (prefill and decode servers are started with python -m minengine.serve)"
            )
        self.sampling_defaults = sampling_defaults(self.config.model, self.config.generation_config)
        self.engine: Engine | None = None
        self._workers: _Workers | None = None
        self._request_counter = itertools.count()
        if self.config.dp_size == 1:
            self.engine = Engine(self.config)
            self.tokenizer = self.engine.tokenizer
        else:
            self.tokenizer = load_tokenizer(self.config.tokenizer or self.config.model)
            self._workers = _Workers(self.config, self.tokenizer)
        self._closed = False
        # ``del llm``, garbage collection or the interpreter's exit without ``shutdown()``: the
        # workers still get their Shutdown and the IPC folder goes (the zmq context, collected
        # without it, blocks in ``term``). An engine in this process needs none: it is freed with
        # the last reference to it (``LLM(...).engine`` keeps it working)
        self._release = None if self._workers is None else weakref.finalize(self, self._workers.shutdown)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what a generate or chat call without sampling params samples with (the model's
        generation_config.json fields, ``EngineConfig.generation_config``)."""
        return SamplingParams(**self.sampling_defaults)

    def generate(
        self,
        prompts: str | dict | list[str] | list[list[int]] | list[dict],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One output per prompt, in input order. Every request is checked before any runs."""
        self._open()
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts and _is_id(prompts[0])):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(
                f"prompts is a {type(prompts).__name__}; allowed: a string, a list of token ids, "
                "{'prompt': str}, {'prompt_token_ids': [int, ...]}, or a list of these"
            )
        texts, ids, from_text, salts = [], [], [], []
        for i, p in enumerate(prompts):
            text, p_ids = _prompt(p)
            if p_ids is None and text is None:
                raise ValueError(
                    f"prompt {i} is a {type(p).__name__}; allowed: a string, a list of token ids, "
                    "{'prompt': str} or {'prompt_token_ids': [int, ...]}"
                )
            texts.append(text)
            salts.append(p.get("cache_salt") if isinstance(p, dict) else None)
            from_text.append(p_ids is None)
            ids.append(p_ids)  # (a text is tokenized below, once its truncation is known)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        one = isinstance(sampling_params, SamplingParams) or not isinstance(sampling_params, (list, tuple))
        params = [sampling_params] * len(ids) if one else list(sampling_params)
        if len(params) != len(ids):
            raise ValueError(f"{len(params)} sampling_params for {len(ids)} prompts; give one, or one per prompt")
        r = self.engine if self._workers is None else self._workers.ready  # its context and KV capacity
        for i, (p_ids, p) in enumerate(zip(ids, params, strict=True)):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{i}] is a {type(p).__name__}; expected SamplingParams")
            try:
                if salts[i] is not None:  # vLLM's prompt key: the prefix cache of the salt's own
                    params[i] = p = replace(p, cache_salt=salts[i])
                keep = truncation(p.truncate_prompt_tokens, r.context_length)
                if from_text[i]:  # (a ValueError for a text without valid Unicode)
                    # truncated, a text's special tokens (BOS) stay, as vLLM's tokenizer truncates
                    p_ids = self.tokenizer.encode(texts[i], truncate_left=keep)
                elif keep is not None and len(p_ids) > keep:
                    p_ids = p_ids[-keep:]
                ids[i] = p_ids
                params[i] = p = resolve_max_tokens(p_ids, p, r.context_length, r.kv_capacity_tokens)
                self._check(p_ids, p)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None

        # each prompt's n sequences run as n requests (sharing the prompt's KV through the prefix cache)
        seq_ids = [p_ids for p_ids, p in zip(ids, params, strict=True) for _ in range(p.n)]
        seq_params = [q for p in params for q in p.per_sequence()]
        with tqdm(total=len(seq_ids), desc="generate", disable=not use_tqdm) as bar:
            if self._workers is not None:
                results = iter(self._workers.generate(seq_ids, seq_params, bar))
            else:
                results = iter(self._generate_here(seq_ids, seq_params, bar))
        outputs = []
        for text, p_ids, p in zip(texts, ids, params, strict=True):
            # (CompletionOutput fields..., cached tokens, prompt logprobs)
            seqs = [next(results) for _ in range(p.n)]
            completions = [CompletionOutput(j, *seq[:-2]) for j, seq in enumerate(seqs)]
            prompt_lps = prompt_offline(p_ids, seqs[0][-1], self.tokenizer)
            rid = str(next(self._request_counter))
            outputs.append(
                RequestOutput(rid, text, p_ids, completions, num_cached_tokens=seqs[0][-2], prompt_logprobs=prompt_lps)
            )
        return outputs

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` messages) or a list
        of them, each through the chat template (``chat_template``, else the checkpoint's) with the
        assistant's turn opened (``add_generation_prompt``; None: unless ``continue_final_message``,
        which ends the prompt inside the last message for the model to go on with it); one output
        per conversation, whose ``prompt`` is the rendered text. ``chat_template_kwargs``: further
        template variables (``enable_thinking``, ...); ``tools``: the tools the template shows the
        model (OpenAI-style ``{"type": "function", "function": {...}}`` dicts; the outputs' text
        has any calls as the model wrote them: ``minengine.server.tool_calls.parse_tool_calls``
        finds them)."""
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs is {chat_template_kwargs!r:.80}; allowed: a dict, or None")
        if tools is not None:  # (as vLLM: chat_template_kwargs may give its own)
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise ValueError(f"tools is {tools!r:.80}; allowed: a list of dicts, or None")
            chat_template_kwargs = {"tools": tools, **(chat_template_kwargs or {})}
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for i, conv in enumerate(conversations):
            if not isinstance(conv, list) or not conv or not all(isinstance(m, dict) and "role" in m for m in conv):
                raise ValueError(
                    f"conversation {i} is {conv!r:.80}; allowed: a non-empty list of "
                    '{"role": ..., "content": ...} dicts'
                )
            try:
                text = self.tokenizer.render_chat(
                    conv, chat_template_kwargs, add_generation_prompt, continue_final_message, chat_template
                )
            except ValueError as exc:
                raise ValueError(f"conversation {i}: {exc}") from None
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if self.engine is not None:
            self.engine.check_request(prompt_ids, params)
        else:
            r = self._workers.ready
            capacity, eos = r.kv_capacity_tokens, r.eos_token_ids
            check_prompt(prompt_ids, params, r.vocab_size, r.context_length, capacity, self.tokenizer, eos)

    def _generate_here(self, ids, params, bar) -> list[tuple]:
        reqs = [self.engine.new_request(p_ids, p) for p_ids, p in zip(ids, params, strict=True)]
        for req in reqs:  # queued only once every one is made: a bad request leaves none behind
            self.engine.scheduler.add(req)
        try:
            while self.engine.has_unfinished():
                bar.update(sum(r.finished for r in self.engine.step()))
                self.engine.drain_delayer_outcomes()  # the server's metrics read them; offline they go
        except BaseException:  # (an error in a step, or Ctrl-C): the next call must not run these first
            for r in reqs:
                if not r.finished:
                    self.engine.abort(r)
            # a step cut short after ``Scheduler.advance`` handed the prefix cache pages whose KV
            # it never wrote (and an abort caches a request's pages up to ``num_computed``)
            self.engine.drop_prefix_cache()
            raise
        results, ends = [], frozenset(self.engine.eos_token_ids)
        for r in reqs:
            last = r.output_ids[-1] if r.output_ids else None
            why = stop_reason(r.finish_reason, r.detok, last, r.params, self.tokenizer.eos_token_id, ends)
            logprobs = output_logprobs(r.output_ids, r.output_logprobs, self.tokenizer)
            results.append((r.text, r.output_ids, r.finish_reason, why, *logprobs, r.cached_tokens, r.prompt_logprobs))
        return results

    def start_profile(
        self,
        output_dir: str | None = None,
        num_steps: int | None = None,
        activities: list[str] | None = None,
        record_shapes: bool = False,
        with_stack: bool = True,
    ) -> list[str]:
        """Profile the engine (every data-parallel worker), as a server's ``/start_profile``: a
        torch.profiler Chrome trace per worker in ``output_dir``, written at ``stop_profile`` or
        after ``num_steps`` forward passes (the generate calls run them; with ``dp_size`` 1, only
        those of the thread that started it are recorded). ``activities``: from
        ``profiling.ACTIVITIES`` (None: CPU, and GPU on CUDA). The traces' paths."""
        self._open()
        if activities is not None and not isinstance(activities, (list, tuple)):
            raise ValueError(f"activities is {activities!r}; allowed: a list of names, such as ['CPU', 'GPU']")
        where = None if output_dir is None else os.path.abspath(output_dir)
        kinds = None if activities is None else tuple(activities)
        spec = ProfileSpec(where, new_profile_name(), kinds, num_steps, record_shapes, with_stack)
        return self._profile(StartProfile(spec))

    def stop_profile(self) -> list[str]:
        """Stop the profile ``start_profile`` began (or take the one ``num_steps`` ended) once its
        traces are written; their paths."""
        self._open()
        return self._profile(StopProfile())

    def _profile(self, msg: StartProfile | StopProfile) -> list[str]:
        if self.engine is not None:
            if isinstance(msg, StartProfile):
                self.engine.profiler.wait_for_writes()  # (one that num_steps ended, say)
                path = self.engine.profiler.start(msg.spec)
            else:
                path = self.engine.profiler.stop().result()
            return [path] if path else []
        from minengine.server.frontend import ProfileFailed

        try:
            return self._workers.loop.run_until_complete(self._workers.workers.client.profile_traces(msg))
        except ProfileFailed as exc:
            raise (ValueError if exc.user_error else RuntimeError)(str(exc)) from None

    def _open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM was shut down; create a new one")

    def shutdown(self) -> None:
        """Free the model(s) and the KV cache (GPU memory included). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self._release is not None:
            self._release()  # the workers' shutdown, once
        self._workers = None


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _prompt(p) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of one prompt as vLLM takes it: a string, token ids, or the TextPrompt /
    TokensPrompt dicts (their ``cache_salt`` is the caller's to read); (None, None) for anything
    else."""
    if isinstance(p, str):
        return p, None
    if isinstance(p, (list, tuple)):
        return None, list(p)
    if isinstance(p, dict):
        if isinstance(p.get("prompt_token_ids"), (list, tuple)):
            return p.get("prompt") if isinstance(p.get("prompt"), str) else None, list(p["prompt_token_ids"])
        if isinstance(p.get("prompt"), str):
            return p["prompt"], None
    return None, None


class _Workers:
    """The data-parallel workers behind an offline LLM, driven on a private event loop."""

    def __init__(self, config: EngineConfig, tokenizer):
        from minengine.server.metrics import Metrics
        from minengine.server.workers import Workers

        if _loop_running():
            raise RuntimeError(
                f"dp_size is {config.dp_size}: the offline LLM then drives its workers on an event loop of its own, "
                "which cannot run inside a running one (async code, a notebook cell); allowed there: dp_size 1, "
                "or the server (python -m minengine.serve)"
            )
        self.pid = os.getpid()  # (a forked child that exits runs the finalizer too: not its workers)
        self.tokenizer = tokenizer
        self.metrics = Metrics()
        self.loop = asyncio.new_event_loop()
        try:
            self.workers = Workers(config, self.metrics)  # (on an error it cleans up after itself)
        except BaseException:
            self.loop.close()
            raise
        try:
            self.ready = self.loop.run_until_complete(self.workers.start())
        except BaseException:
            self.shutdown()
            raise

    def generate(self, ids, params, bar) -> list[tuple]:
        from minengine.server.frontend import generate

        async def one(prompt_ids: list[int], p: SamplingParams) -> tuple:
            tokens, text, reason, stop_reason, cached, prompt_entries = [], "", "abort", None, 0, None
            entries = [] if p.logprobs is not None else None
            pieces = generate(self.workers.client, self.tokenizer, self.metrics, uuid.uuid4().hex, prompt_ids, p)
            async for piece in pieces:
                tokens += piece.token_ids
                text += piece.text
                reason, stop_reason = piece.finish_reason or reason, piece.stop_reason
                cached += piece.cached_tokens
                if piece.prompt_logprobs is not None:  # (with the first piece)
                    prompt_entries = piece.prompt_logprobs
                if entries is not None:
                    entries += piece.logprobs
            bar.update(1)
            logprobs = output_logprobs(tokens, entries, self.tokenizer)
            return text, tokens, reason, stop_reason, *logprobs, cached, prompt_entries

        tasks = [self.loop.create_task(one(i, p)) for i, p in zip(ids, params, strict=True)]
        everything = asyncio.gather(*tasks)
        try:
            return self.loop.run_until_complete(everything)
        except BaseException:  # (Ctrl-C, an error in one request): the others are aborted in the workers
            # cancel each request's task, not the gather (done already when one task failed, and
            # then its cancel() reaches none): each cancelled generator aborts its request
            for task in tasks:
                task.cancel()
            with contextlib.suppress(BaseException):
                self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            with contextlib.suppress(BaseException):  # (read: raised below, not logged as never retrieved)
                everything.exception()
            raise

    def shutdown(self) -> None:
        if os.getpid() != self.pid:
            return

        def close() -> None:
            self.workers.client.shutdown()
            self.workers.client.close()

        async def close_in_loop() -> None:  # (where the client's sockets are closed as a rule)
            close()

        try:
            if _loop_running():  # another event loop runs in this thread (a finalizer inside async code)
                close()
            else:
                self.loop.run_until_complete(close_in_loop())
        finally:
            try:
                self.workers.stop()
            finally:
                self.loop.close()
