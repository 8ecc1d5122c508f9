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

from dataclasses import dataclass, field
from operator import attrgetter, methodcaller
from typing import TYPE_CHECKING

from .base import BasePrefixCache, CacheLockError, InsertError
from .eviction import LRUEvictionPolicy
from .namespace import CacheNamespace

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .tokens import CacheToken

__all__ = ["CacheStats", "InsertResult", "MatchResult", "RadixPrefixCache", "TreeNode"]

_key = attrgetter("key")
_kv = methodcaller("kv_length")


def _keys(tokens: Sequence[CacheToken]) -> tuple[tuple, ...]:
    try:
        return tuple(map(_key, tokens))
    except AttributeError:
        raise TypeError(_BAD_TOKENS.format(tokens)) from None


def _kv_length(tokens: Sequence[CacheToken]) -> int:
    try:
        return sum(map(_kv, tokens))
    except AttributeError:
        raise TypeError(_BAD_TOKENS.format(tokens)) from None


_BAD_TOKENS = "tokens must be cache tokens (TextToken, CoordToken, SizeToken, ImageToken): {!r:.200}"


def _common_prefix_len(a: tuple, b: tuple) -> int:
    """Length of the common prefix of two key tuples whose first elements are known equal.

    Binary search over C-level slice comparisons: O(n log n) element compares in C instead of
    a Python loop over every token.
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n - 1  # invariant: a[:lo] == b[:lo] and a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(slots=True, eq=False)
class TreeNode:
    """A cached run of tokens and the pages holding their KV.

    Invariants: ``len(physical_pages) == sum(t.kv_length() for t in tokens)``; ``keys`` are the
    tokens' keys; the parent holds this node under ``keys[0]``. Roots have no tokens or pages
    and carry their ``namespace``. ``detached`` marks nodes that were evicted or pruned.
    Identity semantics (``eq=False``): nodes are hashed and compared by object.
    """

    children: dict[tuple, TreeNode] = field(default_factory=dict)
    parent: TreeNode | None = None
    tokens: tuple[CacheToken, ...] = ()
    keys: tuple[tuple, ...] = ()
    physical_pages: tuple[int, ...] = ()
    lock_ref: int = 0
    last_access_time: int = 0
    heap_version: int = 0
    namespace: CacheNamespace | None = None
    detached: bool = False

    @property
    def total_kv_length(self) -> int:
        return len(self.physical_pages)

    def is_leaf(self) -> bool:
        return not self.children

    def is_root(self) -> bool:
        return self.parent is None and self.namespace is not None

    def __repr__(self) -> str:
        kind = "root" if self.is_root() else "node"
        return (
            f"TreeNode({kind}, tokens={len(self.tokens)}, pages={len(self.physical_pages)}, "
            f"children={len(self.children)}, lock_ref={self.lock_ref}, "
            f"detached={self.detached})"
        )


@dataclass(frozen=True, slots=True)
class MatchResult:
    """``matched_pages`` hold the KV of the first ``matched_token_count`` tokens
    (``matched_kv_length`` positions); ``last_node`` is the node the match ends on (lock it),
    ``None`` on a miss."""

    matched_pages: list[int]
    matched_kv_length: int
    matched_token_count: int
    last_node: TreeNode | None
    unmatched_tokens: list


@dataclass(frozen=True, slots=True)
class InsertResult:
    """``node`` ends at the deepest position the caller's pages are cached for;
    ``inserted_pages`` is how many of the caller's pages the cache claimed (0 if none)."""

    node: TreeNode
    inserted_pages: int


