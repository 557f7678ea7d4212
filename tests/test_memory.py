"""Page allocator and radix prefix cache: match, insert, split, lock, LRU eviction, accounting."""

from __future__ import annotations

import random

import numpy as np
import pytest

from minengine.memory import PageAllocator, RadixCache


def test_allocator_all_or_nothing_and_double_free():
    a = PageAllocator(5)
    pages = a.alloc(3)
    assert sorted(pages) == [0, 1, 2] and a.num_free == 2
    assert a.alloc(3) is None and a.num_free == 2
    a.free(pages)
    assert a.num_free == 5
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free([pages[0]])


def make_cache(page_size=2, num_pages=64):
    alloc = PageAllocator(num_pages)
    return RadixCache(page_size, alloc.free), alloc


def test_match_and_insert_page_aligned():
    cache, alloc = make_cache()
    pages = alloc.alloc(3)
    assert cache.insert([1, 2, 3, 4, 5, 6, 7], pages) == 0  # 7 tokens: 3 full pages cached
    assert cache.total_pages == 3
    got, _ = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert got == pages
    got, _ = cache.match_prefix([1, 2, 3, 9])  # diverges inside the second page
    assert got == pages[:1]
    assert cache.match_prefix([9, 9])[0] == []
    assert cache.match_prefix([1])[0] == []  # less than a page never matches


def test_insert_reports_cached_prefix_and_splits():
    cache, alloc = make_cache()
    a = alloc.alloc(3)
    cache.insert([1, 2, 3, 4, 5, 6], a)
    b = alloc.alloc(3)
    assert cache.insert([1, 2, 3, 4, 7, 8], b) == 4  # two pages were cached already
    alloc.free(b[:2])  # the caller frees its duplicates
    assert cache.total_pages == 4
    assert cache.match_prefix([1, 2, 3, 4, 7, 8])[0] == a[:2] + b[2:]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6])[0] == a


def test_lock_protects_path_and_eviction_is_lru():
    cache, alloc = make_cache()
    cache.insert([1, 1, 2, 2], alloc.alloc(2))
    cache.insert([3, 3, 4, 4], alloc.alloc(2))
    cache.insert([5, 5], alloc.alloc(1))
    _, node = cache.match_prefix([1, 1, 2, 2])
    cache.lock(node)
    assert cache.protected_pages == 2 and cache.evictable_pages == 3
    cache.match_prefix([5, 5])  # touch: [3 3 4 4] is now least recently used
    free_before = alloc.num_free
    assert cache.evict(1) == 2
    assert cache.match_prefix([3, 3])[0] == [] and cache.match_prefix([5, 5])[0] != []
    assert alloc.num_free == free_before + 2
    assert cache.evict(100) == 1  # only [5 5] was left unlocked
    assert cache.total_pages == 2
    cache.unlock(node)
    assert cache.evictable_pages == 2
    cache.reset()
    assert cache.total_pages == 0 and alloc.num_free == 64


def test_locked_split_node_stays_protected():
    cache, alloc = make_cache()
    cache.insert([1, 1, 2, 2, 3, 3], alloc.alloc(3))
    _, node = cache.match_prefix([1, 1, 2, 2, 3, 3])
    cache.lock(node)
    cache.match_prefix([1, 1, 9, 9])  # splits the locked node after one page
    assert cache.protected_pages == 3
    assert cache.evict(10) == 0
    cache.unlock(node)
    assert cache.evict(10) == 3


def test_random_operations_keep_accounting():
    rng = random.Random()
    cache, alloc = make_cache(page_size=rng.choice([1, 2, 3]), num_pages=400)
    ps = cache.page_size
    locked = []
    for _ in range(300):
        op = rng.random()
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        salt = rng.choice([None, "a", "b", "c"])
        if op < 0.45:
            n_full = len(tokens) // ps
            pages = alloc.alloc(n_full)
            if pages is None:
                cache.evict(n_full)
                continue
            already = cache.insert(tokens, pages, salt) // ps
            alloc.free(pages[:already])
        elif op < 0.65:
            _, node = cache.match_prefix(tokens, salt)
            locked.append(cache.lock(node))
        elif op < 0.8 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        elif op < 0.9:
            cache._sweep_at = 2  # (a real sweep: it walks from one salt's root on)
            cache.sweep()
        else:
            cache.evict(rng.randrange(1, 6))
        nodes = list(cache._nodes())
        for n in [*nodes, *locked]:  # every node hangs from a root the cache knows
            while n.parent is not None:
                n = n.parent
            assert cache.roots.get(getattr(n, "salt", None)) is n
        assert cache.total_pages == sum(len(n.pages) for n in nodes)
        assert cache.protected_pages == sum(len(n.pages) for n in nodes if n.lock_ref > 0)
        assert alloc.num_free + cache.total_pages == 400
        assert all(len(n.key) == len(n.pages) * ps for n in nodes)


