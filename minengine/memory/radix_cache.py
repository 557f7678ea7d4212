"""Radix prefix cache over KV pages (SGLang-style, page-aligned).

Each node holds a run of whole pages: ``key`` (its tokens, a multiple of ``page_size`` long) and
``pages`` (their KV page ids). Children are keyed by the tokens of their first page. A request
locks the node its prefix ends at (``lock``), which protects the whole path to the root; pages of
unlocked leaves are evicted least-recently-used first when the allocator runs short.

Page ownership: pages in the tree belong to the cache. ``insert`` reports how many leading
tokens were already cached, so the caller can free its duplicate pages.

A cache salt (vLLM's ``cache_salt``) gives its requests a tree of their own, under a root of its
own: they share KV only with requests of the same salt. A salt's root is made by a match and kept
from its first ``lock`` (a request waiting with a salt costs nothing); ``sweep`` forgets the roots
no page is under and no request holds.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

_clock = itertools.count()


class Node:
    __slots__ = ("children", "parent", "key", "pages", "lock_ref", "last_access")

    def __init__(self, parent: Node | None, key: list[int], pages: list[int]):
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent = parent
        self.key = key
        self.pages = pages
        self.lock_ref = 0
        self.last_access = next(_clock)


class _Root(Node):
    """A salt's root (``RadixCache.root_of``)."""

    __slots__ = ("salt",)

    def __init__(self, salt: str):
        super().__init__(None, [], [])
        self.salt = salt
        self.lock_ref = 1  # the tree's own: with only this one and no page under it, sweep forgets it


class RadixCache:
    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None]):
        self.page_size = page_size
        self._free_pages = free_pages
        self.root = Node(None, [], [])
        self.root.lock_ref = 1  # never evicted
        self.roots: dict[str | None, Node] = {None: self.root}  # by cache salt
        self._sweep_at = 64  # sweep once there are this many roots
        self.total_pages = 0
        self.protected_pages = 0  # pages in locked nodes
        # bumped when pages enter or leave the tree: a match made at an older version may be stale
        # (splits keep a match valid: the matched path still ends at the same node)
        self.version = 0

    @property
    def evictable_pages(self) -> int:
        return self.total_pages - self.protected_pages

    def root_of(self, salt: str | None) -> Node:
        """The root of ``salt``'s tree; for a salt without one, a new root that ``lock`` keeps."""
        root = self.roots.get(salt)
        return _Root(salt) if root is None else root

    def sweep(self) -> None:
        """Forget the salts' roots with no page under them that no request holds, once there are
        many roots (the walk is over all of them: amortized, a few per salt a request held). A
        match may still end at such a root: ``lock`` takes the salt's root then."""
        if len(self.roots) < self._sweep_at:
            return
        bare = [s for s, r in self.roots.items() if r is not self.root and not r.children and r.lock_ref == 1]
        for salt in bare:
            del self.roots[salt]
        self._sweep_at = max(64, 2 * len(self.roots))

    def match_prefix(self, tokens: list[int], salt: str | None = None) -> tuple[list[int], Node]:
        """Pages of the longest cached page-aligned prefix of ``tokens`` in ``salt``'s tree, and the
        node it ends at."""
        ps = self.page_size
        node, pages, i = self.root_of(salt), [], 0
        while i + ps <= len(tokens):
            child = node.children.get(tuple(tokens[i : i + ps]))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, i, len(tokens))
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = next(_clock)
            pages += child.pages
            i += n * ps
            node = child
        return pages, node

    def insert(self, tokens: list[int], pages: list[int], salt: str | None = None) -> int:
        """Cache the full pages of ``tokens`` (KV in ``pages``) in ``salt``'s tree; returns how many
        tokens were cached already: the caller's pages for them are duplicates, and stay the
        caller's to free."""
        root = self.lock(self.root_of(salt))  # (kept, if new)
        try:
            return self.insert_below(root, 0, tokens, pages)[0]
        finally:
            self.unlock(root)

    def insert_below(self, node: Node, start: int, tokens: list[int], pages: list[int]) -> tuple[int, list[int], Node]:
        """``insert`` resumed at ``node``, whose path from the root caches ``tokens[:start]`` (a
        match the caller holds locked): only the tokens after ``start`` are compared, so caching a
        long prompt chunk by chunk costs its length once, not once per chunk. ``pages`` holds the
        KV of every token from 0. Returns (tokens cached already, the cache's pages for the full
        pages after ``start``, the node their path ends at)."""
        ps = self.page_size
        n_tokens = min(len(tokens) // ps, len(pages)) * ps
        i, path = start, []
        stamp = next(_clock)
        up = node
        while up is not None:  # the path to node is used again: as a match from the root would
            up.last_access = stamp
            up = up.parent
        while i < n_tokens:
            child = node.children.get(tuple(tokens[i : i + ps]))
            if child is None:
                leaf = Node(node, list(tokens[i:n_tokens]), list(pages[i // ps : n_tokens // ps]))
                node.children[tuple(tokens[i : i + ps])] = leaf
                self.total_pages += len(leaf.pages)
                self.version += 1
                return i, path + leaf.pages, leaf
            n = self._common_pages(child.key, tokens, i, n_tokens)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = next(_clock)
            path += child.pages
            i += n * ps
            node = child
        return i, path, node

    def lock(self, node: Node) -> Node:
        """Protect ``node`` and its path to the root; returns the node to hold: ``node``, or for a
        salt's root no longer (or not yet) kept, the salt's root (kept from now on). Such a root
        has no page under it, so a match that ended at it is a match at the salt's root."""
        if isinstance(node, _Root) and self.roots.get(node.salt) is not node:
            node = self.roots.setdefault(node.salt, node)
        held = node
        while node is not None:
            if node.lock_ref == 0:
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent
        return held

    def unlock(self, node: Node) -> None:
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_pages -= len(node.pages)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages from unlocked leaves, LRU first (fewer if not evictable)."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[tuple(leaf.key[: self.page_size])]
            self._free_pages(leaf.pages)
            self.total_pages -= len(leaf.pages)
            self.version += 1
            freed += len(leaf.pages)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> None:
        """Free every page (nothing may be locked)."""
        if self.protected_pages:
            raise RuntimeError(f"cannot reset: {self.protected_pages} cached pages are locked")
        self.evict(self.total_pages)

    def _common_pages(self, key: list[int], tokens: list[int], start: int, end: int) -> int:
        """Whole pages at the start of ``key`` equal to ``tokens[start:end]``'s. List comparisons,
        not a loop per page: one for a run that matches whole (the usual case), else a halving
        search for the first page that differs."""
        ps = self.page_size
        hi = min(len(key), (end - start) // ps * ps) // ps  # pages both have
        if key[: hi * ps] == tokens[start : start + hi * ps]:
            return hi
        lo = 0  # the first lo pages are equal; the first hi are not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if key[lo * ps : mid * ps] == tokens[start + lo * ps : start + mid * ps]:
                lo = mid
            else:
                hi = mid
        return lo

    def _split(self, node: Node, n_pages: int) -> Node:
        """Cut ``node`` after ``n_pages`` pages; returns the new upper part."""
        ps = self.page_size
        upper = Node(node.parent, node.key[: n_pages * ps], node.pages[:n_pages])
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        node.parent.children[tuple(upper.key[:ps])] = upper
        node.key, node.pages, node.parent = node.key[n_pages * ps :], node.pages[n_pages:], upper
        upper.children[tuple(node.key[:ps])] = node
        return upper

    def _nodes(self):
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.parent is not None:
                yield node
