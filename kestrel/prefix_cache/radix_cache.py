"""RadixPrefixCache: one radix tree of cached KV pages per namespace.

The contract (ownership, locks, the runtime protocol) is in ``base.py``. Notes on this
implementation:

* Nodes hold a run of tokens (an edge label) and their pages as a read-only int32 array;
  ``keys`` caches the tokens' key tuples so matching compares tuple slices in C instead of
  calling a method per token, and the page-identity guard compares page arrays as memory.
* Page ownership lives in the page table's pool (one state byte per page): a claim or an
  eviction checks every page's state with one vectorized gather, and an eviction returns the
  pages of all its victims to the pool in one call.
* A split keeps the original node object as the *suffix* (it keeps its children dict, its
  grandchildren's parent pointers, its heap entries and any lock holder's reference) and
  puts a new prefix node above it. Nothing below the split point is touched.
* Access times come from a logical clock (one tick per match / insert), which makes LRU order
  deterministic and testable.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np

from kestrel.kv.pool import PageState, PageTableError, as_pages

from .base import BasePrefixCache, CacheLockError, InsertError
from .eviction import LRUEvictionPolicy
from .integrity import check_cache_integrity, check_insert_args
from .namespace import CacheNamespace
from .node import (
    BAD_TOKENS,
    EMPTY_PAGES,
    CacheStats,
    InsertResult,
    MatchResult,
    TreeNode,
    common_prefix_len,
    frozen_pages,
    key_of,
    miss,
    start_of,
    token_kv_length,
)

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from kestrel.kv.page_table import PageTable
    from kestrel.tokens import CacheToken


__all__ = ["CacheStats", "InsertResult", "MatchResult", "RadixPrefixCache", "TreeNode"]


class RadixPrefixCache(BasePrefixCache):
    """Namespaced radix tree over a :class:`~kestrel.kv.page_table.PageTable` (page_size 1)."""

    def __init__(self, page_table: PageTable) -> None:
        if getattr(page_table, "page_size", 1) != 1:
            raise ValueError(
                f"RadixPrefixCache needs page_size=1 (one KV position per page), "
                f"got page_size={page_table.page_size}"
            )
        self.page_table = page_table
        self._trees: dict[tuple, TreeNode] = {}  # namespace.key -> root (root.namespace)
        self._roots = MappingProxyType(self._trees)
        self._default_namespace = CacheNamespace()
        self._policy = LRUEvictionPolicy()
        self._clock = 0
        self._total_cached_pages = 0
        self._evictable = 0
        self._reclaimable = 0
        self._node_count = 0
        self._evicted_pages = 0

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
        return self.page_table.pool.state_of(page) is PageState.CACHED

    def roots(self) -> Mapping[tuple, TreeNode]:
        return self._roots

    def queued_node_ids(self) -> set[int]:
        return self._policy.live_nodes()

    def stats(self) -> CacheStats:
        return CacheStats(
            namespaces=len(self._trees),
            nodes=self._node_count,
            cached_pages=self._total_cached_pages,
            evictable_pages=self._evictable,
            reclaimable_pages=self._reclaimable,
            locked_pages=self._total_cached_pages - self._reclaimable,
            evicted_pages=self._evicted_pages,
            queued_entries=len(self._policy),
        )

    def check_integrity(self) -> None:
        check_cache_integrity(self)

    # ------------------------------------------------------------------ match
    def match_prefix(
        self, tokens: Sequence[CacheToken], namespace: CacheNamespace | None = None
    ) -> MatchResult:
        if type(namespace) is not CacheNamespace:
            namespace = self._resolve(namespace)
        root = self._trees.get(namespace.key)
        n = len(tokens)
        if root is None or n == 0:
            return tuple.__new__(MatchResult, (EMPTY_PAGES, 0, 0, None, tokens))  # a miss
        node, i, path = root, 0, []
        try:
            while i < n:
                child = node.children.get(tokens[i].key)
                if child is None:
                    break
                ck = child._keys or child.keys
                m = len(ck)
                if m > 1:
                    seg = tuple(map(key_of, tokens[i : i + m]))
                    if seg != ck:  # the query diverges or ends inside this node: split it
                        j = common_prefix_len(seg, ck)
                        path.append(self._split(child, j))
                        node, i = path[-1], i + j
                        break
                path.append(child)
                node, i = child, i + m
        except AttributeError:
            raise TypeError(BAD_TOKENS.format(tokens)) from None
        if node is root:
            return miss(tokens)
        self._touch_path(node)
        if len(path) == 1:
            pages = node.physical_pages
        else:
            pages = np.concatenate([p.physical_pages for p in path])
        return tuple.__new__(MatchResult, (pages, len(pages), i, node, tokens))

    # ----------------------------------------------------------------- insert
    def insert(
        self,
        tokens: Sequence[CacheToken],
        pages: Sequence[int] | np.ndarray,
        namespace: CacheNamespace | None = None,
        from_node: TreeNode | None = None,
        from_token_idx: int = 0,
        from_page_idx: int = 0,
    ) -> InsertResult:
        ns = self._resolve(namespace)
        pages = as_pages(pages)
        root = self._trees.get(ns.key)
        check_insert_args(root, tokens, pages, from_node, from_token_idx, from_page_idx)
        if from_node is not None:
            return self._insert_from(from_node, tokens, pages, from_token_idx, from_page_idx)
        if root is not None:
            return self._insert_from(root, tokens, pages, 0, 0)
        # Fresh namespace: claim first (it validates), then create the root.
        leaf = self._add_leaf(TreeNode(namespace=ns), tokens, pages, self._tick(), new_root=ns)
        return tuple.__new__(InsertResult, (leaf, len(pages)))

    def _insert_from(
        self, node: TreeNode, tokens: Sequence[CacheToken], pages: np.ndarray, i: int, pi: int
    ) -> InsertResult:
        n = len(tokens)
        while i < n:
            child = node.children.get(tokens[i].key)
            if child is None:
                break
            j, m = _overlap(child, tokens, i)
            cp = child.physical_pages
            pj = len(cp) if j == m else self._page_offset(child, j)
            if pages[pi : pi + pj].tobytes() != cp[:pj].tobytes():
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
        return tuple.__new__(InsertResult, (leaf, len(leaf.physical_pages)))

    def _add_leaf(
        self,
        parent: TreeNode,
        tokens: Sequence[CacheToken],
        pages: np.ndarray,
        tick: int,
        new_root: CacheNamespace | None = None,
    ) -> TreeNode:
        try:
            self.page_table.pool.claim(pages)  # (PageTable.claim_pages, one call shorter)
        except PageTableError as exc:
            raise InsertError(str(exc)) from None
        leaf = TreeNode(parent, tuple(tokens), None, frozen_pages(pages), tick)
        if new_root is not None:
            self._trees[new_root.key] = parent
        elif not parent.children and parent.lock_ref == 0:
            self._evictable -= len(parent.physical_pages)  # parent stops being a leaf
        parent.children[leaf.key] = leaf
        k = len(pages)
        self._total_cached_pages += k
        self._reclaimable += k
        self._evictable += k
        self._node_count += 1
        self._policy.push(leaf)
        return leaf

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
        parent, pages, keys = node.parent, node.physical_pages, node.keys
        prefix = TreeNode(
            parent, node.tokens[:j], keys[:j], pages[:pj], node.last_access_time, node.lock_ref
        )
        parent.children[prefix.key] = prefix
        node.tokens, node._keys, node.key = node.tokens[j:], keys[j:], keys[j]
        prefix.children[node.key] = node
        node.physical_pages = pages[pj:]
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
        """See the contract; the victims' pages go back to the pool in one vectorized call
        (a page that is not cache-owned by then means the pool was corrupted: it raises
        DoubleFreeError after the victims left the tree)."""
        if needed_pages < 0:
            raise ValueError(f"needed_pages must be >= 0, got {needed_pages}")
        freed, chunks = 0, []
        while freed < needed_pages:
            victim = self._policy.pop()
            if victim is None:
                if self._evictable == 0:
                    break
                self._rebuild_heap()  # defensive: the heap lost a candidate
                victim = self._policy.pop()
                if victim is None:
                    break
            chunks.append(victim.physical_pages)
            if self.host is not None:  # its KV copied out before the pages are reused
                self.host.spill(start_of(victim), victim.tokens, victim.keys, victim.physical_pages)
            freed += self._evict_leaf(victim)
        if chunks:
            self.page_table.evict_pages(chunks)
        return freed

    def _evict_leaf(self, leaf: TreeNode) -> int:
        parent = leaf.parent
        del parent.children[leaf.key]
        leaf.parent = None
        leaf.detached = True
        k = len(leaf.physical_pages)
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
        del self._trees[root.namespace.key]
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
        self._clock += 1
        now = self._clock
        while node.parent is not None:
            node.last_access_time = now
            node = node.parent


def _overlap(child: TreeNode, tokens: Sequence[CacheToken], i: int) -> tuple[int, int]:
    """(tokens of ``child`` that ``tokens[i:]`` matches, ``child``'s token count).

    The caller found ``child`` under ``tokens[i].key``, so at least one token matches. One C
    slice compare in the common case; a binary search over slices only on divergence.
    """
    ck = child._keys or child.keys
    m = len(ck)
    if m == 1:
        return 1, 1
    seg = tuple(map(key_of, tokens[i : i + m]))
    return (m if seg == ck else common_prefix_len(seg, ck)), m
