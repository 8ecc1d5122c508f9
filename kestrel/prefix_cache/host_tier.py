"""HostKVTier: KV pages the radix tree evicts, kept in host memory and copied back on a match.

On a GPU the KV pool is device memory; when the tree evicts a leaf, its pages' KV can be copied
to (pinned) host memory instead of being lost, and a later request that would match through it
gets it copied back (PCIe, some milliseconds for an image) instead of recomputing it (vision
encoder and prefill). This module is the tier's bookkeeping, pure Python: the copies are made
by a ``KVMover`` (``kestrel/runtime/host_kv.py``'s ``PinnedKVMover`` on CUDA; tests use a stand-in).

**Where entries live.** An entry is one evicted node: its tokens and its KV, keyed by where it
starts, ``(namespace key, token keys of everything above it)``, and its first token's key. The
tree therefore knows which tier each node's KV is in: a node in the tree is on the device, an
entry here continues the tree from the node (or namespace root) its start names. Because the
key is the whole path, an entry stays valid when the nodes above it are evicted and later
recomputed (KV depends only on the namespace and the tokens before it), and a namespace whose
tree was emptied can come back from here.

**States** (each entry):

    spill     (device pages -> host)    SPILLING   copy queued; the buffer is in use
    poll      SPILLING  -> HOST          the copy finished: the entry may be evicted now
    take      HOST      -> COPYING_IN    a match continues through it: device pages allocated,
                                         copy queued; the entry leaves the index (its node is
                                         back in the tree, locked by the request that matched)
    poll      COPYING_IN -> (gone)       the copy finished: its host bytes are freed
    evict     HOST      -> (gone)        least recently used first, to make room for a spill

A SPILLING or COPYING_IN entry is never evicted (its buffer is being read or written). The
copies are queued on the device's stream in program order, so a spill's pages may be reused
right away and a copy-in is complete before the prefill that reads it; the states guard the
host buffers. Bytes held (every entry, in flight or not) never exceed ``budget``.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kestrel.embedding_cache.budget import ByteLRU

__all__ = ["HostEntry", "HostKVTier", "HostState", "HostTierStats", "KVMover"]

log = logging.getLogger("kestrel.prefix_cache")


class KVMover(Protocol):
    """Moves pages' KV between the device pool and host buffers (all layers, K and V)."""

    bytes_per_page: int

    def copy_out(self, pages: np.ndarray) -> tuple[Any, Any]:
        """Queue a copy of ``pages``' KV into a new host buffer: ``(buffer, event)``."""

    def copy_in(self, buffer: Any, pages: np.ndarray) -> Any:
        """Queue a copy of ``buffer`` into ``pages``; returns its event."""

    def done(self, event: Any) -> bool:
        """Whether a queued copy has finished."""

    def wait(self, event: Any) -> None:
        """Block until a queued copy has finished."""


class HostState(enum.Enum):
    SPILLING = "spilling"
    HOST = "host"
    COPYING_IN = "copying_in"


@dataclass(slots=True, eq=False)
class HostEntry:
    start: tuple  # (namespace key, token keys above the node)
    tokens: tuple
    keys: tuple
    n_pages: int
    nbytes: int
    buffer: Any
    event: Any
    state: HostState
    seq: int


@dataclass(frozen=True, slots=True)
class HostTierStats:
    budget_bytes: int
    bytes: int
    entries: int  # in the index (SPILLING or HOST)
    in_flight: int  # copies not yet finished (either way)
    spills: int
    spilled_pages: int
    hits: int  # entries copied back
    restored_pages: int
    evictions: int
    refused: int  # spills not kept: larger than the budget, or no room among idle entries


