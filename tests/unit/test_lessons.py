"""One test per lesson of docs/lessons.md "Ownership and accounting": what shared prefix caches
get wrong about who owns a page and how many pages are free."""

from __future__ import annotations

import pytest

from kestrel.kv.page_table import PagePoolExhausted
from kestrel.prefix_cache import ImageToken, TextToken

from .cache_protocol import (
    BOS,
    FAIL_POINTS,
    FakeRuntime,
    InjectedFailure,
    Prompt,
    all_nodes,
    check_all,
    make_cache,
    text,
)


@pytest.mark.parametrize("cached_stem", [(), (1, 2)], ids=["miss", "partial-hit"])
def test_duplicate_prefill_keeps_its_lock_and_pages_private(cached_stem: tuple) -> None:
    pt, cache = make_cache()
    rt = FakeRuntime(pt, cache)
    if cached_stem:
        rt.release(rt.start(Prompt(cached_stem)))
    prompt = Prompt((1, 2, 3, 4))
    b = rt.begin(prompt, max_new=2)  # B matched and prefilled ...
    a = rt.start(prompt, max_new=2)  # ... while A prefilled the same prompt and inserted it
    rt.finish(b)
    check_all(rt)
    assert a.inserted == prompt.length - a.skip and b.inserted == 0
    assert b.cache_owned == b.skip
    assert b.lock_node is not a.lock_node
    if cached_stem:
        assert b.lock_node is b.match.last_node  # identity case: the temporary lock stays
    else:
        assert b.lock_node.parent is None  # a root: protects nothing, owns nothing
    assert a.lock_node.lock_ref == 1  # B's lock never moved onto A's node
    b_private = pt.page_table_cpu[b.row][b.skip :]
    assert len(b_private) == prompt.length + 2 - b.skip
    assert not any(cache.owns_page(p) for p in b_private)
    rt.release(b)
    assert all(p in pt.free_pages for p in b_private)
    rt.release(a)
    check_all(rt)


def test_page_identity_guard() -> None:
    """The seed's leak example: [BOS] is cached (P1); a request prefills [BOS, A, B] into fresh
    pages [P2, P3, P4] and inserts them. Claiming [P3, P4] under P1's node would make the
    runtime's count (0 + 2) free P4 (a cache page) and leak P2."""
    pt, cache = make_cache()
    p1 = pt.allocate_pages(1)
    cache.insert(text(BOS), p1)
    b = pt.allocate()
    fresh = pt.allocate_pages(3)
    pt.map_pages(b, 0, fresh)
    r = cache.insert(text(BOS, 5, 6), fresh)
    assert r.inserted_pages == 0 and r.node.parent is None  # stopped at the root
    assert cache.total_cached_pages == 1 and not any(cache.owns_page(p) for p in fresh)
    cache.lock(r.node)  # the protocol locks what insert returned (a root: protects nothing)
    cache.check_integrity()
    cache.unlock(r.node)
    pt.erase(b, 0 + r.inserted_pages)
    assert pt.pages_available == pt.n_pages - 2
    # Deeper: the caller shares [BOS] but recomputed [5, 6] that another request cached.
    cache.insert(text(BOS, 5, 6), [*p1, *pt.allocate_pages(2)])
    mine = [*p1, *pt.allocate_pages(3)]
    r = cache.insert(text(BOS, 5, 6, 7), mine)
    assert r.inserted_pages == 0 and r.node.physical_pages.tolist() == p1.tolist()
    assert not any(cache.owns_page(p) for p in mine[1:])
    pt.free_pages_to_pool(mine[1:])
    cache.check_integrity()


def test_admission_counts_reclaimable_internal_nodes() -> None:
    pt, cache = make_cache(n_pages=16)
    stem = pt.allocate_pages(8)
    cache.insert(text(*range(1, 9)), stem)
    cache.insert(text(*range(1, 9), 20), [*stem, *pt.allocate_pages(1)])
    cache.insert(text(*range(1, 9), 21), [*stem, *pt.allocate_pages(1)])
    assert pt.pages_available == 5
    assert cache.evictable_page_count() == 2  # leaves only
    assert cache.reclaimable_page_count() == 10  # the unlocked internal stem counts too
    assert pt.can_reserve_with_eviction(15)
    assert len(pt.allocate_pages(15)) == 15  # cascading eviction delivers it
    assert cache.namespace_count == 0


def test_stale_heap_entry_of_relocked_node_is_never_evicted() -> None:
    pt, cache = make_cache()
    node = cache.insert(text(1, 2, 3), pt.allocate_pages(3)).node  # queued as evictable
    cache.lock(node)  # a running prefill reads it now; its heap entry is still there
    assert cache.evict(100) == 0 and not node.detached
    cache.unlock(node)  # queued again ...
    cache.lock(node)  # ... and re-locked: two entries, neither may win
    cache.match_prefix(text(1, 2, 3))
    assert cache.evict(100) == 0 and cache.total_cached_pages == 3
    cache.unlock(node)
    assert cache.evict(100) == 3 and node.detached
    cache.check_integrity()


def test_shared_pages_are_counted_once() -> None:
    pt, cache = make_cache(n_pages=40)
    rt = FakeRuntime(pt, cache)
    seqs = [rt.start(Prompt((1, 2, 3, t)), max_new=1) for t in (4, 5, 6)]
    seqs.append(rt.start(Prompt((1, 2, 3, 4))))  # full-prompt hit: shares every page
    check_all(rt)
    for seq in seqs:
        rt.release(seq)
        check_all(rt)
    assert cache.reclaimable_page_count() == cache.total_cached_pages == 7
    assert pt.pages_available + cache.reclaimable_page_count() == pt.n_pages - 1
    assert cache.evict(1000) == 7 and pt.pages_available == pt.n_pages - 1


