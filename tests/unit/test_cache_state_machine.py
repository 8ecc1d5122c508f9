"""Property-based test: random interleavings of the runtime protocol over several namespaces.

The protocol under test is ``CacheLease``, the same object ``MoondreamRuntime`` drives; only the
prefill is fake (``cache_protocol.FakeRuntime``). A small page pool keeps eviction constant.
Failures are injected into real page-table and cache calls. Every step is followed by the full
invariant check (``cache_protocol.check_all``): integrity walk, page conservation, lock
accounting, and the fake KV contents of every running sequence.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kestrel.kv.page_table import BatchSlotsExhausted, PagePoolExhausted, PageTable
from kestrel.prefix_cache import ImageToken, RadixPrefixCache, TextToken

from .cache_protocol import (
    FAIL_POINTS,
    FakeRuntime,
    InjectedFailure,
    Prompt,
    check_all,
    make_cache,
)

LORAS = (None, "a@0123456789abcdef", "b@fedcba9876543210")
IMAGES = (None, (11, 3), (12, 3), (13, 729), (14, 729))
STEMS = ((5, 6), (5, 6, 7, 8), (9,), (5, 7, 7))

LATER = ((), (), (ImageToken(15, 3),), (ImageToken(16, 3), TextToken(5)))  # a later image

prompts = st.builds(
    lambda lora, image, stem, tail, later: Prompt(stem + tuple(tail), image, lora, later),
    st.sampled_from(LORAS),
    st.sampled_from(IMAGES),
    st.sampled_from(STEMS),
    st.lists(st.integers(1, 4), max_size=4),
    st.sampled_from(LATER),
)
failures = st.one_of(st.none(), st.none(), st.none(), st.sampled_from(FAIL_POINTS))


class CacheProtocolMachine(RuleBasedStateMachine):
    @initialize(n_pages=st.sampled_from([24, 60, 800]), max_batch=st.integers(2, 5))
    def setup(self, n_pages: int, max_batch: int) -> None:
        self.pt = PageTable(n_pages, max_batch_size=max_batch, max_seq_len=1024)
        self.cache = RadixPrefixCache(self.pt)
        self.pt.set_prefix_cache(self.cache)
        self.rt = FakeRuntime(self.pt, self.cache)
        self.seen: list[Prompt] = []

    # ------------------------------------------------------------ admission
    def _start(self, prompt: Prompt, max_new: int, fail_at: str | None) -> None:
        target = prompt.length + max_new
        if self.pt.can_reserve_with_eviction(target + 1):  # +1: full-hit backoff (base.py)
            try:
                seq = self.rt.start(prompt, max_new, fail_at)
            except InjectedFailure:
                assert fail_at is not None and self.rt.last_injector.fired
                return
            assert not self.rt.last_injector.fired  # (a point this path never reaches)
            self.seen.append(prompt)
            if seq.inserted is None:  # full-prompt hit: last cache token recomputed privately
                last = prompt.cache_tokens()[-1].kv_length()  # a whole image block, if last
                assert seq.skip == prompt.length - last and seq.cache_owned == seq.skip
            return
        if len(self.rt.running) >= self.pt.max_batch_size:
            with pytest.raises(BatchSlotsExhausted):
                self.rt.start(prompt, max_new)
            return
        probe = self.cache.match_prefix(prompt.cache_tokens(), prompt.namespace)
        if probe.matched_kv_length == 0 and not self.pt.can_reserve_with_eviction(target):
            # A certain miss that cannot fit must fail cleanly (check_all verifies no leak).
            with pytest.raises(PagePoolExhausted, match="locked by active sequences"):
                self.rt.start(prompt, max_new)

    @rule(prompt=prompts, max_new=st.integers(0, 6), fail_at=failures)
    def start(self, prompt: Prompt, max_new: int, fail_at: str | None) -> None:
        self._start(prompt, max_new, fail_at)

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), max_new=st.integers(0, 3))
    def start_seen_again(self, data: st.DataObject, max_new: int) -> None:
        """Full-prompt hits (or partial, after eviction) of a prompt seen before."""
        self._start(data.draw(st.sampled_from(self.seen)), max_new, None)

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), tail=st.lists(st.integers(1, 4), min_size=1, max_size=3),
          fail_at=failures)  # fmt: skip
    def start_extension(self, data: st.DataObject, tail: list[int], fail_at: str | None) -> None:
        """A seen prompt plus new tokens: a partial hit whose insert moves the lock (the
        lock transfer, and failures inside it)."""
        seen = data.draw(st.sampled_from(self.seen))
        self._start(seen.extended(tail), 2, fail_at)

    @rule(prompt=prompts, max_new=st.integers(0, 3))
    def duplicate_prefill_race(self, prompt: Prompt, max_new: int) -> None:
        """B matches and prefills, then A (same prompt) runs start to finish, then B inserts:
        as if two prefills of one prompt had raced."""
        need = 2 * (prompt.length + max_new + 1)
        if len(self.rt.running) + 2 > self.pt.max_batch_size:
            return
        if not self.pt.can_reserve_with_eviction(need):
            return
        b = self.rt.begin(prompt, max_new)
        if not self.pt.can_reserve_with_eviction(prompt.length + max_new + 1):
            b.lease.abort()
            return
        a = self.rt.start(prompt, max_new)
        self.rt.finish(b)
        if a.inserted:  # A claimed the suffix B computed too: B's copy stays private
            assert b.inserted == 0 and b.cache_owned == b.skip
            assert b.lock_node is not a.lock_node
            row = self.pt.page_table_cpu[b.row]
            assert not any(self.cache.owns_page(p) for p in row[b.skip :])

    @precondition(lambda self: self.rt.running)
    @rule(data=st.data(), fed=st.lists(st.integers(1, 4), min_size=1, max_size=40))
    def decode(self, data: st.DataObject, fed: list[int]) -> None:
        seq = data.draw(st.sampled_from(sorted(self.rt.running.values(), key=lambda s: s.row)))
        new_len = seq.length + len(fed)
        if new_len > self.pt.max_seq_len:
            return
        if self.pt.can_reserve_with_eviction(new_len, seq.row):
            self.rt.decode(seq, tuple(fed))
        else:
            with pytest.raises(PagePoolExhausted):
                self.rt.decode(seq, tuple(fed))
            self.rt.release(seq)  # the scheduler ends a sequence it cannot grow

    @precondition(lambda self: self.rt.running)
    @rule(data=st.data(), retain=st.booleans(), fail=st.sampled_from([None, None, "insert"]))
    def release(self, data: st.DataObject, retain: bool, fail: str | None) -> None:
        """Release, retaining the decoded tokens under the prompt (the next turn of a
        conversation replays them: ``seen`` gets the extended prompt, whose reused KV
        ``_prefill`` checks), or not; a failing retention must still release everything."""
        seq = data.draw(st.sampled_from(sorted(self.rt.running.values(), key=lambda s: s.row)))
        lease, extended = seq.lease, seq.prompt.extended(seq.fed)
        node = lease.lock_node
        taken = node is not None and any(
            c.key == TextToken(f).key for c in node.children.values() for f in seq.fed[:1]
        )  # another request's copy of this answer's first token is cached there already
        # The lease asks the cache to insert whenever it may retain; the insert itself finds
        # another copy and inserts nothing, so an injected insert failure fires either way.
        attempted = retain and bool(seq.fed) and lease.can_retain()
        eligible = attempted and not taken
        try:
            self.rt.release(seq, retain, fail)
        except InjectedFailure:
            assert attempted and fail == "insert" and lease.released
            return
        assert lease.released and lease.retained in (0, len(seq.fed))
        assert bool(lease.retained) == eligible
        if eligible:
            m = self.cache.match_prefix(extended.cache_tokens(), extended.namespace)
            assert m.matched_kv_length == extended.length  # the answer is a hit now
            self.seen.append(extended)

    @rule(k=st.integers(0, 100))
    def evict(self, k: int) -> None:
        before_free = self.pt.pages_available
        reclaimable = self.cache.reclaimable_page_count()
        freed = self.cache.evict(k)
        assert self.pt.pages_available == before_free + freed
        assert freed <= reclaimable
        assert freed >= k or self.cache.reclaimable_page_count() == 0

    @invariant()
    def invariants(self) -> None:
        if hasattr(self, "rt"):
            check_all(self.rt)

    def teardown(self) -> None:
        if not hasattr(self, "rt"):
            return
        for seq in list(self.rt.running.values()):
            self.rt.release(seq)
        check_all(self.rt)
        self.cache.evict(self.pt.n_pages)
        assert self.pt.pages_available == self.pt.n_pages - 1
        assert self.cache.namespace_count == 0 and self.cache.node_count == 0


# 200 derandomized runs of up to 50 steps (was 300; 200 take two thirds of the time, and each
# rule, failure point and pool size is still drawn many times over).
CacheProtocolMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCacheProtocol = CacheProtocolMachine.TestCase


@pytest.mark.parametrize("fail", [None, "insert"])
def test_retaining_an_answer_another_request_cached_first(fail: str | None) -> None:
    """The machine's shrunk counterexample, kept as a fixed case: an extension caches the
    answer's first token under the prompt before the answer is retained. The lease still asks
    the cache to insert (which finds that copy and inserts nothing), so an insert that fails
    there fails the release after releasing everything."""
    pt, cache = make_cache(n_pages=64, max_batch_size=2)
    rt = FakeRuntime(pt, cache)
    base = Prompt((5, 6))
    seq = rt.start(base)
    other = rt.start(base.extended([4]), 2)  # BOS 5 6 4 cached by another request
    rt.release(other, retain=False)
    rt.decode(seq, (4, 1, 1))
    lease = seq.lease
    if fail is None:
        rt.release(seq, True, fail)
        assert lease.released and lease.retained == 0  # the copy cached first stays
    else:
        with pytest.raises(InjectedFailure):
            rt.release(seq, True, fail)
        assert lease.released
    check_all(rt)
