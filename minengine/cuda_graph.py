"""Decode steps through CUDA graphs captured per batch-size bucket.

A decode-only batch of ``bs`` requests is padded to the smallest captured bucket ``B >= bs``:
the padded tokens have KV slot -1 (``store_kv`` skips them) and belong to no sequence (the
padded sequences have ``q_len = 0`` and ``seq_len = 0``, so attention reads nothing for them and
writes their rows as zeros). The graph runs the whole model, attention kernels included, into a
static logits buffer, and greedy sampling (each row's argmax) after it. The other sampling stays
eager, as in vLLM and SGLang: which filters run, and each seeded request's generator, are decided
per step on the host; it overwrites the rows of the requests that do not decode greedily.

Graphs are captured at start-up, largest bucket first, into one memory pool. With
``use_graphs=False`` the same padded path runs eagerly; that is how CPU tests check the padding.
A backend that plans on the host (flashinfer) is told the bucket and the real batch around each
capture and replay (``KernelSet.graph_bucket``): it plans there, outside the graph.
"""

from __future__ import annotations

import contextlib

import torch
from tqdm import tqdm

from minengine.memory import KVPool
from minengine.models import CausalLM, ForwardBatch
from minengine.ops import KernelSet

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        kernels: KernelSet,
        max_bs: int,
        max_pages_per_request: int,
        use_graphs: bool,
    ):
        self.model, self.pool, self.kernels = model, pool, kernels
        self.buckets = self.buckets_up_to(max_bs)
        device = pool.kv.device
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((n, max_pages_per_request), dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}  # logits, argmax
        if use_graphs:
            self._capture_all()

    @staticmethod
    def buckets_up_to(max_bs: int) -> list[int]:
        return [b for b in BUCKETS if b < max_bs] + [max_bs]

    @staticmethod
    def logits_rows(max_bs: int) -> int:
        """Rows of logits the captured graphs keep, summed over buckets (for the memory budget)."""
        return sum(DecodeGraphs.buckets_up_to(max_bs))

    def bucket(self, bs: int) -> int | None:
        return next((b for b in self.buckets if b >= bs), None)

    def _static_batch(self, b: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:b],
            positions=self.positions[:b],
            slot_mapping=self.slot_mapping[:b],
            block_tables=self.block_tables[:b],
            seq_lens=self.seq_lens[:b],
            cu_seqlens_q=self.cu_seqlens_q[: b + 1],
            max_seqlen_q=1,
            logits_indices=self.rows[:b],
        )

    def _bucket(self, b: int, fb: ForwardBatch | None = None) -> contextlib.AbstractContextManager:
        """The backend's plan for bucket ``b`` of batch ``fb`` (None: a capture), where it has one."""
        if self.kernels.graph_bucket is None:
            return contextlib.nullcontext()
        metadata = None if fb is None else (fb.block_tables, fb.seq_lens, fb.cu_seqlens_q)
        return self.kernels.graph_bucket(b, self.block_tables, metadata)

    def _capture_all(self) -> None:
        mempool = torch.cuda.graph_pool_handle()
        self._fill_padding(0, self.buckets[-1])  # capture with nothing to read or write in the KV cache
        for b in tqdm(list(reversed(self.buckets)), desc="capturing CUDA graphs"):
            fb = self._static_batch(b)
            with self._bucket(b):
                for _ in range(2):  # compile the kernels for this shape (and plan) outside the graph
                    self._forward(fb)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mempool):
                    logits, greedy = self._forward(fb)
            self.graphs[b] = (graph, logits, greedy)
        torch.cuda.synchronize()

    def _forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(fb, self.pool.layers, self.kernels)
        return logits, logits.argmax(-1)

    def _fill_padding(self, bs: int, b: int) -> None:
        self.input_ids[bs:b] = 0
        self.positions[bs:b] = 0
        self.slot_mapping[bs:b] = -1
        self.seq_lens[bs:b] = 0
        self.cu_seqlens_q[bs + 1 : b + 1] = bs

    def run(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of a decode-only batch (every row samples) through the padded path, and each row's
        greedy token. Both are views of the bucket's static outputs: read them before the next run."""
        bs = fb.input_ids.shape[0]
        b = self.bucket(bs)
        self.input_ids[:bs].copy_(fb.input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.slot_mapping[:bs].copy_(fb.slot_mapping)
        self.block_tables[:bs].copy_(fb.block_tables)
        self.seq_lens[:bs].copy_(fb.seq_lens)
        self.cu_seqlens_q[: bs + 1].copy_(fb.cu_seqlens_q)
        self._fill_padding(bs, b)
        with self._bucket(b, fb):
            if b in self.graphs:
                graph, logits, greedy = self.graphs[b]
                graph.replay()
            else:
                logits, greedy = self._forward(self._static_batch(b))
        return logits[:bs], greedy[:bs]
