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
from minengine.request import Request
from minengine.sampler import Sampler


@dataclass
class Launched:
    """A step in flight: the requests that sample, and where their tokens will land on the host."""

    samplers: list[Request]
    tokens: torch.Tensor  # host (pinned on CUDA)
    done: torch.cuda.Event | None
    kv: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens with KV once it is done)


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

    def prepare(self, batch: list[tuple[Request, int]]) -> tuple[ForwardBatch, list[Request]]:
        """Device inputs of a batch (prefill chunks first, then decodes), and the requests whose
        next token it samples. Reads the requests as scheduled, before the step advances them."""
        ps = self.pool.page_size
        prefill_ids, positions, slots, seq_lens, cu, rows = [], [], [], [], [0], []
        logits_rows, samplers = [], []
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
        prefill_t, decode_t, positions_t, slots_t, rows_t, logits_t = to_device_packed(
            [prefill_ids, decode_slots, positions, slots, rows, logits_rows], torch.int64, dev
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
        return fb, samplers

    def launch(self, fb: ForwardBatch, samplers: list[Request]) -> Launched:
        """Run the forward and sampling; sampled tokens go to ``token_buffer`` on the device and
        are copied to the host without blocking."""
        sample_slots = to_device([req.slot for req in samplers], torch.int64, self.device)
        num_tokens = fb.input_ids.shape[0]
        graphable = fb.max_seqlen_q == 1 and len(samplers) == num_tokens  # decode-only, every row samples
        greedy = None  # each row's argmax, when the forward computed it (a graph)
        with step_range("forward"):
            if self.graphs is not None and graphable and self.graphs.bucket(num_tokens) is not None:
                logits, greedy = self.graphs.run(fb)
            else:
                logits = self.model(fb, self.pool.layers, self.kernels)
        with step_range("sampling"):
            tokens = self.sampler(logits, samplers, greedy)
        self.token_buffer[sample_slots] = tokens
        if self.device.type != "cuda":
            # a graph's output is overwritten by the next step, launched before this one is read
            return Launched(samplers, tokens if greedy is None else tokens.clone(), None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return Launched(samplers, host, done)

    @staticmethod
    def resolve(step: Launched) -> list[int]:
        """The step's sampled tokens (waits for the device)."""
        if step.done is not None:
            step.done.synchronize()
        return step.tokens.tolist()
