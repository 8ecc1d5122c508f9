"""A model-free stand-in for ``MoondreamRuntime.start_sequence`` / ``release_sequence``.

It follows the cache protocol of design.md 3.4 (and ``kestrel/prefix_cache/base.py``) step by
step, but "prefill" only writes a fake KV value into each page: the value names what the real
KV would depend on (namespace, every cache key up to that position, offset inside the token).
A hit is then verified by reading the reused pages back, so a cache that hands out the wrong
pages is caught, not just one that loses count of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kestrel.kv_cache import PageTable
from kestrel.prefix_cache import (
    CacheNamespace,
    ImageToken,
    MatchResult,
    RadixPrefixCache,
    TextToken,
    TreeNode,
    kv_length,
)

BOS = 0


class InjectedFailure(RuntimeError):
    """Raised at a chosen protocol step to test the failure path."""


FAIL_POINTS = (
    "after_match",
    "after_map",
    "after_temp_lock",
    "after_alloc",
    "after_insert",
    "after_lock_transfer",
)


@dataclass(frozen=True)
class Prompt:
    text: tuple[int, ...]  # token ids after BOS (at least one: prompts end in text)
    image: tuple[int, int] | None = None  # (content hash, kv length)
    lora: str | None = None

    def cache_tokens(self) -> list:
        toks: list = [TextToken(BOS)]
        if self.image is not None:
            toks.append(ImageToken(*self.image))
        toks.extend(TextToken(t) for t in self.text)
        return toks

    @property
    def namespace(self) -> CacheNamespace:
        return CacheNamespace(self.lora, self.image[0] if self.image else None)

    @property
    def length(self) -> int:
        return kv_length(self.cache_tokens())

    def contents(self) -> list[tuple]:
        """The fake KV value of every prompt position."""
        out: list[tuple] = []
        prefix: tuple = ()
        for tok in self.cache_tokens():
            prefix = (*prefix, tok.key)
            out.extend((self.namespace, prefix, off) for off in range(tok.kv_length()))
        return out


@dataclass(eq=False)
class Seq:
    prompt: Prompt
    row: int = 0
    locks: list[TreeNode] = field(default_factory=list)
    cache_owned: int = 0
    skip: int = 0
    length: int = 0
    match: MatchResult | None = None
    inserted: int | None = None  # None: full-prompt hit, no insert

    @property
    def lock_node(self) -> TreeNode | None:
        assert len(self.locks) <= 1, "a sequence holds at most one lock"
        return self.locks[0] if self.locks else None


class FakeRuntime:
    def __init__(self, pt: PageTable, cache: RadixPrefixCache) -> None:
        self.pt, self.cache = pt, cache
        self.kv: dict[int, tuple] = {}  # physical page -> fake KV value
        self.running: dict[int, Seq] = {}

    # ------------------------------------------------------------ protocol
    def start(self, prompt: Prompt, max_new: int = 0, fail_at: str | None = None) -> Seq:
        return self.finish(self.begin(prompt, max_new, fail_at), fail_at)

    def begin(self, prompt: Prompt, max_new: int = 0, fail_at: str | None = None) -> Seq:
        """Steps 1-5: match, row, map reused pages, temporary lock, allocate, prefill."""
        seq = Seq(prompt)
        pt, cache = self.pt, self.cache
        try:
            toks, plen = prompt.cache_tokens(), prompt.length
            m = cache.match_prefix(toks, prompt.namespace)
            self._fail(fail_at, "after_match")
            seq.row = pt.allocate()
            hit = m.matched_kv_length > 0
            if hit and prompt.image is not None:
                assert m.matched_kv_length >= 1 + prompt.image[1], "image hit must cover BOS+image"
            seq.skip = min(m.matched_kv_length, plen - 1) if hit else 0
            pt.map_pages(seq.row, 0, m.matched_pages[: seq.skip])
            seq.cache_owned = seq.skip
            self._fail(fail_at, "after_map")
            if hit:
                cache.lock(m.last_node)
                seq.locks.append(m.last_node)
            seq.match = m
            self._fail(fail_at, "after_temp_lock")
            expected = prompt.contents()
            reused = pt.get_pages(seq.row, 0, seq.skip)
            assert [self.kv.get(p) for p in reused] == expected[: seq.skip], "wrong KV reused"
            fresh = pt.allocate_pages(plen + max_new - seq.skip)
            pt.map_pages(seq.row, seq.skip, fresh)
            self._fail(fail_at, "after_alloc")
            row = pt.get_pages(seq.row, 0, plen)
            for pos in range(seq.skip, plen):  # "prefill": write only private pages
                assert not cache.owns_page(row[pos]), "prefill would write a shared page"
                self.kv[row[pos]] = expected[pos]
            seq.length = plen
        except BaseException:
            self._cleanup(seq)
            raise
        return seq

    def finish(self, seq: Seq, fail_at: str | None = None) -> Seq:
        """Steps 6-8: insert right after prefill, lock transfer, cache-owned count."""
        pt, cache, m = self.pt, self.cache, seq.match
        assert m is not None
        try:
            temp = m.last_node
            if temp is not None and m.matched_kv_length >= seq.prompt.length:
                seq.inserted = None  # full-prompt hit: keep the temporary lock, no insert
            else:
                pages = pt.get_pages(seq.row, 0, seq.prompt.length)
                r = cache.insert(
                    seq.prompt.cache_tokens(),
                    pages,
                    seq.prompt.namespace,
                    from_node=temp,
                    from_token_idx=m.matched_token_count,
                    from_page_idx=seq.skip,
                )
                seq.inserted = r.inserted_pages
                seq.cache_owned = seq.skip + r.inserted_pages
                self._fail(fail_at, "after_insert")
                if r.node is not temp:  # identity case: keep the lock we hold
                    cache.lock(r.node)
                    seq.locks.append(r.node)
                    if temp is not None:
                        cache.unlock(temp)
                        seq.locks.remove(temp)
            self._fail(fail_at, "after_lock_transfer")
        except BaseException:
            self._cleanup(seq)
            raise
        assert len(seq.locks) == 1, "exactly one lock per running sequence"
        self.running[seq.row] = seq
        return seq

    def decode(self, seq: Seq, n: int) -> None:
        """Grow by ``n`` positions (reserve evicts on demand) and write them privately."""
        new_len = seq.length + n
        self.pt.reserve(seq.row, new_len)
        row = self.pt.get_pages(seq.row, seq.length, new_len)
        for pos, page in enumerate(row, start=seq.length):
            assert not self.cache.owns_page(page), "decode would write a shared page"
            self.kv[page] = ("decode", id(seq), pos)
        seq.length = new_len

    def release(self, seq: Seq) -> None:
        """Step 9: one unlock, then erase with the cache-owned count."""
        del self.running[seq.row]
        self.cache.unlock(seq.lock_node)
        self.pt.erase(seq.row, seq.cache_owned)
        seq.locks.clear()

    # ------------------------------------------------------------- helpers
    def _cleanup(self, seq: Seq) -> None:
        for node in reversed(seq.locks):
            self.cache.unlock(node)
        seq.locks.clear()
        if seq.row:
            self.pt.erase(seq.row, seq.cache_owned)
            seq.row = 0

    @staticmethod
    def _fail(fail_at: str | None, point: str) -> None:
        if fail_at == point:
            raise InjectedFailure(point)


def all_nodes(cache: RadixPrefixCache) -> list[TreeNode]:
    """Every node including roots."""
    out, stack = [], list(cache._trees.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def check_all(rt: FakeRuntime) -> None:
    """Every invariant of design.md section 4, plus the protocol's lock accounting."""
    pt, cache = rt.pt, rt.cache
    cache.check_integrity()
    owned = {p for n in all_nodes(cache) for p in n.physical_pages}
    free = set(pt.free_pages)
    assert not owned & free, "a page is both free and cached"
    private = {p for b in pt.active_batch_indices() for p in pt.page_table_cpu[b]} - owned
    assert len(free) + len(owned) + len(private) == pt.n_pages - 1
    assert len(owned) == cache.total_cached_pages
    assert set(pt.active_batch_indices()) == set(rt.running)
    expected: dict[int, int] = {}
    for seq in rt.running.values():
        assert len(seq.locks) == 1 and not seq.lock_node.detached
        node = seq.lock_node
        while node is not None:
            expected[id(node)] = expected.get(id(node), 0) + 1
            node = node.parent
        row = pt.page_table_cpu[seq.row]
        assert all(cache.owns_page(p) for p in row[: seq.cache_owned])
        assert not any(cache.owns_page(p) for p in row[seq.cache_owned :])
        assert [rt.kv.get(p) for p in row[: seq.prompt.length]] == seq.prompt.contents()
    for node in all_nodes(cache):
        assert node.lock_ref == expected.get(id(node), 0), f"lock_ref of {node!r}"


def make_cache(n_pages: int = 200, max_batch_size: int = 4) -> tuple[PageTable, RadixPrefixCache]:
    pt = PageTable(n_pages, max_batch_size=max_batch_size, max_seq_len=1024)
    cache = RadixPrefixCache(pt)
    pt.set_prefix_cache(cache)
    return pt, cache


def text(*ids: int) -> list[TextToken]:
    return [TextToken(i) for i in ids]
