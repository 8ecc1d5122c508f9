"""Executable invariants of the prefix cache and the page table (design.md section 4).

``check_cache_integrity(cache)`` walks every tree, recomputes every counter, and then hands the
set of cache-owned pages to ``page_table.check_integrity`` for the page-state partition. It is
O(pages + nodes): tests call it after every step, the engine when idle (debug flag).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from .base import CacheIntegrityError, InsertError
from .node import token_keys, token_kv_length

if TYPE_CHECKING:
    from .radix_cache import RadixPrefixCache, TreeNode

__all__ = [
    "check_cache_integrity",
    "check_insert_args",
    "check_insert_start",
    "check_page_table",
]


def _fail(msg: str) -> None:
    raise CacheIntegrityError(msg)


def _check_root(ns, root: TreeNode) -> None:
    if root.namespace != ns or root.parent is not None or root.detached:
        _fail(f"root of {ns} is malformed: {root!r} (namespace={root.namespace})")
    if root.tokens or root.physical_pages:
        _fail(f"root of {ns} holds tokens or pages")
    if not root.children and root.lock_ref == 0:
        _fail(f"empty unlocked root of {ns} was not pruned")


def _check_node(node: TreeNode, parent: TreeNode) -> None:
    if node.detached or node.namespace is not None:
        _fail(f"{node!r} in the tree is detached or carries a namespace")
    if node.parent is not parent:
        _fail(f"{node!r} has a wrong parent pointer")
    if not node.tokens:
        _fail(f"{node!r} has no tokens")
    if node.keys != token_keys(node.tokens):
        _fail(f"{node!r}: cached keys differ from its tokens' keys")
    if len(node.physical_pages) != token_kv_length(node.tokens):
        _fail(
            f"{node!r}: {len(node.physical_pages)} pages for "
            f"{token_kv_length(node.tokens)} KV positions"
        )
    if node.lock_ref < 0:
        _fail(f"{node!r} has a negative lock_ref")


def _walk(cache: RadixPrefixCache) -> tuple[dict[int, TreeNode], list[int]]:
    """Check structure; return the page -> owner map and [total, evictable, reclaimable, nodes]."""
    owner: dict[int, TreeNode] = {}
    counts = [0, 0, 0, 0]
    live = cache._policy.live_nodes()
    n_pages = cache.page_table.n_pages
    for ns, root in cache._trees.items():
        _check_root(ns, root)
        stack = [root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for key, child in node.children.items():
                _check_node(child, node)
                if child.keys[0] != key:
                    _fail(f"{child!r} is stored under key {key}, its first key is {child.keys[0]}")
                child_locks += child.lock_ref
                stack.append(child)
            if node.lock_ref < child_locks:
                _fail(f"{node!r}: lock_ref {node.lock_ref} < its children's total {child_locks}")
            if node is root:
                continue
            for p in node.physical_pages:
                if not 1 <= p < n_pages:
                    _fail(f"{node!r} holds page {p} outside 1..{n_pages - 1}")
                if p in owner:
                    _fail(f"page {p} is held by two nodes: {owner[p]!r} and {node!r}")
                if p not in cache._owned:
                    _fail(f"page {p} of {node!r} is not flagged as cache-owned")
                owner[p] = node
            k = len(node.physical_pages)
            counts[0] += k
            counts[3] += 1
            if node.lock_ref == 0:
                counts[2] += k
                if not node.children:
                    counts[1] += k
                    if id(node) not in live:
                        _fail(f"evictable leaf {node!r} has no live eviction-heap entry")
    return owner, counts


def check_cache_integrity(cache: RadixPrefixCache) -> None:
    owner, (total, evictable, reclaimable, nodes) = _walk(cache)
    got = (
        cache.total_cached_pages,
        cache.evictable_page_count(),
        cache.reclaimable_page_count(),
        cache.node_count,
    )
    want = (total, evictable, reclaimable, nodes)
    names = ("total_cached_pages", "evictable", "reclaimable", "node_count")
    for name, g, w in zip(names, got, want, strict=True):
        if g != w:
            _fail(f"counter {name} is {g} but a full walk finds {w}")
    flagged = len(cache._owned)
    if flagged != len(owner):
        _fail(f"{flagged} pages flagged cache-owned but the trees hold {len(owner)}")
    cache.page_table.check_integrity(cache_owned=owner)


def check_page_table(pt, cache_owned: Mapping[int, object]) -> None:
    """Every page but 0 is exactly one of free / cache-owned / private to one row; rows are
    mirrored in the device tensor; a row's cache-owned pages come first."""
    n = pt.n_pages
    is_free = pt._is_free
    free = pt._free
    free_set = set(free)
    if len(free_set) != len(free):
        _fail("the free pool lists a page twice")
    if is_free[0] or 0 in free_set:
        _fail("padding page 0 is in the free pool")
    if sum(is_free) != len(free) or any(not is_free[p] for p in free):
        _fail("free-page flags disagree with the free pool")
    both = next((p for p in cache_owned if is_free[p]), None)
    if both is not None:
        _fail(f"page {both} is both free and cache-owned")
    private: dict[int, int] = {}
    host = pt.page_table.cpu().tolist()
    for b, row in enumerate(pt.page_table_cpu):
        if b == 0 or not pt._active[b]:
            if row or any(host[b]):
                _fail(f"inactive batch row {b} still maps pages")
            continue
        if host[b][: len(row)] != row or any(host[b][len(row) :]):
            _fail(f"device page_table row {b} is out of sync with page_table_cpu")
        seen_private = False
        for pos, p in enumerate(row):
            if not 1 <= p < n or is_free[p]:
                _fail(f"row {b} position {pos} maps page {p}, which is padding, invalid or free")
            if p in cache_owned:
                if seen_private:
                    _fail(
                        f"row {b}: cache-owned page {p} after a private page (erase would free it)"
                    )
            else:
                seen_private = True
                if p in private:
                    _fail(f"private page {p} is mapped twice (rows {private[p]} and {b})")
                private[p] = b
    inactive = {b for b in range(1, pt.max_batch_size + 1) if not pt._active[b]}
    if set(pt._free_rows) != inactive or len(pt._free_rows) != len(inactive):
        _fail("free batch rows disagree with the active flags")
    total = len(free) + len(cache_owned) + len(private)
    if total != n - 1:
        leaked = sorted(set(range(1, n)) - free_set - set(cache_owned) - set(private))
        _fail(
            f"free {len(free)} + cache-owned {len(cache_owned)} + private {len(private)} = "
            f"{total} != {n - 1} usable pages; leaked pages: {leaked[:20]}"
        )


