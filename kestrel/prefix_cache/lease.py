"""CacheLease: one request's hold on the KV pool and the prefix cache, the protocol written once.

The runtime (``kestrel/runtime/runtime.py``) and the property test's model-free runtime
(``tests/unit/cache_protocol.py``) both drive this object, so the hypothesis state machine
checks the code that serves requests. It owns no model code:

    lease = CacheLease.prepare(page_table, cache, cache_tokens, namespace,
                               prompt_length=..., max_length=...)   # steps 1-5 of base.py
    ... the caller prefills positions lease.skip .. prompt_length - 1 of lease.row ...
    lease.commit()                                                  # steps 6-8
    ... decode into the row's private pages ...
    lease.release(retained)                                         # step 9

``release(retained)`` first inserts the tokens fed in decode (their KV sits in the row right
after the prompt) under the prompt's node, so those private pages become cache-owned and a
later prompt that continues through them (the next turn of a conversation) hits.

``prepare`` cleans up after itself when it fails; every later failure (the caller's prefill,
``commit``) ends in ``abort()``, which unlocks every lock held and erases the row with the
cache-owned count reached so far. With ``cache=None`` (caching off) nothing is matched,
inserted or locked; the lease is then just a row and its private pages.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from .node import miss, token_kv_length

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kestrel.kv.page_table import PageTable
    from kestrel.tokens import CacheToken

    from .base import BasePrefixCache
    from .namespace import CacheNamespace
    from .node import MatchResult, TreeNode

__all__ = ["CacheLease", "LeaseError", "LeasePhase"]


class LeaseError(RuntimeError):
    """A lease step out of order (commit twice, release twice, use after release), or a hit
    that breaks the caller's invariant (an image hit that does not cover the image)."""


class LeasePhase(Enum):
    PREPARED = "prepared"  # row mapped, temporary lock held, private pages reserved
    COMMITTED = "committed"  # prompt inserted, one lock on the deepest prompt node
    RELEASED = "released"  # lock dropped, row erased (normally or by abort)