def test_a_cache_salt_has_a_tree_of_its_own():
    """vLLM's cache_salt: requests share KV only with requests of the same salt. A salt's root is
    kept from its first lock (a match alone keeps nothing); a sweep forgets it once no page is
    under it and no request holds it, and a match that still ends at it locks the salt's root."""
    cache, alloc = make_cache()
    a, b = alloc.alloc(2), alloc.alloc(2)
    assert cache.insert([1, 1, 2, 2], a, "tenant a") == 0
    assert cache.match_prefix([1, 1, 2, 2, 3])[0] == [] and cache.match_prefix([1, 1, 2, 2], "b")[0] == []
    assert cache.match_prefix([1, 1, 2, 2, 3], "tenant a")[0] == a
    assert cache.insert([1, 1, 2, 2], b) == 0 and cache.match_prefix([1, 1, 2, 2, 3])[0] == b
    assert cache.total_pages == 4 and set(cache.roots) == {None, "tenant a"}  # "b": only matched
    _, waiting = cache.match_prefix([7, 7], "w")  # a request that waits: nothing kept
    _, first = cache.match_prefix([7, 7], "w")
    assert first is not waiting and cache.lock(first) is first and cache.lock(waiting) is first
    cache.unlock(first)
    cache.unlock(first)
    _, held = cache.match_prefix([7, 7], "held")
    held = cache.lock(held)
    _, stale = cache.match_prefix([7, 7], "w")
    v = cache.version
    cache._sweep_at = 1
    cache.sweep()  # "w" (bare) goes; "tenant a" has pages, "held" is held
    assert set(cache.roots) == {None, "tenant a", "held"} and cache.version == v
    kept = cache.lock(stale)  # a match made before the sweep: the salt's root is kept again
    assert cache.roots["w"] is kept
    cache.unlock(kept)
    cache.unlock(held)
    assert cache.evict(4) == 4 and alloc.num_free == 64
    cache.sweep()  # not yet: the walk waits for twice as many roots (64 at least)
    assert len(cache.roots) == 4
    cache._sweep_at = 3
    cache.sweep()
    assert set(cache.roots) == {None} and cache.total_pages == cache.protected_pages == 0


def test_page_table_writes_last_one_wins_and_flush_has_no_duplicate_index():
    import torch

    from minengine.memory import PageTable

    table = PageTable(max_requests=2, max_pages_per_request=4, device=torch.device("cpu"))
    table.write(0, 0, [5, 6])  # queued for a request that is then aborted
    table.write(0, 0, [7])  # the slot's next request, before any flush
    assert len(table._pending) == 2  # one entry per (slot, column)
    table.flush()
    assert table.table[0, :2].tolist() == [7, 6]


def test_version_moves_only_when_pages_enter_or_leave():
    cache, alloc = make_cache()
    v0 = cache.version
    cache.insert([1, 1, 2, 2], alloc.alloc(2))
    v1 = cache.version
    assert v1 > v0
    pages, node = cache.match_prefix([1, 1, 2, 2])
    cache.match_prefix([1, 1, 9, 9])  # a split: the first match still ends at `node`
    assert cache.version == v1 and cache.match_prefix([1, 1, 2, 2]) == (pages, node)
    assert cache.insert([1, 1, 2, 2], alloc.alloc(2)) == 4 and cache.version == v1  # nothing new
    cache.evict(10)
    assert cache.version > v1


def test_to_device_packed_splits_one_buffer_in_order():
    import torch

    from minengine.memory.kv_pool import to_device_packed

    lists = [[3, 1], [], [7], [2**40, -5, 0]]
    views = to_device_packed(lists, torch.int64, torch.device("cpu"))
    assert [v.tolist() for v in views] == lists
    assert all(v.dtype == torch.int64 and v.is_contiguous() for v in views)
    (a,) = to_device_packed([[1, 2]], torch.int32, torch.device("cpu"))
    assert a.dtype == torch.int32 and a.tolist() == [1, 2]


