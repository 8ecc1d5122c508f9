"""RadixPrefixCache on its own: seed test plan items 1-3, 6, 7, 16-18 and the error paths."""

from __future__ import annotations

import pytest

from kestrel.kv.page_table import PageState, PageTableError
from kestrel.prefix_cache import (
    CacheIntegrityError,
    CacheLockError,
    CacheNamespace,
    CoordToken,
    ImageToken,
    InsertError,
    RadixPrefixCache,
    SizeToken,
    TextToken,
)

from .cache_protocol import BOS, make_cache, text


def test_split_correctness() -> None:  # seed 1
    pt, cache = make_cache()
    pages = pt.allocate_pages(4)
    cache.insert(text(1, 2, 3, 4), pages)
    m = cache.match_prefix(text(1, 2, 9))
    assert (m.matched_token_count, m.matched_kv_length) == (2, 2)
    assert m.matched_pages.tolist() == pages[:2].tolist()
    assert m.unmatched_tokens == text(9)
    parent = m.last_node
    assert parent.tokens == tuple(text(1, 2))
    (child,) = parent.children.values()
    assert child.tokens == tuple(text(3, 4)) and child.physical_pages.tolist() == pages[2:].tolist()
    assert child.parent is parent and parent.children == {TextToken(3).key: child}
    cache.check_integrity()


def test_split_inside_image_node_counts_kv_not_tokens() -> None:
    pt, cache = make_cache()
    toks = [TextToken(BOS), ImageToken(7, 3), *text(5, 6)]
    pages = pt.allocate_pages(6)
    cache.insert(toks, pages)
    m = cache.match_prefix([*toks[:3], TextToken(9)])
    assert (m.matched_token_count, m.matched_kv_length) == (3, 5)
    assert m.matched_pages.tolist() == pages[:5].tolist()
    (suffix,) = m.last_node.children.values()
    assert suffix.physical_pages.tolist() == [pages[5]]
    cache.check_integrity()


def test_image_kv_length() -> None:  # seed 2
    pt, cache = make_cache(n_pages=800)
    toks = [TextToken(BOS), ImageToken(123, 729), *text(1, 2)]
    pages = pt.allocate_pages(732)
    cache.insert(toks, pages)
    m = cache.match_prefix(toks)
    assert m.matched_kv_length == 732 and m.matched_pages.tolist() == pages.tolist()
    partial = cache.match_prefix(toks[:2])
    assert (partial.matched_kv_length, partial.matched_token_count) == (730, 2)
    other = cache.match_prefix([TextToken(BOS), ImageToken(123, 728), *text(1, 2)])
    assert other.matched_kv_length == 1  # kv length is part of the image key
    cache.check_integrity()


def test_lock_counts_walk_to_root() -> None:  # seed 3
    pt, cache = make_cache()
    first = pt.allocate_pages(2)
    cache.insert(text(1, 2), first)
    r = cache.insert(text(1, 2, 3), [*first, *pt.allocate_pages(1)])
    node = r.node
    cache.lock(node)
    assert node.lock_ref == 1 and node.parent.lock_ref == 1 and node.parent.parent.lock_ref == 1
    assert cache.reclaimable_page_count() == 0 and cache.evictable_page_count() == 0
    cache.unlock(node)
    assert node.lock_ref == 0 and node.parent.lock_ref == 0
    assert cache.evictable_page_count() == 1 and cache.reclaimable_page_count() == 3
    with pytest.raises(CacheLockError, match="more unlocks than locks"):
        cache.unlock(node)
    assert node.lock_ref == 0 and node.parent.lock_ref == 0  # nothing changed
    cache.lock(None)
    cache.unlock(None)
    cache.check_integrity()


def test_insert_idempotency() -> None:  # seed 6
    pt, cache = make_cache()
    pages = pt.allocate_pages(3)
    a = cache.insert(text(1, 2, 3), pages)
    assert a.inserted_pages == 3
    b = cache.insert(text(1, 2, 3), pages)
    assert b.node is a.node and b.inserted_pages == 0
    assert cache.total_cached_pages == 3
    prefix = cache.insert(text(1, 2), pages[:2])  # a prefix of a node: split, nothing claimed
    assert prefix.inserted_pages == 0 and prefix.node.physical_pages.tolist() == pages[:2].tolist()
    cache.check_integrity()


def test_lock_transfer_identity() -> None:  # seed 7
    pt, cache = make_cache()
    toks, pages = text(1, 2, 3), pt.allocate_pages(3)
    r = cache.insert(toks, pages)
    cache.lock(r.node)
    cache.unlock(r.node)
    m = cache.match_prefix(toks)
    assert m.last_node is r.node and m.matched_kv_length == 3
    temp = m.last_node
    cache.lock(temp)
    again = cache.insert(toks, pages)
    assert again.node is temp and again.inserted_pages == 0
    if again.node is not temp:  # the protocol's transfer; identity keeps the one lock
        cache.lock(again.node)
        cache.unlock(temp)
    assert temp.lock_ref == 1
    cache.unlock(temp)
    assert temp.lock_ref == 0
    cache.check_integrity()


