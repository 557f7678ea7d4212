"""The paged KV cache: per layer, K and V of ``[num_pages, page_size, Hkv, D]``.

One allocation of ``[num_layers, num_pages, 2, page_size, Hkv, D]``; each layer's K and V are
strided views of it (the kernels take strides).
"""

from __future__ import annotations

import itertools

import numpy as np
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
    """Request slot -> its page ids, kept on the device; a batch's ``block_tables`` are rows of it.

    Writes made while scheduling are only recorded; ``flush()`` applies them at forward entry in
    one pinned, non-blocking copy, so the scheduling path makes no host-to-device copies."""

    def __init__(self, max_requests: int, max_pages_per_request: int, device: torch.device):
        self.table = torch.zeros((max_requests, max_pages_per_request), dtype=torch.int32, device=device)
        self._free_slots = list(range(max_requests - 1, -1, -1))
        # NOTE: keyed by (slot, column) so a flush never holds one index twice: index_put_ with
        # duplicate indices picks an arbitrary winner on CUDA (a slot reused after an abort would
        # otherwise race with the writes queued for its previous request).
        self._pending: dict[tuple[int, int], int] = {}

    def acquire(self) -> int:
        return self._free_slots.pop()

    def release(self, slot: int) -> None:
        self._free_slots.append(slot)

    def write(self, slot: int, start: int, pages: list[int]) -> None:
        for col, page in enumerate(pages, start):
            self._pending[slot, col] = page

    def flush(self) -> None:
        if not self._pending:
            return
        rows, cols, pages = to_device_packed(
            [[r for r, _ in self._pending], [c for _, c in self._pending], list(self._pending.values())],
            torch.int64,
            self.table.device,
        )
        self.table.index_put_((rows, cols), pages.to(torch.int32))
        self._pending = {}


def to_device_packed(lists: list[list], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Several host lists on the device through one buffer (one pinned, non-blocking copy on CUDA):
    contiguous views of it, in order."""
    sizes = [len(values) for values in lists]
    flat = to_device(itertools.chain.from_iterable(lists), dtype, device, count=sum(sizes))
    return list(flat.split(sizes))


# NOTE: numpy reads a list of Python ints about 3x faster than torch.tensor does (1.5k ints: 36 us
# against 130 us on the build machine), and the scheduler's path converts several such lists a step
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}
_INT32 = (-(2**31), 2**31 - 1)
# numpy 2 refuses a Python int out of the dtype's range; numpy 1 wraps it into int32 (with a warning)
_WRAPS_INT32 = int(np.__version__.split(".")[0]) < 2


def to_device(values, dtype: torch.dtype, device: torch.device, count: int = -1) -> torch.Tensor:
    """Host values (a list, or an iterable of exactly ``count`` values) on the device: through pinned
    memory and a non-blocking copy on CUDA. A value out of the dtype's range raises OverflowError.
    A numpy array of the dtype's own type is taken as it is (no copy on the host)."""
    if isinstance(values, np.ndarray) and values.dtype == _NUMPY.get(dtype):
        host = torch.from_numpy(np.ascontiguousarray(values))
    elif dtype not in _NUMPY:
        host = torch.tensor(list(values), dtype=dtype)
    elif dtype is torch.int32 and _WRAPS_INT32:  # through int64 and a range check
        wide = np.fromiter(values, dtype=np.int64, count=count)
        if wide.size and (wide.min() < _INT32[0] or wide.max() > _INT32[1]):
            bad = int(wide[(wide < _INT32[0]) | (wide > _INT32[1])][0])
            raise OverflowError(f"value {bad} is out of the int32 range [{_INT32[0]}, {_INT32[1]}]")
        host = torch.from_numpy(wide.astype(np.int32))
    else:
        host = torch.from_numpy(np.fromiter(values, dtype=_NUMPY[dtype], count=count))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
