"""The model runner: turns a scheduled batch into device tensors, runs one forward, samples."""

from __future__ import annotations

import torch

from minengine.memory import KVPool, PageTable
from minengine.models import CausalLM, ForwardBatch
from minengine.ops import KernelSet
from minengine.request import Request
from minengine.sampler import Sampler


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool, page_table: PageTable, kernels: KernelSet, sampler: Sampler):
        self.model, self.pool, self.page_table = model, pool, page_table
        self.kernels, self.sampler = kernels, sampler
        self.device = pool.kv.device

    def prepare(self, batch: list[tuple[Request, int]]) -> tuple[ForwardBatch, list[Request]]:
        ps = self.pool.page_size
        input_ids, positions, slots, seq_lens, cu, rows, logits_rows, samplers = [], [], [], [], [0], [], [], []
        for req, n in batch:
            start = req.num_computed
            input_ids += req.token_ids[start : start + n]
            span = range(start, start + n)
            positions += span
            slots += [req.pages[p // ps] * ps + p % ps for p in span]
            seq_lens.append(start + n)
            cu.append(cu[-1] + n)
            rows.append(req.slot)
            if start + n == len(req.token_ids):  # all known tokens computed: sample the next
                logits_rows.append(cu[-1] - 1)
                samplers.append(req)

        def dev(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        fb = ForwardBatch(
            input_ids=dev(input_ids, torch.int64),
            positions=dev(positions, torch.int64),
            slot_mapping=dev(slots, torch.int64),
            block_tables=self.page_table.table[dev(rows, torch.int64)],
            seq_lens=dev(seq_lens, torch.int32),
            cu_seqlens_q=dev(cu, torch.int32),
            max_seqlen_q=max(n for _, n in batch),
            logits_indices=dev(logits_rows, torch.int64),
        )
        return fb, samplers

    def run(self, batch: list[tuple[Request, int]]) -> dict[Request, int]:
        """One forward over the whole mixed batch; the sampled token of each request that samples."""
        fb, samplers = self.prepare(batch)
        logits = self.model(fb, self.pool.layers, self.kernels)
        if not samplers:
            return {}
        return dict(zip(samplers, self.sampler(logits, samplers), strict=True))
