"""The host KV tier's spill / copy-in state machine on CPU, through the real radix tree, page
table and CacheLease, with a stand-in device pool: a numpy array of fake KV values, and a mover
whose copies land at once (the device stream's order) but report done only when the test says
(pinned-memory copies faked). Every step checks the cache, page-table and tier invariants, and
that every page the tree holds carries the KV of exactly its position."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kestrel.kv.page_table import PageTable
from kestrel.prefix_cache import CacheLease, CacheNamespace, RadixPrefixCache, TextToken
from kestrel.prefix_cache.host_tier import HostKVTier, HostState

WIDTH = 2  # float64 values per page: 16 bytes


class Event:
    def __init__(self) -> None:
        self.finished = False


class FakeEvents:
    """The event half of a stand-in mover: a copy's event finishes when the test says."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def _event(self) -> Event:
        e = Event()
        self.events.append(e)
        return e

    def done(self, event) -> bool:
        return event.finished

    def wait(self, event) -> None:
        event.finished = True

    def finish_all(self) -> None:
        for e in self.events:
            e.finished = True


class StandInMover(FakeEvents):
    """Copies between ``device`` (the pool's pages) and host buffers; events finish on demand."""

    bytes_per_page = WIDTH * 8

    def __init__(self, n_pages: int) -> None:
        super().__init__()
        self.device = np.zeros((n_pages, WIDTH))
        self.copies_out = self.copies_in = 0

    def copy_out(self, pages):
        self.copies_out += 1
        return self.device[pages].copy(), self._event()

    def copy_in(self, buffer, pages):
        self.copies_in += 1
        self.device[pages] = buffer
        return self._event()


def kv_value(ns_key: tuple, keys: tuple) -> list[float]:
    """The fake KV of the last position of ``keys`` in a namespace (what it depends on)."""
    h = hash((ns_key, keys))
    return [float(h % 1_000_003), float(len(keys))]


class Harness:
    def __init__(self, n_pages: int, budget_pages: int) -> None:
        self.pt = PageTable(n_pages, page_size=1, max_batch_size=4, device="cpu", max_seq_len=256)
        self.cache = RadixPrefixCache(self.pt)
        self.pt.set_prefix_cache(self.cache)
        self.mover = StandInMover(n_pages)
        self.tier = HostKVTier(budget_pages * StandInMover.bytes_per_page, self.mover)
        self.cache.host = self.tier

    def run(self, ns: CacheNamespace, ids, new_tokens: int = 2) -> CacheLease:
        """Prepare, 'prefill' the uncached positions, commit; the running lease."""
        tokens = [TextToken(i) for i in ids]
        lease = CacheLease.prepare(self.pt, self.cache, tokens, ns, prompt_length=len(tokens),
                                   max_length=len(tokens) + new_tokens)  # fmt: skip
        self.check_kv()  # restored pages already hold their KV (stream order)
        keys = tuple(t.key for t in tokens)
        pages = self.pt.row_pages(lease.row, 0, len(tokens))
        for p in range(lease.skip, len(tokens)):
            self.mover.device[pages[p]] = kv_value(ns.key, keys[: p + 1])
        lease.commit()
        self.check()
        return lease

    def check_kv(self) -> None:
        for ns_key, root in self.cache.roots().items():
            stack = [(root, ())]
            while stack:
                node, path = stack.pop()
                for j, page in enumerate(node.physical_pages):
                    want = kv_value(ns_key, path + node.keys[: j + 1])
                    assert list(self.mover.device[page]) == want, (ns_key, path, j)
                stack += [(c, path + node.keys) for c in node.children.values()]

    def check(self) -> None:
        self.cache.check_integrity()
        self.pt.check_integrity()
        self.tier.check_integrity()
        assert self.tier.bytes <= self.tier.budget
        self.check_kv()


NS = CacheNamespace(image_hash=1)
OTHER = CacheNamespace(image_hash=2)
A = list(range(10, 30))  # 20 positions
B = list(range(40, 60))


def test_an_evicted_prompt_spills_and_comes_back_without_recompute():
    h = Harness(n_pages=26, budget_pages=64)
    h.run(NS, A).release()
    h.run(OTHER, B).release()  # the pool holds one prompt: A's tree goes to the host tier
    s = h.tier.stats()
    assert s.spills >= 1 and s.spilled_pages == len(A) and s.in_flight == s.spills
    assert NS.key not in h.cache.roots()  # the namespace's tree is gone from the device
    h.mover.finish_all()
    h.tier.poll()
    assert h.tier.stats().in_flight == 0
    lease = h.run(NS, A)  # a full hit again, copied back
    assert lease.restored == len(A) and lease.skip == len(A) - 1
    s = h.tier.stats()
    assert s.hits >= 1 and s.restored_pages == len(A)
    node = lease.lock_node
    assert node is not None and node.lock_ref >= 1  # the copied-in node is locked
    # A's copy-in holds its bytes until it finishes; making room for A spilled B meanwhile
    states = sorted(e.state.value for e in h.tier._lru.values())
    assert states == ["copying_in", "spilling"] and h.tier.bytes == 40 * StandInMover.bytes_per_page
    assert h.tier.find((NS.key, ()), (0, 10)) is None  # A left the index at once
    h.mover.finish_all()
    h.tier.poll()
    assert h.tier.bytes == len(B) * StandInMover.bytes_per_page  # A is gone from the host
    lease.release()
    h.check()