class HostKVTier(ByteLRU[HostEntry]):
    """The host tier's entries under ``budget`` bytes, moved by ``mover`` (module doc)."""

    def __init__(self, budget: int, mover: KVMover) -> None:
        super().__init__(budget, "a host KV tier")  # every entry held, in ``_lru``
        self.mover = mover
        self._index: dict[tuple, dict[tuple, HostEntry]] = {}
        self._in_flight: list[HostEntry] = []  # SPILLING and COPYING_IN entries
        self._spills = self._spilled = self._hits = self._restored = self._refused = 0

    # ------------------------------------------------------------------ spill
    def spill(self, start: tuple, tokens: Sequence, keys: tuple, pages: np.ndarray) -> bool:
        """Keep the KV of an evicted node (``tokens``, ``keys``, ``pages``) starting at
        ``start``; returns whether it was kept. An idle entry already there is replaced."""
        n = len(pages)
        nbytes = n * self.mover.bytes_per_page
        old = self._index.get(start, {}).get(keys[0])
        if nbytes > self.budget or (old is not None and old.state is not HostState.HOST):
            self._refused += 1
            return False
        if old is not None:
            self._remove(old)
        if not self._make_room(nbytes):
            self._refused += 1
            return False
        try:
            buffer, event = self.mover.copy_out(pages)
        except Exception as exc:  # (pinned memory exhausted...) the eviction goes on without
            log.warning("host KV tier: spill of %d pages failed: %s", n, exc)
            self._refused += 1
            return False
        entry = HostEntry(start, tuple(tokens), keys, n, nbytes, buffer, event,
                          HostState.SPILLING, next(self._seq))  # fmt: skip
        self._index.setdefault(start, {})[keys[0]] = entry
        self._lru[entry.seq] = entry
        self._in_flight.append(entry)
        self._bytes += nbytes
        self._spills += 1
        self._spilled += n
        return True

    def _evictable(self, entry: HostEntry) -> bool:
        return entry.state is HostState.HOST  # no copy in flight

    def _remove(self, entry: HostEntry) -> None:
        del self._lru[entry.seq]
        self._bytes -= entry.nbytes
        self._unindex(entry)

    def _unindex(self, entry: HostEntry) -> None:
        at = self._index.get(entry.start)
        if at is not None and at.get(entry.keys[0]) is entry:
            del at[entry.keys[0]]
            if not at:
                del self._index[entry.start]

    # ------------------------------------------------------------------ copy in
    def find(self, start: tuple, first_key: tuple) -> HostEntry | None:
        """The entry that continues a match ending at ``start`` with ``first_key``."""
        at = self._index.get(start)
        return None if at is None else at.get(first_key)

    def copy_in(self, entry: HostEntry, pages: np.ndarray) -> None:
        """Queue ``entry``'s KV into ``pages`` (freshly allocated, as many as it holds); the
        entry leaves the index now and its bytes when the copy has finished."""
        if entry.state is HostState.COPYING_IN or self._lru.get(entry.seq) is not entry:
            raise ValueError("that host entry is not held (copied in already, or evicted)")
        if len(pages) != entry.n_pages:
            raise ValueError(f"host entry holds {entry.n_pages} pages, got {len(pages)}")
        if entry.state is HostState.SPILLING:  # its copy out must have landed first
            self.mover.wait(entry.event)
        self._unindex(entry)
        entry.state = HostState.COPYING_IN
        entry.event = self.mover.copy_in(entry.buffer, pages)
        if entry not in self._in_flight:
            self._in_flight.append(entry)
        self._lru.move_to_end(entry.seq)
        self._hits += 1
        self._restored += entry.n_pages

    def restore(self, cache: Any, tokens: Sequence, namespace: Any) -> tuple[Any, int]:
        """Copy back the entries that continue ``cache``'s match of ``tokens`` in
        ``namespace``, in order, each inserted into the tree as the node it was. Returns the
        deepest restored node, locked (the caller unlocks it once it holds its own lock), or
        None, and the pages restored. Stops where no entry continues the match, or the device
        pool has no room."""
        self.poll()
        m = cache.match_prefix(tokens, namespace)
        i, node, kv = m.matched_token_count, m.last_node, m.matched_kv_length
        keys = tuple(t.key for t in tokens)
        if i >= len(keys) or (namespace.key, keys[:i]) not in self._index:
            return None, 0
        prefix, held, restored = [m.matched_pages], None, 0
        try:
            while i < len(keys):
                entry = self.find((namespace.key, keys[:i]), keys[i])
                if entry is None:
                    break
                k = len(entry.keys)  # the whole node comes back; a match diverging in it splits
                whole = keys[i : i + k] == entry.keys
                if held is None and node is not None:
                    cache.lock(node)  # our path stays while allocating may evict
                    held = node
                pt = cache.page_table
                if pt.pool.free_count + cache.reclaimable_page_count() < entry.n_pages:
                    break  # no room on the device (allocate_pages would refuse)
                pages = pt.allocate_pages(entry.n_pages)
                if self._lru.get(entry.seq) is not entry:  # evicted to make room meanwhile
                    cache.page_table.free_pages_to_pool(pages)
                    break
                node = self._reinsert(cache, entry, [*tokens[:i], *entry.tokens], prefix,
                                      pages, node, (namespace, i, kv))  # fmt: skip
                cache.lock(node)
                if held is not None:
                    cache.unlock(held)
                held, i, kv = node, i + k, kv + len(pages)
                prefix.append(pages)
                restored += len(pages)
                if not whole:
                    break
        except BaseException:
            if held is not None:
                cache.unlock(held)
            raise
        return held, restored

    def _reinsert(self, cache, entry, tokens, prefix, pages, node, at) -> Any:
        """Queue ``entry``'s copy into ``pages`` and insert it under ``node``; the new node."""
        namespace, i, kv = at
        try:
            self.copy_in(entry, pages)
            r = cache.insert(tokens, np.concatenate([*prefix, pages]), namespace,
                             from_node=node, from_token_idx=i, from_page_idx=kv)  # fmt: skip
        except BaseException:
            cache.page_table.free_pages_to_pool(pages)  # insert claims all or nothing
            raise
        if r.inserted_pages != len(pages):
            raise AssertionError(f"restored {len(pages)} pages, the tree took {r.inserted_pages}")
        return r.node

    # ------------------------------------------------------------------ progress
    def poll(self) -> None:
        """Advance every entry whose copy has finished (SPILLING -> HOST, COPYING_IN ->
        freed)."""
        done, waiting = self.mover.done, []
        for entry in self._in_flight:
            if not done(entry.event):
                waiting.append(entry)
                continue
            if entry.state is HostState.SPILLING:
                entry.state, entry.event = HostState.HOST, None
            else:
                del self._lru[entry.seq]
                self._bytes -= entry.nbytes
                entry.buffer = entry.event = None
        self._in_flight = waiting

    def drain(self) -> None:
        """Wait for every copy in flight, then ``poll``."""
        for entry in self._in_flight:
            self.mover.wait(entry.event)
        self.poll()

    # ------------------------------------------------------------------ figures
    @property
    def bytes(self) -> int:
        return self._bytes

    def stats(self) -> HostTierStats:
        entries = sum(len(at) for at in self._index.values())
        counts = (self._spills, self._spilled, self._hits, self._restored, self._evictions)
        held = (self.budget, self._bytes, entries, len(self._in_flight))
        return HostTierStats(*held, *counts, self._refused)  # in the fields' order

    def check_integrity(self) -> None:
        """Bytes accounted = the held entries' bytes <= budget; the index holds exactly the
        SPILLING and HOST entries, each under its own start and first key."""
        total, indexed = 0, 0
        for seq, e in self._lru.items():
            if e.seq != seq or e.nbytes != e.n_pages * self.mover.bytes_per_page:
                raise AssertionError(f"host entry {seq} is mis-filed or mis-charged")
            if len(e.keys) != len(e.tokens) or not e.n_pages:
                raise AssertionError(f"host entry {seq} has {len(e.keys)} keys, {e.n_pages} pages")
            listed = self._index.get(e.start, {}).get(e.keys[0]) is e
            if listed != (e.state is not HostState.COPYING_IN):
                raise AssertionError(f"host entry {seq} ({e.state.value}) indexed={listed}")
            total += e.nbytes
            indexed += listed
        busy = [e for e in self._lru.values() if e.state is not HostState.HOST]
        if {id(e) for e in busy} != {id(e) for e in self._in_flight} or len(busy) != len(
            self._in_flight
        ):
            raise AssertionError("the in-flight list is not the entries with copies queued")
        if indexed != sum(len(at) for at in self._index.values()):
            raise AssertionError("the host index lists entries the tier does not hold")
        if total != self._bytes or total > self.budget:
            raise AssertionError(
                f"host tier: {self._bytes} bytes accounted, entries {total}, budget {self.budget}"
            )