class CacheLease:
    """A batch row, its pages and its one cache lock, from match to release.

    ``row``: the batch row. ``match``: what ``prepare`` matched. ``skip``: reused cached
    positions (``matched``; on a full-prompt hit, back one cache token: one position after text,
    the whole block when the prompt ends in an image). ``cache_owned``: the row's leading
    cache-owned pages (``skip``, then ``skip + inserted`` after commit). ``inserted``: pages
    the commit's insert claimed, ``None`` when nothing was inserted (full-prompt hit, cache
    off). ``locks``: the nodes this lease holds a lock on (one once committed, with the cache
    on). ``cached_length``: KV positions of the cacheable tokens. ``retained``: decoded
    positions the release inserted (0 until then, or when nothing could be kept).
    """

    __slots__ = (
        "cache",
        "cache_owned",
        "cached_length",
        "inserted",
        "locks",
        "match",
        "max_length",
        "namespace",
        "page_table",
        "phase",
        "prompt_length",
        "restored",
        "retained",
        "row",
        "skip",
        "tokens",
    )

    def __init__(
        self,
        page_table: PageTable,
        cache: BasePrefixCache | None,
        tokens: Sequence[CacheToken],
        namespace: CacheNamespace,
        prompt_length: int,
        max_length: int,
    ) -> None:
        self.page_table = page_table
        self.cache = cache
        self.tokens = tokens
        self.namespace = namespace
        self.prompt_length = prompt_length
        self.max_length = max_length
        self.cached_length = token_kv_length(tokens)
        if not 0 < self.cached_length <= prompt_length <= max_length:
            raise LeaseError(
                f"need 0 < cacheable ({self.cached_length}) <= prompt ({prompt_length}) <= "
                f"max_length ({max_length}) positions"
            )
        self.row = 0
        self.match: MatchResult = miss(tokens)
        self.skip = 0
        self.cache_owned = 0
        self.inserted: int | None = None
        self.retained = 0
        self.restored = 0  # matched pages copied back from the host tier by this lease
        self.locks: list[TreeNode] = []
        self.phase = LeasePhase.PREPARED

    @classmethod
    def prepare(
        cls,
        page_table: PageTable,
        cache: BasePrefixCache | None,
        tokens: Sequence[CacheToken],
        namespace: CacheNamespace,
        *,
        prompt_length: int,
        max_length: int,
        min_hit: int = 0,
    ) -> CacheLease:
        """Steps 1-5: match ``tokens`` (the prompt's cacheable prefix) in ``namespace``, take
        a row, map and lock the reused pages, reserve private pages up to ``max_length``.
        A hit shorter than ``min_hit`` positions raises (an image hit must cover BOS + the
        image block). On any failure everything taken is given back before it raises."""
        lease = cls(page_table, cache, tokens, namespace, prompt_length, max_length)
        try:
            lease._acquire(min_hit)
        except BaseException:
            lease.abort()
            raise
        return lease

    def _acquire(self, min_hit: int) -> None:
        pt, cache = self.page_table, self.cache
        held = None
        if cache is not None:
            host = cache.host
            if host is not None:  # copy back what the host tier holds past the device match
                held, self.restored = host.restore(cache, self.tokens, self.namespace)
                if held is not None:
                    self.locks.append(held)
            self.match = cache.match_prefix(self.tokens, self.namespace)
        m = self.match
        self.row = pt.allocate()
        if m.matched_kv_length:
            skip = m.matched_kv_length
            if skip >= self.prompt_length:  # a full-prompt hit recomputes its last cache token
                skip = self.prompt_length - self.tokens[-1].kv_length()  # (an image: all of it)
            if skip < min_hit:
                raise LeaseError(
                    f"prefix-cache invariant violated: a hit covers {m.matched_kv_length} "
                    f"positions, less than the {min_hit} it must (BOS + image)"
                )
            pt.map_pages(self.row, 0, m.matched_pages[:skip])
            self.skip = self.cache_owned = skip  # mapped cache pages: erase must keep them
            cache.lock(m.last_node)
            self.locks.append(m.last_node)
        if held is not None:  # the restore's lock, now covered by the match's
            cache.unlock(held)
            self.locks.remove(held)
        pt.reserve(self.row, self.max_length)

    @property
    def lock_node(self) -> TreeNode | None:
        """The node this lease holds its lock on (None with the cache off, or released)."""
        if len(self.locks) > 1:
            raise LeaseError(f"a lease holds {len(self.locks)} locks; it must hold one")
        return self.locks[0] if self.locks else None

    @property
    def released(self) -> bool:
        return self.phase is LeasePhase.RELEASED

    def commit(self) -> None:
        """Steps 6-8, right after the prefill: insert the cacheable prompt (unless it was all
        cached), move the one lock to the inserted node (keeping it when insert returns the
        locked node), count the cache-owned pages. A failure aborts the lease and re-raises."""
        if self.phase is not LeasePhase.PREPARED:
            raise LeaseError(f"commit of a {self.phase.value} lease")
        try:
            self._insert()
        except BaseException:
            self.abort()
            raise
        self.phase = LeasePhase.COMMITTED

    def _insert(self) -> None:
        cache, m = self.cache, self.match
        if cache is None or m.matched_kv_length >= self.cached_length:
            return  # caching off, or a full-prompt hit: keep the temporary lock
        r = cache.insert(
            self.tokens,
            self.page_table.row_pages(self.row, 0, self.cached_length),
            self.namespace,
            from_node=m.last_node,
            from_token_idx=m.matched_token_count,
            from_page_idx=self.skip,
        )
        self.inserted = r.inserted_pages
        self.cache_owned = self.skip + r.inserted_pages  # a duplicate's pages stay private
        temp = m.last_node
        if r.node is not temp:
            cache.lock(r.node)
            self.locks.append(r.node)
            if temp is not None:
                cache.unlock(temp)
                self.locks.remove(temp)

    def release(self, retained: Sequence[CacheToken] = ()) -> None:
        """Step 9: keep the decoded tokens ``retained`` (see ``retain``), then the one unlock,
        then ``erase(row, cache_owned)``: cache-owned pages stay cached, private ones go back
        to the pool. A failed retention still releases everything, then re-raises."""
        if self.phase is LeasePhase.RELEASED:
            raise LeaseError("release of a lease that was already released")
        try:
            self.retain(retained)
        finally:
            self.abort()

    def can_retain(self) -> bool:
        """Whether decoded tokens may be inserted under this lease's prompt: committed with the
        cache on, the whole prompt cacheable and its pages in this row all cache-owned (so the
        lock node ends exactly at the prompt). A full-prompt hit recomputed its last position
        privately, and a duplicate prefill's pages stay private: neither can keep its answer."""
        return (
            self.cache is not None
            and self.phase is LeasePhase.COMMITTED
            and self.cached_length == self.prompt_length
            and self.cache_owned == self.cached_length
        )

    def retain(self, retained: Sequence[CacheToken]) -> int:
        """Insert ``retained`` under the prompt, their KV being the row's pages right after it
        (the caller passes only tokens whose KV equals what a prefill of the same tokens would
        write: fed in decode, written, canonical). Returns the positions inserted (0 when
        ``can_retain`` is false or another request's copy is already cached there)."""
        if not retained or not self.can_retain():
            return 0
        end = self.cached_length + token_kv_length(retained)  # row_pages: within the row
        r = self.cache.insert(
            [*self.tokens, *retained],
            self.page_table.row_pages(self.row, 0, end),
            self.namespace,
            from_node=self.lock_node,
            from_token_idx=len(self.tokens),
            from_page_idx=self.cached_length,
        )
        self.cache_owned += r.inserted_pages  # the new leaf is unlocked: evictable at once
        self.retained = r.inserted_pages
        return r.inserted_pages

    def abort(self) -> None:
        """Unlock every lock held, then erase the row with the cache-owned count reached so
        far. A no-op once released (so failure paths can always call it)."""
        if self.phase is LeasePhase.RELEASED:
            return
        self.phase = LeasePhase.RELEASED
        try:
            while self.locks:
                self.cache.unlock(self.locks[-1])
                self.locks.pop()
        finally:
            if self.row:
                self.page_table.erase(self.row, self.cache_owned)
