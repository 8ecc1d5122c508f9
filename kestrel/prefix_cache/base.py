"""The prefix cache contract, stated once.

Every implementation (today only :class:`~kestrel.prefix_cache.radix_cache.RadixPrefixCache`)
follows the rules below; the implementation docstrings stay terse and refer here.

Threading
    All calls come from one thread (the scheduler's). Nothing here takes a mutex.

Page ownership (page_size is 1, so a page is one KV position)
    Every physical page except the padding page 0 is in exactly one state:

    * free: in the page table's free pool;
    * cache-owned: held by exactly one tree node; any number of batch rows may map it;
    * batch-private: mapped by exactly one batch row and owned by nobody else.

    The page table's pool keeps every page's state (one byte per page, see
    ``kestrel/kv/pool.py``). ``insert`` moves batch-private pages to cache-owned through
    ``page_table.claim_pages``; ``evict`` moves cache-owned pages back to the free pool
    through ``page_table.evict_pages``; ``PageTable.erase(row, cached_page_count)`` frees only
    the row's pages after its leading ``cached_page_count`` (which must be cache-owned). A
    row's cache-owned pages therefore always form a prefix of the row. Each move checks the
    states of all its pages first (vectorized) and refuses a double free or double claim.

Locks
    ``lock(node)`` adds one reference to ``node`` and every ancestor up to its namespace root;
    ``unlock`` removes it. A node with ``lock_ref > 0`` is never evicted, and since a parent's
    count is at least each child's, a locked node's whole path stays too. Locks protect pages
    but never own them. ``unlock`` below zero raises ``CacheLockError`` and changes nothing.

The runtime protocol (one request; design.md 3.4, seed ``start_sequence``)
    Written once, in :class:`~kestrel.prefix_cache.lease.CacheLease`, which the runtime and
    the property test's model-free runtime both drive:

    ``CacheLease.prepare`` (steps 1-5)
    1. ``m = match_prefix(cache_tokens, ns)`` (may split a node; never creates a namespace).
    2. ``skip = m.matched_kv_length``; on a full-prompt hit the last cache token (one
       position, or a whole image block) is recomputed into private pages to get logits.
    3. Allocate a batch row, ``map_pages(row, 0, m.matched_pages[:skip])``.
    4. Temporary lock: ``lock(m.last_node)`` (none on a miss, where it is ``None``).
    5. ``reserve(row, target_len)``: private pages for the suffix and the decode budget
       (may evict unlocked leaves).

    The caller prefills positions ``skip .. prompt_len - 1`` into the row's private pages.

    ``CacheLease.commit`` (steps 6-8)
    6. Unless the whole prompt was already cached: ``r = insert(cache_tokens,
       row_pages(row, 0, prompt_len), ns, from_node=m.last_node,
       from_token_idx=m.matched_token_count, from_page_idx=skip)``.
    7. Lock transfer, keeping exactly one lock: on a miss ``lock(r.node)``; if ``r.node is
       m.last_node`` keep the temporary lock (identity case); else ``lock(r.node)`` then
       ``unlock(m.last_node)``.
    8. ``cache_owned_page_count = skip + r.inserted_pages`` (``skip`` on a full-prompt hit).

    ``CacheLease.release`` (step 9): one ``unlock(lock_node)`` then ``erase(row,
    cache_owned_page_count)``. ``CacheLease.abort`` is the failure path of any step: it
    unlocks every lock held and erases the row with the cache-owned count reached so far, so
    nothing leaks.

    Admission: a request that will lock its matched path and back off one position can need
    one page more than ``target_len`` counted against free + reclaimable pages; admit with
    ``can_reserve_with_eviction(target_len + 1)`` or re-check after the temporary lock.

Insert semantics
    ``insert`` walks the existing path from ``from_node`` and claims only pages for tokens
    that have no node yet. While walking it checks page identity: if the caller's pages for
    an existing node's span are not exactly that node's pages (a duplicate prefill), it stops,
    claims nothing more, and returns the deepest node whose pages the caller shares, with
    ``inserted_pages == 0``. The caller's duplicate pages stay batch-private and are freed at
    release; its lock never moves onto the other request's node.

Counters (all O(1), maintained incrementally)
    ``total_cached_pages``: pages in all nodes. ``evictable_page_count()``: pages in unlocked
    leaves (freeable right now). ``reclaimable_page_count()``: pages in every unlocked node
    (freeable by cascading leaf eviction). Admission uses free + reclaimable.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from kestrel.kv.pool import CacheIntegrityError

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    import numpy as np

    from kestrel.tokens import CacheToken

    from .host_tier import HostKVTier
    from .namespace import CacheNamespace
    from .node import InsertResult, MatchResult, TreeNode

__all__ = ["BasePrefixCache", "CacheIntegrityError", "CacheLockError", "InsertError"]


class CacheLockError(RuntimeError):
    """A lock or unlock that would break the lock discipline (underflow, evicted node)."""


class InsertError(ValueError):
    """``insert`` was called with tokens, pages or a start point that do not agree."""


class BasePrefixCache(ABC):
    """Abstract prefix cache; see the module docstring for the full contract."""

    # Optional second tier: the KV of evicted leaves kept in host memory and copied back on a
    # later match (``host_tier.py``); None: no such tier.
    host: HostKVTier | None = None

    @abstractmethod
    def match_prefix(
        self, tokens: Sequence[CacheToken], namespace: CacheNamespace | None = None
    ) -> MatchResult:
        """Longest cached prefix of ``tokens`` in ``namespace`` (default: base model, no image).

        Mutates: may split one node so the match ends on a node boundary; refreshes the access
        time of the matched path. Never creates a namespace root. Locks nothing.
        """

    @abstractmethod
    def insert(
        self,
        tokens: Sequence[CacheToken],
        pages: Sequence[int] | np.ndarray,
        namespace: CacheNamespace | None = None,
        from_node: TreeNode | None = None,
        from_token_idx: int = 0,
        from_page_idx: int = 0,
    ) -> InsertResult:
        """Cache ``tokens`` whose KV lives in ``pages`` (one page per KV position).

        ``from_node`` / ``from_token_idx`` / ``from_page_idx`` resume from a match (pass the
        match's last node, token count and ``skip``). Creates the namespace root if needed.
        Returns the node ending at the deepest position the caller's pages are cached for and
        how many of the caller's pages the cache claimed; the caller adds that to ``skip`` for
        its ``cache_owned_page_count``. New nodes start unlocked.
        """

    @abstractmethod
    def lock(self, node: TreeNode | None) -> None:
        """Add a reference to ``node`` and its ancestors; ``None`` is a no-op."""

    @abstractmethod
    def unlock(self, node: TreeNode | None) -> None:
        """Drop a reference taken by ``lock``; ``None`` is a no-op; underflow raises."""

    @abstractmethod
    def evict(self, needed_pages: int) -> int:
        """Evict unlocked leaves (LRU first, cascading upward) until ``needed_pages`` are freed
        or nothing evictable is left; returns the pages actually freed (may exceed the need)."""

    @abstractmethod
    def evictable_page_count(self) -> int:
        """Pages in unlocked leaves. O(1)."""

    @abstractmethod
    def reclaimable_page_count(self) -> int:
        """Pages in all unlocked nodes (reachable by cascading eviction). O(1)."""

    @property
    @abstractmethod
    def total_cached_pages(self) -> int:
        """Pages owned by the cache. O(1)."""

    @abstractmethod
    def roots(self) -> Mapping[tuple, TreeNode]:
        """Every namespace's tree root, keyed by ``namespace.key`` (a read-only live view;
        ``root.namespace`` is the namespace itself)."""

    @abstractmethod
    def queued_node_ids(self) -> set[int]:
        """ids of the nodes with a current eviction-queue entry (for integrity checks)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Walk everything and raise ``CacheIntegrityError`` on any violated invariant."""
