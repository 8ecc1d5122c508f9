"""The image-embedding tier on its own: keys, salts, the byte budget, pins, integrity, budgets."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kestrel.embedding_cache import (
    GIB,
    MIB,
    BudgetError,
    EmbeddingCache,
    EmbeddingIntegrityError,
    EmbeddingKey,
    budget_bytes,
)

SRC = "vision:test"


def key(i: int, source: str = SRC) -> EmbeddingKey:
    return EmbeddingKey(i.to_bytes(4, "big") * 8, source)


def emb(rows: int = 4, value: float = 0.0) -> torch.Tensor:
    return torch.full((rows, 8), value)  # rows * 32 bytes


def test_hit_returns_the_inserted_tensor_and_counts():
    cache = EmbeddingCache(10_000)
    t = emb(value=1.5)
    assert cache.lookup(None, key(1)) is None
    assert cache.insert(None, key(1), t)
    lease = cache.lookup(None, key(1))
    assert lease is not None and lease.tensor.data_ptr() == t.data_ptr()
    lease.release()
    lease.release()  # idempotent
    s = cache.stats()
    assert (s.hits, s.misses, s.inserts, s.entries, s.bytes) == (1, 1, 1, 1, 128)
    cache.check_integrity()


def test_key_fields_all_count():
    """The same digest under another source (model / crop config) or adapter is another entry."""
    cache = EmbeddingCache(10_000)
    cache.insert(None, key(1), emb())
    assert cache.lookup(None, key(1, "vision:other")) is None
    assert cache.lookup(None, EmbeddingKey(key(1).digest, SRC, "adapter@1")) is None
    assert not cache.contains(None, key(2))
    with pytest.raises(ValueError, match="digest"):
        EmbeddingKey(b"", SRC)
    with pytest.raises(ValueError, match="source"):
        EmbeddingKey(b"x", "")


def test_salts_isolate():
    cache = EmbeddingCache(10_000)
    cache.insert("tenant-a", key(1), emb())
    assert cache.lookup("tenant-b", key(1)) is None
    assert cache.lookup(None, key(1)) is None
    assert not cache.contains("tenant-b", key(1))
    assert cache.contains("tenant-a", key(1))
    lease = cache.lookup("tenant-a", key(1))
    assert lease is not None
    lease.release()
    with pytest.raises(ValueError, match="salt"):
        cache.insert("", key(2), emb())


class _Untouchable(dict):
    """A namespace that fails the test if a lookup reads it."""

    def _fail(self, *a, **k):
        raise AssertionError("a lookup read another salt's entries")

    get = __getitem__ = __contains__ = keys = values = items = __iter__ = _fail


def test_salted_lookup_never_reads_other_salts():
    """No timing channel: a lookup under one salt never touches another salt's entries."""
    cache = EmbeddingCache(10_000)
    cache.insert("victim", key(1), emb())
    cache.insert("attacker", key(2), emb())
    cache._spaces["victim"] = _Untouchable(cache._spaces["victim"])
    assert cache.lookup("attacker", key(1)) is None  # the victim's image: a plain miss
    assert not cache.contains("attacker", key(1))
    lease = cache.lookup("attacker", key(2))
    assert lease is not None
    lease.release()
    assert cache.lookup(None, key(1)) is None


def test_lru_by_bytes_never_exceeds_budget():
    rng = random.Random(7)
    budget = 2_000
    cache = EmbeddingCache(budget)
    held = []
    for step in range(600):
        k, salt = key(rng.randrange(40)), rng.choice([None, "a", "b"])
        r = rng.random()
        if r < 0.4:
            lease = cache.lookup(salt, k)
            if lease is not None:
                held.append(lease)
        elif r < 0.6 and held:
            held.pop(rng.randrange(len(held))).release()
        else:  # up to 80 rows (2,560 B): some larger than the whole budget
            cache.insert(salt, k, emb(rows=rng.randrange(1, 80)))
        assert cache.bytes <= budget, step
        cache.check_integrity()
    for lease in held:
        lease.release()
    s = cache.stats()
    assert s.evictions > 0 and s.refused > 0 and s.hits > 0 and s.pinned == 0