@pytest.mark.parametrize("fail_at", FAIL_POINTS)
def test_failure_after_match_leaks_no_slot_page_or_lock(fail_at: str) -> None:
    pt, cache = make_cache()
    rt = FakeRuntime(pt, cache)
    rt.release(rt.start(Prompt((1, 2, 3))))
    fired = 0
    # A full-prompt hit, a partial hit and an image miss take different paths through the
    # lease; a point one path never reaches lets that request complete normally.
    for prompt in (Prompt((1, 2, 3)), Prompt((1, 2, 7, 8)), Prompt((4,), (9, 3))):
        try:
            seq = rt.start(prompt, max_new=3, fail_at=fail_at)
        except InjectedFailure:
            assert rt.last_injector.fired
            fired += 1
        else:
            assert not rt.last_injector.fired
            rt.release(seq)
        check_all(rt)
        assert pt.active_batch_indices() == [] and pt.pages_available + (
            cache.total_cached_pages
        ) == (pt.n_pages - 1)
        assert all(n.lock_ref == 0 for n in all_nodes(cache))
    assert fired, f"no request reached the failure point {fail_at!r}"


def test_failed_lock_transfer_releases_both_locks() -> None:
    """The transfer's unlock fails while the lease holds the temporary and the new lock."""
    pt, cache = make_cache()
    rt = FakeRuntime(pt, cache)
    rt.release(rt.start(Prompt((1, 2, 3))))
    stem = cache.match_prefix(Prompt((1, 2, 7)).cache_tokens()).last_node
    with pytest.raises(InjectedFailure):
        rt.start(Prompt((1, 2, 7)), max_new=2, fail_at="unlock")
    assert stem.lock_ref == 0 and all(n.lock_ref == 0 for n in all_nodes(cache))
    assert cache.match_prefix(Prompt((1, 2, 7)).cache_tokens()).matched_kv_length == 4
    check_all(rt)


def test_allocation_failure_after_match_releases_everything() -> None:
    pt, cache = make_cache(n_pages=12)
    rt = FakeRuntime(pt, cache)
    rt.release(rt.start(Prompt((1, 2, 3))))
    with pytest.raises(PagePoolExhausted):
        rt.start(Prompt((1, 2, 3, 4)), max_new=20)  # hit, temp lock, then no pages
    check_all(rt)
    assert pt.active_batch_indices() == [] and cache.reclaimable_page_count() == 4


def test_eviction_takes_leaves_only() -> None:
    pt, cache = make_cache()
    stem = pt.allocate_pages(2)
    cache.insert(text(1, 2), stem)
    deep = cache.insert(text(1, 2, 3, 4), [*stem, *pt.allocate_pages(2)]).node
    cache.insert(text(1, 2, 5), [*stem, *pt.allocate_pages(1)])
    cache.lock(deep)
    cache.unlock(deep)
    cache.lock(deep.parent)  # lock the shared stem only: deep itself stays evictable
    assert cache.evict(100) == 3  # both leaves; the locked stem stays, with no orphan
    (stem_node,) = next(iter(cache.roots().values())).children.values()
    assert not stem_node.children and not stem_node.detached and deep.detached
    for node in all_nodes(cache):
        assert all(c.parent is node and not c.detached for c in node.children.values())
    cache.unlock(stem_node)
    cache.check_integrity()


def test_split_moves_children_and_reparents_grandchildren() -> None:
    pt, cache = make_cache()
    stem = pt.allocate_pages(4)
    x = cache.insert(text(1, 2, 3, 4), stem).node
    g5 = cache.insert(text(1, 2, 3, 4, 5), [*stem, *pt.allocate_pages(1)]).node
    g6 = cache.insert(text(1, 2, 3, 4, 6), [*stem, *pt.allocate_pages(1)]).node
    cache.lock(g5)
    m = cache.match_prefix(text(1, 2, 9))
    prefix = m.last_node
    assert prefix.children == {TextToken(3).key: x} and x.parent is prefix
    assert x.children is not prefix.children and set(x.children.values()) == {g5, g6}
    assert g5.parent is x and g6.parent is x
    assert (prefix.lock_ref, x.lock_ref, g5.lock_ref, g6.lock_ref) == (1, 1, 1, 0)
    cache.unlock(g5)
    assert prefix.lock_ref == x.lock_ref == 0
    cache.check_integrity()


def test_partial_match_never_rounds_up() -> None:
    pt, cache = make_cache()
    pages = pt.allocate_pages(5)
    cache.insert(text(1, 2, 3, 4, 5), pages)
    m = cache.match_prefix(text(1, 2, 3, 9))
    assert (m.matched_kv_length, m.matched_pages.tolist()) == (3, pages[:3].tolist())
    short = cache.match_prefix(text(1, 2))  # the query ends inside a node
    assert (short.matched_kv_length, short.matched_token_count) == (2, 2)
    img_pages = pt.allocate_pages(5)
    cache.insert([TextToken(BOS), ImageToken(1, 3), TextToken(7)], img_pages)
    other = cache.match_prefix([TextToken(BOS), ImageToken(2, 3), TextToken(7)])
    assert other.matched_kv_length == 1  # no credit inside a different image
    cache.check_integrity()
