"""RadixPrefixCache: one radix tree of cached KV pages per namespace.

The contract (ownership, locks, the runtime protocol) is in ``base.py``. Notes on this
implementation:

* Nodes hold a run of tokens (an edge label) and their pages; ``keys`` caches the tokens' key
  tuples so matching compares tuple slices in C instead of calling a method per token.
* A split keeps the original node object as the *suffix* (it keeps its children dict, its
  grandchildren's parent pointers, its heap entries and any lock holder's reference) and
  puts a new prefix node above it. Nothing below the split point is touched.
* Access times come from a logical clock (one tick per match / insert), which makes LRU order
  deterministic and testable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import BasePrefixCache, CacheLockError, InsertError
from .eviction import LRUEvictionPolicy
from .integrity import check_cache_integrity, check_insert_args
from .namespace import CacheNamespace
from .node import (
    BAD_TOKENS,
    CacheStats,
    InsertResult,
    MatchResult,
    TreeNode,
    common_prefix_len,
    key_of,
    token_keys,
    token_kv_length,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .tokens import CacheToken

__all__ = ["CacheStats", "InsertResult", "MatchResult", "RadixPrefixCache", "TreeNode"]


class RadixPrefixCache(BasePrefixCache):
    """Namespaced radix tree over a :class:`~kestrel.kv_cache.PageTable` (page_size 1)."""

    def __init__(self, page_table) -> None:
        if getattr(page_table, "page_size", 1) != 1:
            raise ValueError(
                f"RadixPrefixCache needs page_size=1 (one KV position per page), "
                f"got page_size={page_table.page_size}"
            )
        self.page_table = page_table
        self._trees: dict[CacheNamespace, TreeNode] = {}
        self._default_namespace = CacheNamespace()
        self._policy = LRUEvictionPolicy()
        self._clock = 0
        self._total_cached_pages = 0
        self._evictable = 0
        self._reclaimable = 0
        self._node_count = 0
        self._evicted_pages = 0
        # Pages held by some node. A set keeps claim / free checks in C (isdisjoint, update).
        self._owned: set[int] = set()

    # ----------------------------------------------------------------- queries
    @property
    def total_cached_pages(self) -> int:
        return self._total_cached_pages

    @property
    def node_count(self) -> int:
        """Non-root nodes in all trees."""
        return self._node_count

    @property
    def namespace_count(self) -> int:
        return len(self._trees)

    def evictable_page_count(self) -> int:
        return self._evictable

    def reclaimable_page_count(self) -> int:
        return self._reclaimable

    def owns_page(self, page: int) -> bool:
        return page in self._owned

    def first_owned(self, pages: Sequence[int]) -> int | None:
        """The first page of ``pages`` the cache owns, or None (used by PageTable.erase)."""
        owned = self._owned
        if owned.isdisjoint(pages):
            return None
        return next(p for p in pages if p in owned)

    def first_not_owned(self, pages: Sequence[int]) -> int | None:
        owned = self._owned
        if owned.issuperset(pages):
            return None
        return next(p for p in pages if p not in owned)

    def stats(self) -> CacheStats:
        return CacheStats(
            namespaces=len(self._trees),
            nodes=self._node_count,
            cached_pages=self._total_cached_pages,
            evictable_pages=self._evictable,
            reclaimable_pages=self._reclaimable,
            locked_pages=self._total_cached_pages - self._reclaimable,
            evicted_pages=self._evicted_pages,
        )

    def check_integrity(self) -> None:
        check_cache_integrity(self)

    # ------------------------------------------------------------------ match
    def match_prefix(
        self, tokens: Sequence[CacheToken], namespace: CacheNamespace | None = None
    ) -> MatchResult:
        root = self._trees.get(self._resolve(namespace))
        n = len(tokens)
        if root is None or n == 0:
            return MatchResult([], 0, 0, None, list(tokens))
        node, i, pages = root, 0, []
        try:
            while i < n:
                child = node.children.get(tokens[i].key)
                if child is None:
                    break
                j, m = _overlap(child, tokens, i)
                if j < m:
                    child = self._split(child, j)
                pages += child.physical_pages
                node = child
                i += j
                if j < m:
                    break
        except AttributeError:
            raise TypeError(BAD_TOKENS.format(tokens)) from None
        if node is root:
            return MatchResult([], 0, 0, None, list(tokens))
        self._touch_path(node)
        return MatchResult(pages, len(pages), i, node, list(tokens[i:]))

    # ----------------------------------------------------------------- insert
    def insert(
        self,
        tokens: Sequence[CacheToken],
        pages: Sequence[int],
        namespace: CacheNamespace | None = None,
        from_node: TreeNode | None = None,
        from_token_idx: int = 0,
        from_page_idx: int = 0,
    ) -> InsertResult:
        ns = self._resolve(namespace)
        pages_t = tuple(pages)
        check_insert_args(self, tokens, pages_t, ns, from_node, from_token_idx, from_page_idx)
        root = from_node if from_node is not None else self._trees.get(ns)
        if root is None:
            # Fresh namespace: claim first (it validates), then create the root.
            root = TreeNode(namespace=ns)
            leaf = self._add_leaf(root, tokens, pages_t, self._tick(), new_root=ns)
            return InsertResult(leaf, len(pages_t))
        return self._insert_from(root, tokens, pages_t, from_token_idx, from_page_idx)

    def _insert_from(
        self, node: TreeNode, tokens: Sequence[CacheToken], pages: tuple[int, ...], i: int, pi: int
    ) -> InsertResult:
        n = len(tokens)
        while i < n:
            child = node.children.get(tokens[i].key)
            if child is None:
                break
            j, m = _overlap(child, tokens, i)
            cp = child.physical_pages
            pj = len(cp) if j == m else self._page_offset(child, j)
            if pages[pi : pi + pj] != cp[:pj]:
                # Page identity guard: the caller computed this span into its own pages
                # (a duplicate prefill). Claim nothing more; its pages stay private.
                self._touch_path(node)
                return InsertResult(node, 0)
            if j < m:
                child = self._split(child, j)
            node, i, pi = child, i + j, pi + pj
            if j < m:
                break
        self._touch_path(node)
        if i == n:
            return InsertResult(node, 0)
        leaf = self._add_leaf(node, tokens[i:], pages[pi:], self._clock)
        return InsertResult(leaf, len(leaf.physical_pages))

    def _add_leaf(
        self,
        parent: TreeNode,
        tokens: Sequence[CacheToken],
        pages: tuple[int, ...],
        tick: int,
        new_root: CacheNamespace | None = None,
    ) -> TreeNode:
        keys = token_keys(tokens)
        self._claim(pages)
        leaf = TreeNode(
            parent=parent,
            tokens=tuple(tokens),
            keys=keys,
            physical_pages=pages,
            last_access_time=tick,
        )
        if new_root is not None:
            self._trees[new_root] = parent
        elif not parent.children and parent.lock_ref == 0:
            self._evictable -= len(parent.physical_pages)  # parent stops being a leaf
        parent.children[keys[0]] = leaf
        k = len(pages)
        self._total_cached_pages += k
        self._reclaimable += k
        self._evictable += k
        self._node_count += 1
        self._policy.push(leaf)
        return leaf

    def _claim(self, pages: tuple[int, ...]) -> None:
        if not pages:
            return
        if min(pages) < 1:  # the upper bound was checked when the pages were mapped
            raise InsertError(f"page {min(pages)} cannot be cached (page 0 is padding)")
        owned = self._owned
        if not owned.isdisjoint(pages):
            dup = next(p for p in pages if p in owned)
            raise InsertError(f"page {dup} is already owned by the cache; pages are claimed once")
        before = len(owned)
        owned.update(pages)
        if len(owned) != before + len(pages):  # a page listed twice
            owned.difference_update(pages)
            raise InsertError("the pages to insert list a page twice")

    # ------------------------------------------------------------------ split
    def _page_offset(self, node: TreeNode, j: int) -> int:
        if len(node.physical_pages) == len(node.tokens):
            return j  # every token spans one page
        return token_kv_length(node.tokens[:j])

    def _split(self, node: TreeNode, j: int) -> TreeNode:
        """Put a new node holding ``node``'s first ``j`` tokens above it; return the new node.

        ``node`` stays the suffix, so its children dict and its grandchildren's parent pointers
        need no change, and lock holders' references still point to the deepest node.
        """
        pj = self._page_offset(node, j)
        parent = node.parent
        prefix = TreeNode(
            children={node.keys[j]: node},
            parent=parent,
            tokens=node.tokens[:j],
            keys=node.keys[:j],
            physical_pages=node.physical_pages[:pj],
            lock_ref=node.lock_ref,
            last_access_time=node.last_access_time,
        )
        parent.children[node.keys[0]] = prefix
        node.tokens = node.tokens[j:]
        node.keys = node.keys[j:]
        node.physical_pages = node.physical_pages[pj:]
        node.parent = prefix
        self._node_count += 1
        if node.lock_ref == 0 and not node.children:
            self._evictable -= pj  # the prefix's pages now sit in an internal node
        return prefix

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode | None) -> None:
        if node is None:
            return
        if node.detached:
            raise CacheLockError(f"cannot lock {node}: it was evicted from the cache")
        while node is not None:
            if node.lock_ref == 0:
                k = len(node.physical_pages)
                self._reclaimable -= k
                if not node.children:
                    self._evictable -= k
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode | None) -> None:
        if node is None:
            return
        if node.lock_ref <= 0:
            raise CacheLockError(
                f"unlock of {node} with lock_ref={node.lock_ref}: more unlocks than locks "
                "(each sequence must unlock its one lock node exactly once)"
            )
        top = node
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                k = len(node.physical_pages)
                self._reclaimable += k
                if not node.children and node.parent is not None:
                    self._evictable += k
                    self._policy.push(node)
            top = node
            node = node.parent
        if top.lock_ref == 0 and not top.children and not top.detached:
            self._prune_root(top)  # an emptied root outlived only by its lock

    # --------------------------------------------------------------- eviction
    def evict(self, needed_pages: int) -> int:
        if needed_pages < 0:
            raise ValueError(f"needed_pages must be >= 0, got {needed_pages}")
        freed = 0
        while freed < needed_pages:
            victim = self._policy.pop()
            if victim is None:
                if self._evictable == 0:
                    break
                self._rebuild_heap()  # defensive: the heap lost a candidate
                victim = self._policy.pop()
                if victim is None:
                    break
            freed += self._evict_leaf(victim)
        return freed

    def _evict_leaf(self, leaf: TreeNode) -> int:
        pages = leaf.physical_pages
        self.page_table.free_pages_to_pool(pages)
        self._owned.difference_update(pages)
        parent = leaf.parent
        del parent.children[leaf.keys[0]]
        leaf.parent = None
        leaf.detached = True
        k = len(pages)
        self._evicted_pages += k
        self._total_cached_pages -= k
        self._reclaimable -= k
        self._evictable -= k
        self._node_count -= 1
        if not parent.children and parent.lock_ref == 0:
            if parent.parent is None:
                self._prune_root(parent)
            else:
                self._evictable += len(parent.physical_pages)
                self._policy.push(parent)
        return k

    def _prune_root(self, root: TreeNode) -> None:
        del self._trees[root.namespace]
        root.detached = True

    def _rebuild_heap(self) -> None:
        self._policy.clear()
        for root in self._trees.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                if node.children:
                    stack.extend(node.children.values())
                elif node.lock_ref == 0:
                    self._policy.push(node)

    # ---------------------------------------------------------------- helpers
    def _resolve(self, namespace: CacheNamespace | None) -> CacheNamespace:
        if namespace is None:
            return self._default_namespace
        if not isinstance(namespace, CacheNamespace):
            raise TypeError(f"namespace must be a CacheNamespace or None, got {namespace!r}")
        return namespace

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _touch_path(self, node: TreeNode) -> None:
        """Mark ``node`` and its ancestors used now (the heap catches up lazily)."""
        now = self._tick()
        while node.parent is not None:
            node.last_access_time = now
            node = node.parent


def _overlap(child: TreeNode, tokens: Sequence[CacheToken], i: int) -> tuple[int, int]:
    """(tokens of ``child`` that ``tokens[i:]`` matches, ``child``'s token count).

    The caller found ``child`` under ``tokens[i].key``, so at least one token matches. One C
    slice compare in the common case; a binary search over slices only on divergence.
    """
    ck = child.keys
    m = len(ck)
    if m == 1:
        return 1, 1
    seg = tuple(map(key_of, tokens[i : i + m]))
    return (m if seg == ck else common_prefix_len(seg, ck)), m
