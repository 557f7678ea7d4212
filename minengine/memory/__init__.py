"""KV memory: the paged pool, the page allocator, the request-to-pages table, the radix cache."""

from minengine.memory.allocator import PageAllocator
from minengine.memory.kv_pool import KVPool, PageTable
from minengine.memory.radix_cache import Node, RadixCache

__all__ = ["KVPool", "Node", "PageAllocator", "PageTable", "RadixCache"]