@pytest.mark.parametrize("numpy_wraps_int32", [False, True])
def test_to_device_converts_exactly_or_refuses(numpy_wraps_int32, monkeypatch):
    import torch

    from minengine.memory import kv_pool
    from minengine.memory.kv_pool import to_device

    # the int32 paths: numpy 2's own refusal, and the range check numpy 1 needs (which runs on any)
    if kv_pool._WRAPS_INT32 and not numpy_wraps_int32:
        pytest.skip(f"numpy {np.__version__} wraps an int32 that overflows")
    monkeypatch.setattr(kv_pool, "_WRAPS_INT32", numpy_wraps_int32)

    cpu = torch.device("cpu")
    assert to_device(iter([4, 5, 6]), torch.int64, cpu, count=3).tolist() == [4, 5, 6]
    assert to_device([], torch.int32, cpu).shape == (0,)
    temps = to_device([0.7, 1.0], torch.float32, cpu)
    assert temps.dtype == torch.float32 and temps.tolist() == pytest.approx([0.7, 1.0])
    assert to_device([True, False], torch.bool, cpu).tolist() == [True, False]  # any other dtype: torch.tensor's way
    for dtype, bad in [(torch.int32, 2**31), (torch.int32, -(2**31) - 1), (torch.int64, 2**63)]:
        with pytest.raises(OverflowError):  # never a wrapped length or page id, whatever numpy's version
            to_device([0, bad, 1], dtype, cpu)
    with pytest.raises(OverflowError, match="2147483648"):  # names the value
        to_device(iter([2**31]), torch.int32, cpu, count=1)
    assert to_device([-(2**31), 2**31 - 1], torch.int32, cpu).tolist() == [-(2**31), 2**31 - 1]


def test_common_pages_equals_a_page_by_page_scan():
    rng = random.Random()
    for _ in range(2000):
        ps = rng.choice([1, 2, 3, 16])
        key = [rng.randrange(2) for _ in range(ps * rng.randrange(1, 9))]
        tokens = [rng.randrange(2) for _ in range(rng.randrange(3))] + key[: rng.randrange(len(key) + 1)]
        tokens += [rng.randrange(2) for _ in range(rng.randrange(2 * ps))]
        start = rng.randrange(len(tokens) + 1)
        end = rng.randrange(start, len(tokens) + 1)
        n = 0
        while (n + 1) * ps <= len(key) and start + (n + 1) * ps <= end:
            if key[n * ps : (n + 1) * ps] != tokens[start + n * ps : start + (n + 1) * ps]:
                break
            n += 1
        cache, _ = make_cache(page_size=ps, num_pages=1)
        assert cache._common_pages(key, tokens, start, end) == n, (ps, key, tokens, start, end)


def test_insert_below_a_locked_match_equals_insert_from_the_root():
    """Chunk by chunk from the request's match, as the scheduler caches a prompt: the same tree,
    the same answers and the same pages as inserting each prefix from the root and matching it."""
    rng = random.Random()
    for _ in range(60):
        ps = rng.choice([1, 2, 4])
        trees = [make_cache(page_size=ps, num_pages=4000) for _ in range(2)]
        for _ in range(8):
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
            chunks = [rng.randrange(1, 9) for _ in range(len(tokens))]
            answers = []
            for below_first, (cache, alloc) in zip((True, False), trees, strict=True):
                held, node = cache.match_prefix(tokens)
                cache.lock(node)
                pages = list(held) + alloc.alloc(len(tokens) // ps - len(held))
                cached = len(held)
                end, steps = cached * ps, []
                for chunk in chunks:
                    if end >= len(tokens):
                        break
                    end = min(len(tokens), end + chunk)
                    full = end // ps
                    if below_first:
                        already, got, below = cache.insert_below(node, cached * ps, tokens, pages[:full])
                    else:
                        already = cache.insert(tokens[: full * ps], pages[:full])
                        got, below = cache.match_prefix(tokens[: full * ps])
                        got = got[cached:]
                    alloc.free(pages[cached : already // ps])
                    pages[cached:full] = got
                    cache.lock(below)
                    cache.unlock(node)
                    node, cached = below, full
                    steps.append((already, full))
                got_all, _ = cache.match_prefix(tokens)
                assert pages == got_all  # the request's pages are the cache's
                answers.append(steps)
                cache.unlock(node)
            assert answers[0] == answers[1]
        shapes = []
        for cache, alloc in trees:
            shapes.append(sorted((tuple(n.key), len(n.pages)) for n in cache._nodes()))
            assert alloc.num_free + cache.total_pages == 4000 and cache.protected_pages == 0
        assert shapes[0] == shapes[1]
