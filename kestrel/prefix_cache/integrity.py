"""Executable invariants of the prefix cache (design.md section 4), and insert's argument checks.

``check_cache_integrity(cache)`` walks every tree through the cache's public accessors
(``roots()``, ``queued_node_ids()``, the counters, ``page_table``), recomputes every counter,
checks that the pages the trees hold are exactly the pool's cache-owned pages, once each, and
then runs ``page_table.check_pages()`` for the rest of the page-state partition. It is
O(pages + nodes): tests call it after every step, the engine when idle (debug flag).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kestrel.kv.pool import PageState

from .base import CacheIntegrityError, InsertError
from .node import EMPTY_PAGES, token_keys, token_kv_length

if TYPE_CHECKING:
    from .base import BasePrefixCache
    from .node import TreeNode

__all__ = ["check_cache_integrity", "check_insert_args", "check_insert_start"]


def _fail(msg: str) -> None:
    raise CacheIntegrityError(msg)


def _check_root(key: tuple, root: TreeNode) -> None:
    ns = root.namespace
    if ns is None or ns.key != key or root.parent is not None or root.detached:
        _fail(f"root of {key} is malformed: {root!r} (namespace={ns})")
    if root.tokens or len(root.physical_pages):
        _fail(f"root of {ns} holds tokens or pages")
    if not root.children and root.lock_ref == 0:
        _fail(f"empty unlocked root of {ns} was not pruned")


def _check_node(node: TreeNode, parent: TreeNode, n_pages: int) -> None:
    if node.detached or node.namespace is not None:
        _fail(f"{node!r} in the tree is detached or carries a namespace")
    if node.parent is not parent:
        _fail(f"{node!r} has a wrong parent pointer")
    if not node.tokens:
        _fail(f"{node!r} has no tokens")
    if node.key != node.tokens[0].key or node.keys != token_keys(node.tokens):
        _fail(f"{node!r}: cached keys differ from its tokens' keys")
    pages = node.physical_pages
    if not isinstance(pages, np.ndarray) or pages.dtype != np.int32 or pages.ndim != 1:
        _fail(f"{node!r}: pages are not a 1-D int32 array")
    if len(pages) != token_kv_length(node.tokens):
        _fail(f"{node!r}: {len(pages)} pages for {token_kv_length(node.tokens)} KV positions")
    if len(pages) and (int(pages.min()) < 1 or int(pages.max()) >= n_pages):
        _fail(f"{node!r} holds a page outside 1..{n_pages - 1}")
    if node.lock_ref < 0:
        _fail(f"{node!r} has a negative lock_ref")


def _walk(cache: BasePrefixCache) -> tuple[list[TreeNode], list[int]]:
    """Check structure; return every non-root node and [total, evictable, reclaimable, nodes]."""
    nodes: list[TreeNode] = []
    counts = [0, 0, 0, 0]
    live = cache.queued_node_ids()
    n_pages = cache.page_table.n_pages
    for key, root in cache.roots().items():
        _check_root(key, root)
        stack = [root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for key, child in node.children.items():
                _check_node(child, node, n_pages)
                if child.key != key:
                    _fail(f"{child!r} is stored under key {key}, its first key is {child.key}")
                child_locks += child.lock_ref
                stack.append(child)
            if node.lock_ref < child_locks:
                _fail(f"{node!r}: lock_ref {node.lock_ref} < its children's total {child_locks}")
            if node is root:
                continue
            nodes.append(node)
            k = len(node.physical_pages)
            counts[0] += k
            counts[3] += 1
            if node.lock_ref == 0:
                counts[2] += k
                if not node.children:
                    counts[1] += k
                    if id(node) not in live:
                        _fail(f"evictable leaf {node!r} has no live eviction-heap entry")
    return nodes, counts


def _check_owned_pages(cache: BasePrefixCache, nodes: list[TreeNode]) -> None:
    """The trees hold every cache-owned page of the pool exactly once, and nothing else."""
    pool = cache.page_table.pool
    held = np.concatenate([n.physical_pages for n in nodes]) if nodes else EMPTY_PAGES
    dup = pool.duplicate_of(held)
    if dup is not None:
        owners = [n for n in nodes if dup in n.physical_pages]
        _fail(f"page {dup} is held by two nodes (or twice by one): {owners[:2]!r}")
    states = pool.states()
    held_states = states.take(held)
    for state, what in (
        (PageState.FREE, "both free and cache-owned"),
        (PageState.PRIVATE, "held by a node but not flagged as cache-owned"),
    ):
        bad = np.flatnonzero(held_states == state)
        if len(bad):
            page = int(held[bad[0]])
            owner = next(n for n in nodes if page in n.physical_pages)
            _fail(f"page {page} of {owner!r} is {what}")
    flagged = int(np.count_nonzero(states == PageState.CACHED))
    if flagged != len(held):
        _fail(f"{flagged} pages flagged cache-owned but the trees hold {len(held)}")


def check_cache_integrity(cache: BasePrefixCache) -> None:
    nodes, (total, evictable, reclaimable, n_nodes) = _walk(cache)
    got = (
        cache.total_cached_pages,
        cache.evictable_page_count(),
        cache.reclaimable_page_count(),
        cache.node_count,
    )
    want = (total, evictable, reclaimable, n_nodes)
    names = ("total_cached_pages", "evictable", "reclaimable", "node_count")
    for name, g, w in zip(names, got, want, strict=True):
        if g != w:
            _fail(f"counter {name} is {g} but a full walk finds {w}")
    _check_owned_pages(cache, nodes)
    cache.page_table.check_pages()


def check_insert_args(
    root: TreeNode | None,
    tokens,
    pages: np.ndarray,
    from_node: TreeNode | None,
    from_token_idx: int,
    from_page_idx: int,
) -> None:
    """Validate ``insert``'s arguments before anything changes; raises InsertError.
    ``root`` is the namespace's current root (None if it has no tree)."""
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
        check_insert_start(root, from_node, pages, from_token_idx, from_page_idx)
    expected = from_page_idx + token_kv_length(tokens[from_token_idx:])
    if len(pages) != expected:
        raise InsertError(
            f"insert got {len(pages)} pages for tokens spanning {expected} KV positions "
            f"(one page per position; an ImageToken spans kv_length_ pages). Pass "
            f"from_page_idx = the match's KV length, not its token count"
        )


