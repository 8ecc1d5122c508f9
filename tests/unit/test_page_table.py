"""PageTable and PagedKVCache, plus seed test plan items 4, 5, 10, 11 and 13 (page ownership)."""

from __future__ import annotations

import pytest
import torch

from kestrel.kv.page_table import (
    BatchSlotsExhausted,
    DoubleFreeError,
    PagedKVCache,
    PagePoolExhausted,
    PageState,
    PageTable,
    PageTableError,
)
from kestrel.prefix_cache import InsertError

from .cache_protocol import BOS, FakeRuntime, Prompt, make_cache, text


def test_reserved_page_and_row() -> None:
    pt = PageTable(10, max_batch_size=2, max_seq_len=16)
    assert pt.page_table.shape == (3, 16) and pt.page_table.dtype == torch.int32
    assert pt.pages_available == 9 and 0 not in pt.free_pages
    assert pt.allocate_pages(9).tolist() == list(range(1, 10))
    assert {pt.allocate(), pt.allocate()} == {1, 2}
    with pytest.raises(BatchSlotsExhausted, match="2 batch rows"):
        pt.allocate()
    with pytest.raises(PageTableError, match="page_size must be 1"):
        PageTable(10, page_size=16)


def test_map_get_erase_roundtrip() -> None:
    pt = PageTable(20, max_batch_size=2, max_seq_len=8)
    b = pt.allocate()
    first, second = pt.allocate_pages(3), pt.allocate_pages(2)
    pt.map_pages(b, 0, first)
    pt.map_pages(b, 3, second)
    assert pt.capacity(b) == pt.seq_len(b) == 5 and pt.active_batch_indices() == [b]
    assert pt.get_pages(b, 1, 4) == [first[1], first[2], second[0]]
    assert pt.page_table[b, :6].tolist() == [*first, *second, 0]
    assert pt.build_slot_mapping(b, [4, 0]).tolist() == [second[1], first[0]]
    slots = pt.build_slot_mapping(b, torch.tensor([[0, 1], [2, 3]]))
    assert slots.dtype == torch.int64 and slots.tolist() == [
        first[:2].tolist(),
        [first[2], second[0]],
    ]
    with pytest.raises(PageTableError, match="positions"):
        pt.build_slot_mapping(b, [5])
    with pytest.raises(PageTableError, match="outside"):
        pt.get_pages(b, 0, 6)
    pt.erase(b)
    assert pt.pages_available == 19 and pt.active_batch_indices() == []
    assert not pt.page_table.any()
    with pytest.raises(PageTableError, match="not allocated"):
        pt.erase(b)
    pt.check_integrity()


def test_map_pages_rejects_overlap_and_bad_pages() -> None:
    pt = PageTable(20, max_batch_size=2, max_seq_len=6)
    b = pt.allocate()
    pt.map_pages(b, 0, pt.allocate_pages(2))
    with pytest.raises(PageTableError, match="logical_start must be 2"):
        pt.map_pages(b, 1, pt.allocate_pages(1))
    with pytest.raises(PageTableError, match="is free"):
        pt.map_pages(b, 2, [19])
    with pytest.raises(PageTableError, match="max_seq_len"):
        pt.map_pages(b, 2, pt.allocate_pages(5))
    with pytest.raises(PageTableError, match="not allocated"):
        pt.map_pages(2, 0, [])


def test_free_pool_guards() -> None:
    pt = PageTable(10)
    pages = pt.allocate_pages(3)
    pt.free_pages_to_pool(pages[:1])
    with pytest.raises(DoubleFreeError, match=f"page {pages[0]} is already free"):
        pt.free_pages_to_pool(pages)
    assert pt.pages_available == 7  # the failed call freed nothing
    with pytest.raises(DoubleFreeError):
        pt.free_pages_to_pool([pages[1], pages[1]])
    assert pt.pages_available == 7
    with pytest.raises(PageTableError, match=r"1\.\.9"):
        pt.free_pages_to_pool([0])
    with pytest.raises(PageTableError, match=">= 0"):
        pt.allocate_pages(-1)
    assert pt.allocate_pages(0).tolist() == []