def test_a_partial_host_match_extends_the_device_match():
    """A prompt sharing only a prefix with the spilled one restores what it shares."""
    h = Harness(n_pages=26, budget_pages=64)
    h.run(NS, A).release()
    h.run(OTHER, B).release()
    lease = h.run(NS, [*A[:12], 99, 98])  # diverges after 12 tokens of A
    assert lease.restored == len(A)  # whole nodes come back; the match then splits
    assert lease.skip == 12
    lease.release()
    h.check()


def test_spilling_and_copying_entries_are_never_evicted():
    h = Harness(n_pages=26, budget_pages=20)  # room for exactly one prompt's KV
    h.run(NS, A).release()
    h.run(OTHER, B).release()  # A spills (in flight)
    third = CacheNamespace(image_hash=3)
    h.run(third, list(range(70, 90))).release()  # B would spill, but A is still in flight
    s = h.tier.stats()
    assert s.spills == 1 and s.refused == 1 and s.evictions == 0
    h.mover.finish_all()
    h.run(NS, list(range(100, 120))).release()  # third spills: A (idle now) is evicted
    s = h.tier.stats()
    assert s.spills == 2 and s.evictions == 1
    assert h.tier.find((NS.key, ()), (0, 10)) is None  # A's entry is gone
    h.check()


def test_spill_larger_than_the_budget_is_refused_and_dropped():
    h = Harness(n_pages=26, budget_pages=5)
    h.run(NS, A).release()
    h.run(OTHER, B).release()
    assert h.tier.stats().refused >= 1 and h.tier.bytes == 0
    lease = h.run(NS, A)
    assert lease.restored == 0 and lease.skip == 0  # recomputed
    lease.release()


def test_copy_in_needs_a_held_entry_of_the_right_size():
    h = Harness(n_pages=26, budget_pages=64)
    h.run(NS, A).release()
    h.run(OTHER, B).release()
    entry = h.tier.find((NS.key, ()), (0, 10))
    assert entry is not None and entry.state is HostState.SPILLING
    with pytest.raises(ValueError, match="holds"):
        h.tier.copy_in(entry, np.arange(3, dtype=np.int32))
    h.tier.drain()
    assert entry.state is HostState.HOST


def test_random_workload_keeps_every_invariant():
    rng = random.Random(3)
    h = Harness(n_pages=64, budget_pages=90)
    spaces = [CacheNamespace(image_hash=i) for i in range(1, 6)]
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(4, 18))] for _ in range(12)]
    running: list[CacheLease] = []
    restored = 0
    for _step in range(300):
        r = rng.random()
        if r < 0.45 and len(running) < 3:
            ns = rng.choice(spaces)
            base = rng.choice(prompts)
            ids = base[: rng.randint(2, len(base))] + ([rng.randrange(1000)] if r < 0.1 else [])
            try:
                lease = h.run(ns, ids, new_tokens=rng.randint(1, 4))
            except RuntimeError:  # the pool is full of running sequences
                h.check()
                continue
            restored += lease.restored
            running.append(lease)
        elif running:
            running.pop(rng.randrange(len(running))).release()
        if rng.random() < 0.3:
            h.mover.finish_all()
            h.tier.poll()
        h.check()
    for lease in running:
        lease.release()
    s = h.tier.stats()
    assert restored > 0 and s.spills > 0 and s.hits > 0 and s.evictions > 0
    h.check()


def test_a_cpu_runtime_refuses_the_tier():
    from kestrel.runtime.host_kv import host_kv_unavailable_reason

    reason = host_kv_unavailable_reason("cpu")
    assert reason is not None and "CUDA" in reason


def test_a_failed_spill_leaves_the_eviction_whole():
    h = Harness(n_pages=26, budget_pages=64)
    h.run(NS, A).release()

    def broken(pages):
        raise RuntimeError("pinned memory exhausted")

    h.mover.copy_out = broken
    h.run(OTHER, B).release()  # A is evicted all the same; nothing kept
    assert h.tier.stats().refused >= 1 and h.tier.bytes == 0
    assert NS.key not in h.cache.roots()
    h.check()
