"""The paged KV cache: per layer, K and V of ``[num_pages, page_size, Hkv, D]``.

One allocation of ``[num_layers, num_pages, 2, page_size, Hkv, D]``; each layer's K and V are
strided views of it (the kernels take strides).
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_pages, self.page_size = num_pages, page_size
        self.kv = torch.zeros((num_layers, num_pages, 2, page_size, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.layers = [(self.kv[i, :, 0], self.kv[i, :, 1]) for i in range(num_layers)]

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * page_size * num_kv_heads * head_dim * dtype.itemsize


class PageTable:
    """Request slot -> its page ids, kept on the device; a batch's ``block_tables`` are rows of it."""

    def __init__(self, max_requests: int, max_pages_per_request: int, device: torch.device):
        self.table = torch.zeros((max_requests, max_pages_per_request), dtype=torch.int32, device=device)
        self._free_slots = list(range(max_requests - 1, -1, -1))

    def acquire(self) -> int:
        return self._free_slots.pop()

    def release(self, slot: int) -> None:
        self._free_slots.append(slot)

    def write(self, slot: int, start: int, pages: list[int]) -> None:
        if pages:
            self.table[slot, start : start + len(pages)] = torch.tensor(pages, dtype=torch.int32)