def test_least_recently_used_goes_first():
    cache = EmbeddingCache(3 * 128)
    for i in range(3):
        cache.insert(None, key(i), emb())
    cache.lookup(None, key(0)).release()  # 0 is now the most recent
    cache.insert(None, key(3), emb())
    assert [cache.contains(None, key(i)) for i in range(4)] == [True, False, True, True]


def test_pinned_entries_are_never_evicted():
    cache = EmbeddingCache(2 * 128)
    cache.insert(None, key(0), emb())
    cache.insert(None, key(1), emb())
    a, b = cache.lookup(None, key(0)), cache.lookup(None, key(1))
    assert not cache.insert(None, key(2), emb())  # both pinned: refused, nothing evicted
    assert cache.contains(None, key(0)) and cache.contains(None, key(1))
    assert cache.stats().pinned == 2
    a.release()
    assert cache.insert(None, key(2), emb())
    assert not cache.contains(None, key(0)) and cache.contains(None, key(1))
    b.release()
    cache.check_integrity()


def test_too_large_and_duplicate_inserts():
    cache = EmbeddingCache(100)
    assert not cache.insert(None, key(0), emb())  # 128 B > budget
    assert cache.bytes == 0 and cache.stats().refused == 1
    big = EmbeddingCache(1000)
    first = emb(value=1.0)
    assert big.insert(None, key(0), first)
    assert big.insert(None, key(0), emb(value=2.0))  # the existing entry stays
    lease = big.lookup(None, key(0))
    assert lease.tensor.data_ptr() == first.data_ptr()
    lease.release()
    with pytest.raises(TypeError):
        big.insert(None, key(1), [1.0])


def test_inference_tensors_are_kept_as_tracked_copies():
    cache = EmbeddingCache(1000)
    with torch.inference_mode():
        t = emb(value=3.0)
        cache.insert(None, key(0), t)
        lease = cache.lookup(None, key(0))
    assert not lease.tensor.is_inference() and torch.equal(lease.tensor, t)
    lease.tensor.add_(1)  # what the version counter exists to catch
    with pytest.raises(EmbeddingIntegrityError, match="written"):
        cache.check_integrity()
    lease.release()


def test_integrity_catches_a_written_entry_and_bad_accounting():
    cache = EmbeddingCache(1000)
    t = emb()
    cache.insert(None, key(0), t)
    cache.check_integrity()
    t.add_(1)
    with pytest.raises(EmbeddingIntegrityError, match="written"):
        cache.check_integrity()
    other = EmbeddingCache(1000)
    other.insert(None, key(0), emb())
    other._bytes += 1
    with pytest.raises(EmbeddingIntegrityError, match="accounted"):
        other.check_integrity()
    lost = EmbeddingCache(1000)
    lost.insert("s", key(0), emb())
    lost._spaces["s"].clear()
    with pytest.raises(EmbeddingIntegrityError):
        lost.check_integrity()


@pytest.mark.parametrize("bad", [-1, -0.5, "64", None, True, False, math.nan, math.inf, [1]])
def test_hostile_budgets_are_refused(bad):
    with pytest.raises(BudgetError, match="embedding_cache_mb"):
        budget_bytes(bad, name="embedding_cache_mb", unit=MIB, limit=None)


def test_budget_beyond_memory_is_refused():
    with pytest.raises(BudgetError, match="more than"):
        budget_bytes(10**9, name="host_kv_gb", unit=GIB, limit=64 * GIB)
    assert budget_bytes(0, name="x", unit=MIB, limit=MIB) == 0
    assert budget_bytes(1.5, name="x", unit=MIB, limit=None) == 3 * MIB // 2


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_cache_needs_a_positive_byte_budget(bad):
    with pytest.raises(ValueError, match="budget"):
        EmbeddingCache(bad)