def test_erase_refuses_wrong_cached_counts() -> None:
    pt, cache = make_cache()
    b = pt.allocate()
    pages = pt.allocate_pages(4)
    pt.map_pages(b, 0, pages)
    cache.insert(text(1, 2), pages[:2])
    with pytest.raises(PageTableError, match="would be freed"):
        pt.erase(b, 1)
    with pytest.raises(PageTableError, match="would leak"):
        pt.erase(b, 3)
    with pytest.raises(PageTableError, match="outside"):
        pt.erase(b, 5)
    pt.check_integrity()  # the refused calls changed nothing
    pt.erase(b, 2)
    pt.check_integrity()


def test_reserve_and_can_reserve() -> None:
    pt, cache = make_cache(n_pages=11, max_batch_size=2)
    b = pt.allocate()
    pt.reserve(b, 4)
    pt.reserve(b, 2)  # shrinking is a no-op
    assert pt.capacity(b) == 4 and pt.pages_available == 6
    assert pt.can_reserve_with_eviction(10, b) and not pt.can_reserve_with_eviction(11, b)
    assert pt.can_reserve_with_eviction(6) and not pt.can_reserve_with_eviction(7)
    cache.insert(text(1, 2, 3), pt.allocate_pages(3))  # 3 reclaimable pages
    assert pt.can_reserve_with_eviction(6) and pt.pages_available == 3
    pt.reserve(b, 10)  # evicts the cached prompt
    assert cache.total_cached_pages == 0 and pt.capacity(b) == 10
    pt.allocate()
    assert not pt.can_reserve_with_eviction(0)  # no free row
    with pytest.raises(PageTableError, match="max_seq_len"):
        pt.reserve(b, 5000)
    pt.erase(b)


def test_exhausted_message_names_every_count() -> None:  # seed 13
    pt, cache = make_cache(n_pages=21, max_batch_size=4)
    rt = FakeRuntime(pt, cache)
    running = [rt.start(Prompt((i, i + 1))) for i in range(1, 4)]  # BOS shared: 3 + 2 + 2
    rt.release(rt.start(Prompt((9, 9, 9))))  # 3 more cached pages, unlocked
    assert (pt.pages_available, cache.total_cached_pages) == (10, 10)
    assert cache.reclaimable_page_count() == 3
    with pytest.raises(PagePoolExhausted) as err:
        pt.allocate_pages(14)
    msg = str(err.value)
    for part in ("allocate 14 pages", "10 free", "10 cached", "7 are locked", "3 reclaimable"):
        assert part in msg
    assert cache.total_cached_pages == 10  # a hopeless request evicts nothing
    for seq in running[:2]:
        rt.release(seq)
    pages = pt.allocate_pages(14)  # now eviction covers it
    assert len(pages) == 14 and cache.total_cached_pages == 6  # LRU: [1, 2], [2, 3] went
    pt.free_pages_to_pool(pages)
    rt.release(running[2])
    pt.check_integrity()


def test_cache_miss_page_ownership() -> None:  # seed 4
    pt, cache = make_cache()
    initial = pt.pages_available
    b = pt.allocate()
    pages = pt.allocate_pages(10)
    pt.map_pages(b, 0, pages)
    r = cache.insert(text(BOS, *range(1, 10)), pages)
    cache.lock(r.node)
    assert r.inserted_pages == 10
    pt.check_integrity()
    cache.unlock(r.node)
    pt.erase(b, r.inserted_pages)
    assert pt.pages_available == initial - 10
    cache.evict(10)
    assert pt.pages_available == initial
    pt.check_integrity()


def test_partial_hit_page_ownership() -> None:  # seed 5
    pt, cache = make_cache()
    rt = FakeRuntime(pt, cache)
    rt.release(rt.start(Prompt((1, 2, 3, 4))))
    seq = rt.start(Prompt((1, 2, 3, 7, 8, 9)))
    assert (seq.skip, seq.inserted, seq.cache_owned) == (4, 3, 7)
    assert pt.page_table_cpu[seq.row][:4] == seq.match.matched_pages.tolist()
    rt.release(seq)
    assert cache.total_cached_pages == 8 and pt.pages_available == pt.n_pages - 1 - 8
    pt.check_integrity()