def check_insert_args(
    cache: RadixPrefixCache,
    tokens,
    pages: tuple[int, ...],
    ns,
    from_node: TreeNode | None,
    from_token_idx: int,
    from_page_idx: int,
) -> None:
    """Validate ``insert``'s arguments before anything changes; raises InsertError."""
    n = len(tokens)
    if n == 0:
        raise InsertError("insert needs at least one token (a prompt starts with BOS)")
    if not 0 <= from_token_idx <= n:
        raise InsertError(f"from_token_idx={from_token_idx} outside 0..{n}")
    if from_node is None:
        if from_token_idx != 0 or from_page_idx != 0:
            raise InsertError(
                f"from_token_idx={from_token_idx} / from_page_idx={from_page_idx} given "
                "without from_node; pass the match's last_node (or 0 / 0 on a miss)"
            )
    else:
        check_insert_start(cache, from_node, ns, pages, from_token_idx, from_page_idx)
    expected = from_page_idx + token_kv_length(tokens[from_token_idx:])
    if len(pages) != expected:
        raise InsertError(
            f"insert got {len(pages)} pages for tokens spanning {expected} KV positions "
            f"(one page per position; an ImageToken spans kv_length_ pages). Pass "
            f"from_page_idx = the match's KV length, not its token count"
        )


def check_insert_start(
    cache: RadixPrefixCache,
    node: TreeNode,
    ns,
    pages: tuple[int, ...],
    token_idx: int,
    page_idx: int,
) -> None:
    """``insert``'s ``from_node`` must be attached in ``ns``'s tree, sit at depth
    (token_idx, page_idx), and its path's pages must be the caller's leading pages.
    O(depth) dict lookups plus C-level slice compares; raises InsertError."""
    path = []
    depth_tokens = depth_pages = 0
    cur = node
    if node.detached:
        raise InsertError(
            "from_node was evicted from the cache; lock the matched node between "
            "match_prefix and insert"
        )
    while cur.parent is not None:
        if cur.detached or cur.parent.children.get(cur.keys[0]) is not cur:
            raise InsertError(
                "from_node is no longer in the cache (evicted); lock the matched node "
                "between match_prefix and insert"
            )
        path.append(cur)
        depth_tokens += len(cur.tokens)
        depth_pages += len(cur.physical_pages)
        cur = cur.parent
    if cur.detached or cache._trees.get(ns) is not cur:
        raise InsertError(f"from_node does not belong to the tree of namespace {ns}")
    if token_idx != depth_tokens or page_idx != depth_pages:
        raise InsertError(
            f"from_token_idx={token_idx}, from_page_idx={page_idx} do not match from_node's "
            f"depth ({depth_tokens} tokens, {depth_pages} KV positions); pass the match's "
            "matched_token_count and matched_kv_length"
        )
    end = depth_pages
    for p in path:  # deepest first
        start = end - len(p.physical_pages)
        if pages[start:end] != p.physical_pages:
            raise InsertError(
                f"pages[{start}:{end}] are not the cached pages of from_node's path; "
                "map the matched pages into the row and pass the row's pages"
            )
        end = start