def check_insert_start(
    root: TreeNode | None, node: TreeNode, pages: np.ndarray, token_idx: int, page_idx: int
) -> None:
    """``insert``'s ``from_node`` must be attached under ``root``, sit at depth
    (token_idx, page_idx), and its path's pages must be the caller's leading pages.
    O(depth) dict lookups plus one memory compare per node; raises InsertError."""
    path = []
    depth_tokens = depth_pages = 0
    cur = node
    if node.detached:
        raise InsertError(
            "from_node was evicted from the cache; lock the matched node between "
            "match_prefix and insert"
        )
    while cur.parent is not None:
        if cur.detached or cur.parent.children.get(cur.key) is not cur:
            raise InsertError(
                "from_node is no longer in the cache (evicted); lock the matched node "
                "between match_prefix and insert"
            )
        path.append(cur)
        depth_tokens += len(cur.tokens)
        depth_pages += len(cur.physical_pages)
        cur = cur.parent
    if cur.detached or root is not cur:
        raise InsertError("from_node does not belong to the tree of this namespace")
    if token_idx != depth_tokens or page_idx != depth_pages:
        raise InsertError(
            f"from_token_idx={token_idx}, from_page_idx={page_idx} do not match from_node's "
            f"depth ({depth_tokens} tokens, {depth_pages} KV positions); pass the match's "
            "matched_token_count and matched_kv_length"
        )
    end = depth_pages
    for p in path:  # deepest first
        start = end - len(p.physical_pages)
        if end > len(pages) or pages[start:end].tobytes() != p.physical_pages.tobytes():
            raise InsertError(
                f"pages[{start}:{end}] are not the cached pages of from_node's path; "
                "map the matched pages into the row and pass the row's pages"
            )
        end = start