@dataclass(frozen=True, slots=True)
class CacheStats:
    namespaces: int
    nodes: int
    cached_pages: int
    evictable_pages: int
    reclaimable_pages: int
    locked_pages: int


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
        # _owned[p] == 1 iff page p is held by a node: O(1) claim and free checks.
        self._owned = bytearray(page_table.n_pages)

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
        return bool(self._owned[page])

    def first_owned(self, pages: Sequence[int]) -> int | None:
        """The first page of ``pages`` the cache owns, or None (used by PageTable.erase)."""
        owned = self._owned
        return next((p for p in pages if owned[p]), None)

    def first_not_owned(self, pages: Sequence[int]) -> int | None:
        owned = self._owned
        return next((p for p in pages if not owned[p]), None)

    def stats(self) -> CacheStats:
        return CacheStats(
            namespaces=len(self._trees),
            nodes=self._node_count,
            cached_pages=self._total_cached_pages,
            evictable_pages=self._evictable,
            reclaimable_pages=self._reclaimable,
            locked_pages=self._total_cached_pages - self._reclaimable,
        )

    def check_integrity(self) -> None:
        from .integrity import check_cache_integrity

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
                ck = child.keys
                m = len(ck)
                j = m
                if m > 1:
                    seg = tuple(map(_key, tokens[i : i + m]))
                    if seg != ck:
                        j = _common_prefix_len(seg, ck)
                if j < m:
                    child = self._split(child, j)
                pages += child.physical_pages
                node = child
                i += j
                if j < m:
                    break
        except AttributeError:
            raise TypeError(_BAD_TOKENS.format(tokens)) from None
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
        n = len(tokens)
        if n == 0:
            raise InsertError("insert needs at least one token (a prompt starts with BOS)")
        pages_t = tuple(pages)
        if from_node is None:
            if from_token_idx != 0 or from_page_idx != 0:
                raise InsertError(
                    f"from_token_idx={from_token_idx} / from_page_idx={from_page_idx} given "
                    "without from_node; pass the match's last_node (or 0 / 0 on a miss)"
                )
        else:
            self._check_start(from_node, ns, pages_t, from_token_idx, from_page_idx, n)
        expected = from_page_idx + _kv_length(tokens[from_token_idx:])
        if len(pages_t) != expected:
            raise InsertError(
                f"insert got {len(pages_t)} pages for tokens spanning {expected} KV positions "
                f"(one page per position; an ImageToken spans kv_length_ pages). Pass "
                f"from_page_idx = the match's KV length, not its token count"
            )
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
            ck = child.keys
            m = len(ck)
            j = m
            if m > 1:
                seg = tuple(map(_key, tokens[i : i + m]))
                if seg != ck:
                    j = _common_prefix_len(seg, ck)
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

    def _check_start(
        self,
        node: TreeNode,
        ns: CacheNamespace,
        pages: tuple[int, ...],
        token_idx: int,
        page_idx: int,
        n_tokens: int,
    ) -> None:
        """``from_node`` must be attached in ``ns``'s tree, sit at depth (token_idx, page_idx),
        and its path's pages must be the caller's leading pages."""
        path = []
        cur = node
        while cur.parent is not None:
            if cur.detached or cur.parent.children.get(cur.keys[0]) is not cur:
                raise InsertError(
                    "from_node is no longer in the cache (evicted); lock the matched node "
                    "between match_prefix and insert"
                )
            path.append(cur)
            cur = cur.parent
        if cur.detached or self._trees.get(ns) is not cur:
            raise InsertError(f"from_node does not belong to the tree of namespace {ns}")
        depth_tokens = sum(len(p.tokens) for p in path)
        depth_pages = sum(len(p.physical_pages) for p in path)
        if (token_idx, page_idx) != (depth_tokens, depth_pages) or token_idx > n_tokens:
            raise InsertError(
                f"from_token_idx={token_idx}, from_page_idx={page_idx} do not match from_node's "
                f"depth ({depth_tokens} tokens, {depth_pages} KV positions); pass the match's "
                "matched_token_count and matched_kv_length"
            )
        off = 0
        for p in reversed(path):
            k = len(p.physical_pages)
            if pages[off : off + k] != p.physical_pages:
                raise InsertError(
                    f"pages[{off}:{off + k}] are not the cached pages of from_node's path; "
                    "map the matched pages into the row and pass the row's pages"
                )
            off += k

    def _add_leaf(
        self,
        parent: TreeNode,
        tokens: Sequence[CacheToken],
        pages: tuple[int, ...],
        tick: int,
        new_root: CacheNamespace | None = None,
    ) -> TreeNode:
        keys = _keys(tokens)
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
        owned = self._owned
        if pages and (min(pages) < 1 or max(pages) >= len(owned)):
            raise InsertError(
                f"pages must lie in 1..{len(owned) - 1} (page 0 is padding), got "
                f"{min(pages)}..{max(pages)}"
            )
        for idx, p in enumerate(pages):
            if owned[p]:
                for q in pages[:idx]:
                    owned[q] = 0
                raise InsertError(f"page {p} is already owned by the cache; pages are claimed once")
            owned[p] = 1

    # ------------------------------------------------------------------ split
    def _page_offset(self, node: TreeNode, j: int) -> int:
        if len(node.physical_pages) == len(node.tokens):
            return j  # every token spans one page
        return _kv_length(node.tokens[:j])

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
            pass  # the prefix's pages now sit in an internal node
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
        owned = self._owned
        for p in pages:
            owned[p] = 0
        parent = leaf.parent
        del parent.children[leaf.keys[0]]
        leaf.parent = None
        leaf.detached = True
        k = len(pages)
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