def test_namespace_pruning() -> None:  # seed 16
    pt, cache = make_cache()
    namespaces = [CacheNamespace(image_hash=i) for i in range(10)]
    for ns in namespaces:
        cache.insert(text(BOS, 1, 2), pt.allocate_pages(3), namespace=ns)
    assert cache.namespace_count == 10
    assert cache.evict(100) == 30
    assert cache.namespace_count == 0 and cache.node_count == 0
    assert pt.pages_available == pt.n_pages - 1
    cache.insert(text(BOS, 1), pt.allocate_pages(2), namespace=namespaces[0])
    assert cache.namespace_count == 1
    cache.check_integrity()


def test_match_only_creates_no_root() -> None:  # seed 17
    pt, cache = make_cache()
    toks = text(BOS, 1, 2)
    for i in range(100):
        m = cache.match_prefix(toks, namespace=CacheNamespace(image_hash=i))
        assert m.matched_kv_length == 0 and m.last_node is None and m.unmatched_tokens == toks
    assert cache.namespace_count == 0
    ns = CacheNamespace(image_hash=42)
    cache.insert(toks, pt.allocate_pages(3), namespace=ns)
    assert cache.namespace_count == 1
    assert cache.match_prefix(toks, namespace=ns).matched_kv_length == 3
    assert cache.match_prefix([], namespace=ns).last_node is None


def test_from_page_idx_alignment() -> None:  # seed 18
    pt, cache = make_cache(n_pages=800)
    prefix = [TextToken(BOS), ImageToken(12345, 729)]
    prefix_pages = pt.allocate_pages(730)
    cache.insert(prefix, prefix_pages)
    full = [*prefix, *text(*range(10))]
    full_pages = [*prefix_pages, *pt.allocate_pages(10)]
    m = cache.match_prefix(full)
    assert (m.matched_kv_length, m.matched_token_count) == (730, 2)
    with pytest.raises(InsertError, match="from_page_idx"):  # the token/page drift bug
        cache.insert(full, full_pages, None, m.last_node, m.matched_token_count, 2)
    r = cache.insert(full, full_pages, None, m.last_node, 2, m.matched_kv_length)
    assert r.inserted_pages == 10 and r.node.physical_pages.tolist() == full_pages[730:]
    cache.check_integrity()


def test_namespaces_are_isolated() -> None:
    pt, cache = make_cache()
    spaces = [
        CacheNamespace(),
        CacheNamespace(lora_id="x@00"),
        CacheNamespace(image_hash=1),
        CacheNamespace("x@00", 1),
    ]
    cache.insert(text(BOS, 1, 2), pt.allocate_pages(3), namespace=spaces[0])
    for ns in spaces[1:]:
        assert cache.match_prefix(text(BOS, 1, 2), ns).matched_kv_length == 0
    with pytest.raises(TypeError, match="CacheNamespace"):
        cache.match_prefix(text(BOS), namespace="x@00")


def test_coord_and_size_tokens_match_on_bins() -> None:
    pt, cache = make_cache()
    toks = [TextToken(BOS), CoordToken(0.5, 512), SizeToken(0.1, 0.2, 100, 200)]
    cache.insert(toks, pt.allocate_pages(3))
    again = [TextToken(BOS), CoordToken(0.5004, 512), SizeToken(0.1001, 0.2001, 100, 200)]
    assert cache.match_prefix(again).matched_kv_length == 3
    assert cache.match_prefix([TextToken(BOS), CoordToken(0.5, 513)]).matched_kv_length == 1


def test_lru_order_and_cascade() -> None:
    pt, cache = make_cache()
    base = pt.allocate_pages(2)
    a = cache.insert(text(1, 2, 3), [*base, *pt.allocate_pages(1)]).node
    b = cache.insert(text(1, 2, 4), [*base, *pt.allocate_pages(1)]).node
    c = cache.insert(text(1, 2, 5), [*base, *pt.allocate_pages(1)]).node
    cache.match_prefix(text(1, 2, 3))  # a is now the most recent
    assert cache.evict(1) == 1 and b.detached and not a.detached and not c.detached
    assert cache.evict(1) == 1 and c.detached
    assert cache.evict(1) == 1 and a.detached  # then the shared [1, 2] becomes a leaf
    assert cache.evictable_page_count() == 2
    assert cache.evict(1) == 2 and cache.namespace_count == 0
    cache.check_integrity()


def test_evict_stops_at_locked_paths() -> None:
    pt, cache = make_cache()
    base = pt.allocate_pages(2)
    locked = cache.insert(text(1, 2, 3), [*base, *pt.allocate_pages(1)]).node
    other = cache.insert(text(1, 2, 4, 5), [*base, *pt.allocate_pages(2)]).node
    cache.lock(locked)
    assert cache.reclaimable_page_count() == 2
    assert cache.evict(50) == 2
    assert cache.total_cached_pages == 3 and not locked.detached and other.detached
    with pytest.raises(CacheLockError, match="evicted"):
        cache.lock(other)
    cache.unlock(locked)
    cache.check_integrity()


