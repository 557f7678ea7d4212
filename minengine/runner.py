"""The model runner: one forward and sampling per step, launched without waiting for the device.

Decode inputs are the tokens the previous step sampled. They stay on the device in
``token_buffer`` (the future map, one slot per request) and reach ``input_ids`` through
``gather_input_ids``; prefill tokens come from the host. All host data of a step (prefill ids,
positions, slots, block-table rows, lengths) goes to the device at forward entry through pinned
memory with non-blocking copies. A backend that plans on the host (flashinfer) is handed the host
lists of that metadata (``KernelSet.stage``), so it never reads the device back. ``launch``
returns at once; ``resolve`` waits for the sampled tokens. On CPU the same path simply runs
synchronously.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minengine.cuda_graph import DecodeGraphs
from minengine.memory import KVPool, PageTable
from minengine.memory.kv_pool import to_device, to_device_packed
from minengine.models import CausalLM, ForwardBatch
from minengine.ops import HostMetadata, KernelSet
from minengine.profiling import step_range
from minengine.request import Request, TokenLogprobs
from minengine.sampler import Sampler


@dataclass
class Launched:
    """A step in flight: the requests that sample, and where their tokens will land on the host."""

    samplers: list[Request]
    tokens: torch.Tensor | None  # host (pinned on CUDA); None until it is sampled
    done: torch.cuda.Event | None
    kv: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens with KV once it is done)
    # the rows (of ``samplers``) that asked for logprobs, and on the host (written by ``done``):
    # [rows, 1 + k] float32 (the sampled token's logprob, then the top k's) and int64 (its rank,
    # then the top k's ids), k the largest number asked for
    logprobs: tuple[list[int], torch.Tensor, torch.Tensor] | None = None
    # prompt logprobs, laid out as ``logprobs`` (one row per scored prompt token): each span's
    # (request, its first prompt position, rows), and the two host tensors
    prompt_logprobs: tuple[list[tuple[Request, int, int]], torch.Tensor, torch.Tensor] | None = None
    # launched with its sampling left for later (``ModelRunner.sample``): its forward's (logits,
    # each row's argmax or None, hidden states for prompt logprobs or None, prompt rows or None),
    # and the samplers' slots in ``token_buffer`` (read at launch: a request that ends meanwhile frees its slot)
    unsampled: tuple | None = None


@dataclass
class PromptRows:
    """The prompt positions a step scores (``SamplingParams.prompt_logprobs``): their rows follow
    the samplers' in ``logits_indices``; ``targets``: the prompt token each row predicts."""

    spans: list[tuple[Request, int, int]]  # (request, first position, count), in row order
    targets: torch.Tensor  # [R] int64, on the device


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        page_table: PageTable,
        kernels: KernelSet,
        sampler: Sampler,
        max_requests: int,
    ):
        self.model, self.pool, self.page_table = model, pool, page_table
        self.kernels, self.sampler = kernels, sampler
        self.device = pool.kv.device
        self.token_buffer = torch.zeros(max_requests, dtype=torch.int64, device=self.device)
        self.graphs: DecodeGraphs | None = None  # set by the engine on CUDA

    def prepare(self, batch: list[tuple[Request, int]]) -> tuple[ForwardBatch, list[Request], PromptRows | None]:
        """Device inputs of a batch (prefill chunks first, then decodes), the requests whose next
        token it samples, and the prompt positions it scores (None: none). Reads the requests as
        scheduled, before the step advances them."""
        ps = self.pool.page_size
        prefill_ids, positions, slots, seq_lens, cu, rows = [], [], [], [], [0], []
        logits_rows, samplers = [], []
        prompt_rows, targets, spans = [], [], []
        num_prefills, max_q = 0, 1
        for req, n in batch:
            if not req.prefilling:
                break  # the decodes, below
            num_prefills += 1
            start = req.num_computed
            end = start + n
            prefill_ids += req.token_ids[start:end]
            positions += range(start, end)
            slots += [req.pages[p // ps] * ps + p % ps for p in range(start, end)]
            seq_lens.append(end)
            if req.scores_prompt:  # the positions whose next token is a prompt token not scored yet
                lo, hi = max(start, req.num_prompt_logprobs), min(end, len(req.prompt_ids) - 1)
                if lo < hi:
                    prompt_rows += range(cu[-1] + lo - start, cu[-1] + hi - start)
                    targets += req.prompt_ids[lo + 1 : hi + 1]
                    spans.append((req, lo, hi - lo))
            cu.append(cu[-1] + n)
            rows.append(req.slot)
            max_q = max(max_q, n)
            if end == req.num_tokens:  # every known token computed: sample the next
                logits_rows.append(cu[-1] - 1)
                samplers.append(req)
        # Decodes: one token each, the last sampled one (maybe still on the device only), so each
        # samples. Whole-list comprehensions, cheaper per request than the loop above: decode
        # batches are the engine's largest and most frequent.
        decodes = [req for req, _ in batch[num_prefills:]]
        decode_slots = [req.slot for req in decodes]
        starts = [req.num_computed for req in decodes]
        positions += starts
        slots += [req.pages[start // ps] * ps + start % ps for req, start in zip(decodes, starts, strict=True)]
        seq_lens += [start + 1 for start in starts]
        first = cu[-1]
        cu += range(first + 1, first + len(decodes) + 1)
        rows += decode_slots
        logits_rows += range(first, first + len(decodes))
        samplers += decodes

        dev = self.device
        self.page_table.flush()
        # two pinned buffers and two copies for the whole step, not one per list
        lists = [prefill_ids, decode_slots, positions, slots, rows, logits_rows + prompt_rows]
        prefill_t, decode_t, positions_t, slots_t, rows_t, logits_t, *targets_t = to_device_packed(
            lists + [targets] if spans else lists, torch.int64, dev
        )
        seq_lens_t, cu_t = to_device_packed([seq_lens, cu], torch.int32, dev)
        fb = ForwardBatch(
            input_ids=self.kernels.gather_input_ids(prefill_t, self.token_buffer, decode_t),
            positions=positions_t,
            slot_mapping=slots_t,
            block_tables=self.page_table.table[rows_t],
            seq_lens=seq_lens_t,
            cu_seqlens_q=cu_t,
            max_seqlen_q=max_q,
            logits_indices=logits_t,
        )
        if self.kernels.stage is not None:
            self.kernels.stage(fb.block_tables, fb.seq_lens, fb.cu_seqlens_q, HostMetadata(seq_lens, cu))
        return fb, samplers, PromptRows(spans, targets_t[0]) if spans else None

    def launch(
        self, fb: ForwardBatch, samplers: list[Request], prompt: PromptRows | None = None, sample: bool = True
    ) -> Launched:
        """Run the forward and (``sample``) sampling; sampled tokens go to ``token_buffer`` on the
        device and are copied to the host without blocking (with the logprobs asked for).
        ``sample=False``: the forward only, its sampling left to ``sample`` (called before the next
        launch), for samplers whose grammar must first see the step in flight's tokens."""
        sample_slots = to_device([req.slot for req in samplers], torch.int64, self.device)
        num_tokens = fb.input_ids.shape[0]
        # decode-only, every row samples
        graphable = fb.max_seqlen_q == 1 and len(samplers) == num_tokens and prompt is None
        greedy = hidden = None  # each row's argmax, when the forward computed it (a graph)
        with step_range("forward"):
            if self.graphs is not None and graphable and self.graphs.bucket(num_tokens) is not None:
                logits, greedy = self.graphs.run(fb)
            elif prompt is None:
                logits = self.model(fb, self.pool.layers, self.kernels)
            else:  # the samplers' logits; the scored prompt rows' only slice by slice, below
                hidden = self.model.hidden(fb, self.pool.layers, self.kernels)
                logits = self.model.logits(hidden[: len(samplers)])
        step = Launched(samplers, None, None)
        step.unsampled = (logits, greedy, hidden, prompt, sample_slots)
        if sample:
            self.sample(step)
        return step

    def sample(self, step: Launched) -> None:
        """Sample a launched step's tokens (and its logprobs), from its forward's logits."""
        logits, greedy, hidden, prompt, sample_slots = step.unsampled
        step.unsampled = None
        samplers = step.samplers
        with step_range("sampling"):
            tokens = self.sampler(logits, samplers, greedy, self.token_buffer)
        self.token_buffer[sample_slots] = tokens
        asked = [i for i, req in enumerate(samplers) if req.params.logprobs is not None]
        if asked:
            with step_range("logprobs"):
                k = max(samplers[i].params.logprobs for i in asked)
                rows = None if len(asked) == len(samplers) else to_device(asked, torch.int64, self.device)
                values, ids = token_logprobs(logits, tokens, rows, k)
        scored = None
        if prompt is not None:
            with step_range("prompt_logprobs"):
                k = max(req.params.prompt_logprobs for req, _, _ in prompt.spans)
                scored = prompt_logprobs(self.model, hidden[len(samplers) :], prompt.targets, k)
        if self.device.type != "cuda":
            # a graph's output is overwritten by the next step, launched before this one is read
            step.tokens = tokens if greedy is None else tokens.clone()
            step.logprobs = (asked, values, ids) if asked else None
            step.prompt_logprobs = None if scored is None else (prompt.spans, *scored)
            return
        # every copy to the host queued before the event that ``resolve`` waits for
        host = [_to_host(x) for x in (tokens, *((values, ids) if asked else ()), *(scored or ()))]
        step.done = torch.cuda.Event()
        step.done.record()
        step.tokens = host[0]
        step.logprobs = (asked, host[1], host[2]) if asked else None
        step.prompt_logprobs = None if scored is None else (prompt.spans, host[-2], host[-1])

    @staticmethod
    def resolve(step: Launched) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """The step's sampled tokens, and each sampler's logprobs (None for those that did not ask;
        None for the whole list if none did). Waits for the device."""
        if step.done is not None:
            step.done.synchronize()
        if step.logprobs is None:
            return step.tokens.tolist(), None
        asked, values, ids = step.logprobs
        per_sampler: list[TokenLogprobs | None] = [None] * len(step.samplers)
        for i, v, t in zip(asked, values.tolist(), ids.tolist(), strict=True):
            per_sampler[i] = _entry(v, t, step.samplers[i].params.logprobs)
        return step.tokens.tolist(), per_sampler

    @staticmethod
    def resolve_prompt(step: Launched) -> list[tuple[Request, int, list[TokenLogprobs]]]:
        """The step's prompt logprobs: (request, first prompt position, one entry per position
        from there). Call after ``resolve`` (which waits for the device)."""
        if step.prompt_logprobs is None:
            return []
        spans, values, ids = step.prompt_logprobs
        values, ids, out, row = values.tolist(), ids.tolist(), [], 0
        for req, first, count in spans:
            k = req.params.prompt_logprobs
            entries = [_entry(v, t, k) for v, t in zip(values[row : row + count], ids[row : row + count], strict=True)]
            out.append((req, first, entries))
            row += count
        return out


def _entry(values: list[float], ids: list[int], k: int) -> TokenLogprobs:
    """One row of ``token_logprobs`` (read to the host) as a ``TokenLogprobs``, cut to the ``k``
    top tokens its request asked for (the row holds the step's largest k)."""
    return values[0], ids[0], ids[1 : 1 + k], values[1 : 1 + k]


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``rows`` of ``logits`` [S, V] (None: all) and their sampled ``tokens`` [S]: ([R, 1 + k]
    float32: the sampled token's log-probability, then the k most likely tokens'; [R, 1 + k] int64:
    the sampled token's rank in the vocabulary (1: the most likely), then the k tokens' ids). Raw
    logprobs, as vLLM's default: the model's distribution before temperature and filters."""
    if rows is not None:
        logits, tokens = logits.index_select(0, rows), tokens.index_select(0, rows)
    logp = logits.float().log_softmax(-1)
    sampled = logp.gather(1, tokens[:, None])
    rank = (logp >= sampled).sum(-1, keepdim=True)  # as vLLM: tokens tied with it count before it
    top = logp.topk(k, -1) if k else (logp[:, :0], rank[:, :0])
    return torch.cat([sampled, top[0]], 1), torch.cat([rank, top[1]], 1)


# elements of float32 logits a prompt-logprobs slice holds (128 MiB; with the log-softmax and the
# rank's comparison about 300 MiB at its peak): a whole chunk's rows at once would take rows x
# vocabulary x 4 bytes, twice (4.9 GB each for 8192 rows of a 150k vocabulary)
PROMPT_SLICE_ELEMENTS = 1 << 25


def prompt_logprobs(
    model: CausalLM, hidden: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs`` of prompt rows from their final hidden states [R, H], whose next
    tokens are ``targets`` [R]: logits made and reduced a slice of rows at a time."""
    rows = max(1, PROMPT_SLICE_ELEMENTS // model.config.vocab_size)
    parts = [
        token_logprobs(model.logits(h), t, None, k)
        for h, t in zip(hidden.split(rows), targets.split(rows), strict=True)
    ]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of device tensor ``x``, made without blocking (valid once the stream
    has passed this point)."""
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    return host
