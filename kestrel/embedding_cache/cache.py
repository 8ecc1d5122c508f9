"""EmbeddingCache: the vision encoder's output per image, kept under a byte budget.

The prefix cache keeps an image's KV (~143 MB per Moondream 2 image in bf16); what the vision
encoder made for that image is ~3 MB. When the radix tree evicts the KV, this tier still holds
the embedding, so the next question about the image goes straight to the prefill: no crops, no
encoder. It is pure Python over tensors; the runtime decides what to look up and insert.

- **Keys.** ``EmbeddingKey(digest, source, adapter)``: the image's content digest; ``source``,
  everything else the embedding depends on (the model's vision weights, the crop configuration,
  the dtype); ``adapter``, a vision adapter's identity (None while adapters touch the text
  decoder only). Entries are stored per tenant salt (``None`` is a namespace too), so a lookup
  reads only its own salt's entries: whether another tenant sent an image never changes what a
  lookup finds, nor what it does to find it.
- **Budget.** Entries are charged their tensor's bytes; the sum never exceeds ``budget``. An
  insert evicts least recently used entries (across salts, as the KV cache does) until the new
  one fits; an entry larger than the whole budget is not kept.
- **Immutable, freed only when unreferenced.** ``lookup`` pins the entry it returns until the
  caller's ``release``; a pinned entry is never evicted (an insert that would need it is
  refused instead). Nothing writes an entry's tensor: ``check_integrity`` compares its version
  counter with the one recorded at insert (an inference-mode tensor, which has none, is
  copied once when inserted).

Every method takes one lock: the engine asks ``contains`` on callers' threads (to leave an
image's crops unmade) while the scheduler thread looks up and inserts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from kestrel.embedding_cache.budget import ByteLRU

__all__ = ["EmbeddingCache", "EmbeddingIntegrityError", "EmbeddingKey", "EmbeddingStats"]


class EmbeddingIntegrityError(AssertionError):
    """An invariant of the embedding cache does not hold."""


@dataclass(frozen=True, slots=True)
class EmbeddingKey:
    """What one image's embedding depends on (the salt is the namespace, kept apart)."""

    digest: bytes
    source: str
    adapter: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.digest, bytes) or not self.digest:
            raise ValueError(f"digest must be non-empty bytes, got {self.digest!r}")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"source must be a non-empty str, got {self.source!r}")


@dataclass(frozen=True, slots=True)
class EmbeddingStats:
    budget_bytes: int
    bytes: int
    entries: int
    pinned: int
    hits: int
    misses: int
    inserts: int
    evictions: int
    refused: int  # inserts not kept: larger than the budget, or only pinned entries to evict


@dataclass(slots=True, eq=False)
class _Entry:
    tensor: torch.Tensor
    nbytes: int
    version: int
    salt: str | None
    key: EmbeddingKey
    seq: int
    refs: int = 0


@dataclass(slots=True, eq=False)
class EmbeddingLease:
    """A pinned entry: read ``tensor``, then ``release()`` (idempotent)."""

    tensor: torch.Tensor
    _entry: _Entry | None = field(repr=False)
    _cache: EmbeddingCache = field(repr=False)

    def release(self) -> None:
        entry, self._entry = self._entry, None
        if entry is not None:
            self._cache._unpin(entry)