def test_full_prompt_match_page_ownership() -> None:  # seed 10
    pt, cache = make_cache()
    rt = FakeRuntime(pt, cache)
    rt.release(rt.start(Prompt((1, 2, 3))))
    free_before = pt.pages_available
    seq = rt.start(Prompt((1, 2, 3)))
    assert seq.match.matched_kv_length == 4 and seq.skip == 3 and seq.inserted is None
    row = pt.page_table_cpu[seq.row]
    assert row[:3] == seq.match.matched_pages[:3].tolist() and len(row) == 4
    private = row[3]
    assert private not in seq.match.matched_pages and not cache.owns_page(private)
    assert seq.lock_node is seq.match.last_node and seq.lock_node.lock_ref == 1
    assert seq.cache_owned == 3
    rt.release(seq)
    assert private in pt.free_pages and pt.pages_available == free_before
    pt.check_integrity()


def test_tiny_hit_text_only() -> None:  # seed 11
    pt, cache = make_cache(n_pages=100, max_batch_size=10)
    rt = FakeRuntime(pt, cache)
    rt.release(rt.start(Prompt(tuple(range(1, 10)))))
    assert cache.total_cached_pages == 10
    seq = rt.start(Prompt((100, 101)))
    assert seq.skip == 1 and seq.inserted == 2 and seq.cache_owned == 3
    assert seq.lock_node is not seq.match.last_node and seq.match.last_node.lock_ref == 1
    rt.release(seq)
    assert pt.pages_available + cache.total_cached_pages == 99
    cache.evict(99)
    assert pt.pages_available == 99 and cache.namespace_count == 0
    pt.check_integrity()


def test_paged_kv_cache_shapes_and_budget() -> None:
    kv = PagedKVCache(8, n_layers=3, n_kv_heads=2, head_dim=4, dtype=torch.float16)
    assert len(kv.k) == len(kv.v) == 3 and kv.k[2].shape == (8, 2, 4)
    assert kv.k[0].dtype == torch.float16 and not kv.v[1].any()
    assert kv.bytes == 8 * 2 * 3 * 2 * 4 * 2
    per_page = PagedKVCache.bytes_per_page(3, 2, 4, torch.float16)
    assert PagedKVCache.pages_for_budget(10 * per_page + 1, 3, 2, 4, torch.float16) == 10
    big = PagedKVCache.from_memory_budget(10 * per_page, 3, 2, 4, torch.float16)
    assert big.n_pages == 10 and big.bytes <= 10 * per_page
    with pytest.raises(ValueError, match="at least 2"):
        PagedKVCache.from_memory_budget(per_page, 3, 2, 4, torch.float16)
    with pytest.raises(ValueError, match="page 0 is padding"):
        PagedKVCache(1, 1, 1, 1)


def test_eviction_refuses_a_page_that_is_no_longer_cached() -> None:
    """A page freed behind the cache's back (a buggy free) is a double free at eviction."""
    pt, cache = make_cache()
    leaf = cache.insert(text(1, 2, 3), pt.allocate_pages(3)).node
    page = leaf.physical_pages[:1]  # corrupt the pool as a buggy free would:
    pt.pool._set(page, PageState.FREE)  # a page a node still holds is FREE ...
    pt.pool._push(page)  # ... and on the free stack
    with pytest.raises(DoubleFreeError, match=f"page {leaf.physical_pages[0]}.*double free"):
        cache.evict(3)


@pytest.mark.parametrize("n", [3, 40, 300], ids=["short", "long", "longer"])
def test_repeated_pages_are_refused_at_any_length(n: int) -> None:
    """Short lists are checked by a loop, long ones vectorized: both refuse a repeated page."""
    pt, cache = make_cache(n_pages=800)
    pages = pt.allocate_pages(n).tolist()
    with pytest.raises(DoubleFreeError, match=f"page {pages[1]} is listed twice"):
        pt.free_pages_to_pool([*pages, pages[1]])
    with pytest.raises(InsertError, match="twice"):
        cache.insert(text(*range(1, n + 2)), [*pages, pages[1]])
    (gone,) = pt.allocate_pages(1).tolist()
    pt.free_pages_to_pool([gone])
    with pytest.raises(DoubleFreeError, match=f"page {gone} is already free"):
        pt.free_pages_to_pool([*pages[1:], gone])
    assert pt.pages_available == 800 - 1 - n and cache.total_cached_pages == 0
    cache.insert(text(*range(1, n + 1)), pages)  # nothing changed: the pages are still private
    assert cache.total_cached_pages == n
