"""Page allocator: hands out KV-cache page ids, all or nothing."""

from __future__ import annotations


class PageAllocator:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: low ids first
        self._is_free = bytearray([1]) * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` pages, or None (and nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        pages = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._is_free[p]:
                raise RuntimeError(f"page {p} freed twice")
            self._is_free[p] = 1
        self._free.extend(reversed(pages))