class EmbeddingCache(ByteLRU[_Entry]):
    """Image embeddings by (salt, key), LRU by bytes under ``budget`` bytes (module doc)."""

    def __init__(self, budget: int) -> None:
        super().__init__(budget, "an embedding cache")
        self._lock = threading.Lock()
        self._spaces: dict[str | None, dict[EmbeddingKey, _Entry]] = {}
        self._hits = self._misses = self._inserts = self._refused = 0

    # ------------------------------------------------------------------ reads
    def lookup(self, salt: str | None, key: EmbeddingKey) -> EmbeddingLease | None:
        """The entry for ``key`` in ``salt``'s namespace, pinned; None on a miss. Counted."""
        with self._lock:
            space = self._spaces.get(salt)
            entry = space.get(key) if space is not None else None
            if entry is None:
                self._misses += 1
                return None
            self._hits += 1
            entry.refs += 1
            self._lru.move_to_end(entry.seq)
            return EmbeddingLease(entry.tensor, entry, self)

    def contains(self, salt: str | None, key: EmbeddingKey) -> bool:
        """Whether ``key`` is cached in ``salt``'s namespace (not counted, order unchanged)."""
        with self._lock:
            space = self._spaces.get(salt)
            return space is not None and key in space

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._lru)

    def stats(self) -> EmbeddingStats:
        with self._lock:
            return EmbeddingStats(
                budget_bytes=self.budget,
                bytes=self._bytes,
                entries=len(self._lru),
                pinned=sum(e.refs > 0 for e in self._lru.values()),
                hits=self._hits,
                misses=self._misses,
                inserts=self._inserts,
                evictions=self._evictions,
                refused=self._refused,
            )

    # ------------------------------------------------------------------ writes
    def insert(self, salt: str | None, key: EmbeddingKey, tensor: torch.Tensor) -> bool:
        """Keep ``tensor`` (never written afterwards) as ``key``'s embedding in ``salt``'s
        namespace, evicting unpinned least recently used entries to make room. Returns whether
        the entry is cached now (an existing entry stays as it is)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"an embedding must be a tensor, got {type(tensor).__name__}")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"salt must be None or a non-empty str, got {salt!r}")
        tensor = tensor.detach()
        if tensor.is_inference():  # a normal tensor's version counter tracks writes
            with torch.inference_mode(False):
                tensor = tensor.clone()
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            space = self._spaces.get(salt)
            if space is not None and key in space:
                return True
            if nbytes > self.budget or not self._make_room(nbytes):
                self._refused += 1
                return False
            entry = _Entry(tensor, nbytes, tensor._version, salt, key, next(self._seq))
            self._spaces.setdefault(salt, {})[key] = entry
            self._lru[entry.seq] = entry
            self._bytes += nbytes
            self._inserts += 1
            return True

    def _evictable(self, entry: _Entry) -> bool:
        return entry.refs == 0  # a pinned entry stays

    def _remove(self, entry: _Entry) -> None:
        del self._lru[entry.seq]
        space = self._spaces[entry.salt]
        del space[entry.key]
        if not space:
            del self._spaces[entry.salt]
        self._bytes -= entry.nbytes

    def _unpin(self, entry: _Entry) -> None:
        with self._lock:
            if entry.refs < 1:
                raise EmbeddingIntegrityError("an embedding entry was released more than pinned")
            entry.refs -= 1

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Bytes accounted = the entries' bytes <= budget; the LRU order and the namespaces hold
        the same entries once each, in insertion-sequence keys; no entry was written to."""
        with self._lock:
            total, seen = 0, 0
            for seq, entry in self._lru.items():
                if entry.seq != seq:
                    raise EmbeddingIntegrityError(f"LRU slot {seq} holds entry {entry.seq}")
                if self._spaces.get(entry.salt, {}).get(entry.key) is not entry:
                    raise EmbeddingIntegrityError(f"entry {seq} is not in its salt's namespace")
                if entry.refs < 0:
                    raise EmbeddingIntegrityError(f"entry {seq} has {entry.refs} pins")
                t = entry.tensor
                if entry.nbytes != t.numel() * t.element_size():
                    raise EmbeddingIntegrityError(f"entry {seq} is charged {entry.nbytes} bytes")
                if t._version != entry.version:
                    raise EmbeddingIntegrityError(f"entry {seq}'s tensor was written in place")
                total += entry.nbytes
            for salt, space in self._spaces.items():
                if not space:
                    raise EmbeddingIntegrityError(f"namespace {salt!r} is empty but kept")
                seen += len(space)
            if seen != len(self._lru):
                raise EmbeddingIntegrityError(
                    f"namespaces hold {seen} entries, the LRU order {len(self._lru)}"
                )
            if total != self._bytes:
                raise EmbeddingIntegrityError(f"{self._bytes} bytes accounted, entries {total}")
            if total > self.budget:
                raise EmbeddingIntegrityError(f"{total} bytes exceed the budget {self.budget}")