def test_insert_validation_errors() -> None:
    pt, cache = make_cache()
    stray = pt.allocate_pages(8)  # pages the failed inserts below must leave alone
    with pytest.raises(InsertError, match="at least one token"):
        cache.insert([], [])
    with pytest.raises(InsertError, match="2 pages for tokens spanning 3"):
        cache.insert(text(1, 2, 3), stray[:2])
    with pytest.raises(InsertError, match="without from_node"):
        cache.insert(text(1, 2), stray[:2], from_token_idx=1, from_page_idx=1)
    with pytest.raises(InsertError, match="page 0 is padding"):
        cache.insert(text(1), [0])
    with pytest.raises(InsertError, match="twice"):
        cache.insert(text(1, 2), [stray[0], stray[0]])
    with pytest.raises(TypeError, match="cache tokens"):
        cache.insert([1, 2], stray[:2])
    assert cache.namespace_count == 0 and cache.total_cached_pages == 0  # nothing half-done
    pages = pt.allocate_pages(2)
    cache.insert(text(1, 2), pages)
    with pytest.raises(InsertError, match="already owned"):
        cache.insert(text(7, 8), pages)
    node = cache.match_prefix(text(1, 2)).last_node
    with pytest.raises(InsertError, match="does not belong"):
        cache.insert(text(1, 2, 3), [*pages, 9], CacheNamespace(image_hash=5), node, 2, 2)
    with pytest.raises(InsertError, match="not the cached pages"):
        cache.insert(text(1, 2, 3), [*stray[:2], 9], None, node, 2, 2)
    with pytest.raises(InsertError, match="do not match from_node's depth"):
        cache.insert(text(1, 2, 3), [*pages, 9], None, node, 1, 2)
    cache.evict(10)
    with pytest.raises(InsertError, match="evicted"):
        cache.insert(text(1, 2, 3), [*pages, 9], None, node, 2, 2)
    pt.free_pages_to_pool(stray)
    cache.check_integrity()


def test_page_size_must_be_one() -> None:
    class Table:
        page_size, n_pages = 16, 10

    with pytest.raises(ValueError, match="page_size=1"):
        RadixPrefixCache(Table())


def test_check_integrity_catches_corruption() -> None:
    pt, cache = make_cache()
    base = pt.allocate_pages(2)
    cache.insert(text(1, 2, 3), [*base, *pt.allocate_pages(1)])
    leaf = cache.insert(text(1, 2, 4), [*base, *pt.allocate_pages(1)]).node
    cache.check_integrity()
    cache._evictable += 1
    with pytest.raises(CacheIntegrityError, match="evictable"):
        cache.check_integrity()
    cache._evictable -= 1
    leaf.lock_ref = 1  # a lock the parent does not know about
    with pytest.raises(CacheIntegrityError, match="lock_ref"):
        cache.check_integrity()
    leaf.lock_ref = 0
    with pytest.raises(PageTableError, match="owned by the prefix cache"):
        pt.free_pages_to_pool([leaf.physical_pages[0]])  # the public call refuses ...
    page = leaf.physical_pages[:1]  # corrupt the pool as a buggy free would:
    pt.pool._set(page, PageState.FREE)  # a page a node still holds is FREE ...
    pt.pool._push(page)  # ... and on the free stack
    with pytest.raises(CacheIntegrityError, match="both free and cache-owned"):
        cache.check_integrity()


def test_stats() -> None:
    pt, cache = make_cache()
    node = cache.insert(text(1, 2, 3), pt.allocate_pages(3)).node
    cache.lock(node)
    s = cache.stats()
    assert (s.namespaces, s.nodes, s.cached_pages, s.locked_pages) == (1, 1, 3, 3)
    assert s.evictable_pages == s.reclaimable_pages == 0


def test_eviction_heap_stays_bounded() -> None:
    pt, cache = make_cache()
    node = cache.insert(text(1, 2, 3), pt.allocate_pages(3)).node
    for _ in range(2000):  # every unlock re-queues the leaf; stale entries must be compacted
        cache.lock(node)
        cache.unlock(node)
    assert cache.stats().queued_entries <= 130
    cache.check_integrity()
    assert cache.evict(1) == 3


@pytest.mark.parametrize("bad", [-1, True, 1.5, "7", None])
def test_text_tokens_validate_their_id_and_share_one_instance_per_id(bad) -> None:
    with pytest.raises(ValueError, match="non-negative int"):
        TextToken(bad)
    a = TextToken(7)
    assert a is TextToken(token_id=7) and a == TextToken(7) and a.key == (0, 7)
    assert TextToken(8) is not a and TextToken(8) != a
