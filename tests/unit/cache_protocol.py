"""A model-free runtime that drives the real cache protocol (``kestrel.prefix_cache.CacheLease``).

The protocol (match, map, lock, allocate, insert, lock transfer, release) is the lease's, the
very code ``MoondreamRuntime`` runs; only the prefill is fake: it writes a fake KV value into
each private page, naming what the real KV would depend on (namespace, every cache key up to
that position, offset inside the token). A hit is then verified by reading the reused pages
back, so a cache that hands out the wrong pages is caught, not just one that loses count.

Failures are injected where they really happen: a named page-table or cache method raises on
its n-th call (``"lock#2"``), or the fake prefill raises, or the caller fails right after
``commit``. The lease must then give back every page and lock it took.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from kestrel.kv.page_table import PageTable
from kestrel.prefix_cache import (
    CacheLease,
    CacheNamespace,
    ImageToken,
    LeasePhase,
    RadixPrefixCache,
    TextToken,
    TreeNode,
    kv_length,
)

BOS = 0


class InjectedFailure(RuntimeError):
    """Raised at a chosen protocol step to test the failure path."""


# "method" fails on its first call, "method#n" on its n-th; "prefill" and "after_commit" are
# the caller's own steps. Which calls happen depends on the path (miss / partial / full hit):
# a point that is not reached leaves the request to complete normally.
FAIL_POINTS = (
    "match_prefix",  # before anything is taken
    "allocate",  # no batch row
    "map_pages",  # the reused pages (hit) or the private ones (miss)
    "map_pages#2",  # the private pages after a hit
    "lock",  # the temporary lock (hit), or the transfer lock after a miss's insert
    "lock#2",  # the transfer lock after a hit's insert
    "allocate_pages",  # the private pages (after the temporary lock on a hit)
    "prefill",  # between prepare and commit
    "row_pages",  # reading the row's pages for the insert
    "insert",  # the commit's insert
    "unlock",  # the transfer's unlock of the temporary lock: two locks held at that moment
    "after_commit",  # the caller fails once the sequence is committed
)
_CACHE_METHODS = ("match_prefix", "lock", "unlock", "insert")


class Injector:
    """Makes one page-table or cache method raise on its n-th call (``fired`` says whether)."""

    def __init__(self, fail_at: str | None) -> None:
        self.fail_at = fail_at
        name, _, nth = (fail_at or "").partition("#")
        self.method, self.nth, self.calls, self.fired = name, int(nth or 1), 0, False

    def step(self, point: str) -> None:
        """The caller's own failure points (``prefill``, ``after_commit``)."""
        if self.method == point:
            self.fired = True
            raise InjectedFailure(point)

    @contextmanager
    def patched(self, pt: PageTable, cache: RadixPrefixCache) -> Iterator[None]:
        if self.method in ("", "prefill", "after_commit"):
            yield
            return
        target = cache if self.method in _CACHE_METHODS else pt
        real = getattr(target, self.method)

        def failing(*args, **kwargs):
            self.calls += 1
            if self.calls == self.nth:
                self.fired = True
                raise InjectedFailure(self.fail_at)
            return real(*args, **kwargs)

        setattr(target, self.method, failing)  # an instance attribute shadows the method
        try:
            yield
        finally:
            delattr(target, self.method)


@dataclass(frozen=True)
class Prompt:
    text: tuple[int, ...]  # token ids after BOS (and after the first image)
    image: tuple[int, int] | None = None  # (content hash, kv length), right after BOS
    lora: str | None = None
    after: tuple = ()  # cache tokens after the text: later images, decoded tokens, more text

    def cache_tokens(self) -> list:
        toks: list = [TextToken(BOS)]
        if self.image is not None:
            toks.append(ImageToken(*self.image))
        toks.extend(TextToken(t) for t in self.text)
        toks.extend(self.after)
        return toks

    def extended(self, ids: tuple[int, ...] | list[int]) -> Prompt:
        """This prompt followed by text tokens (decoded ones: what the next turn replays)."""
        return replace(self, after=(*self.after, *(TextToken(i) for i in ids)))

    @property
    def namespace(self) -> CacheNamespace:
        """Keyed by the prompt's first image (or none), as the runtime keys a conversation."""
        first = [t.content_hash for t in self.cache_tokens() if isinstance(t, ImageToken)]
        return CacheNamespace(self.lora, first[0] if first else None)

    @property
    def length(self) -> int:
        return kv_length(self.cache_tokens())

    @property
    def min_hit(self) -> int:
        """An image hit must cover BOS and the image block."""
        return 1 + self.image[1] if self.image else 0

    def contents(self) -> list[tuple]:
        """The fake KV value of every prompt position."""
        return list(_contents(self))


@functools.lru_cache(maxsize=4096)
def _contents(prompt: Prompt) -> tuple[tuple, ...]:
    """``Prompt.contents``, computed once per prompt (the invariant check after every step asks
    for it of every running sequence)."""
    out: list[tuple] = []
    prefix: tuple = ()
    namespace = prompt.namespace
    for tok in prompt.cache_tokens():
        prefix = (*prefix, tok.key)
        out.extend((namespace, prefix, off) for off in range(tok.kv_length()))
    return tuple(out)


@dataclass(eq=False)
class Seq:
    """A sequence of the fake runtime: its prompt, its lease, the positions written."""

    prompt: Prompt
    lease: CacheLease
    length: int = 0
    fed: tuple[int, ...] = ()  # decoded token ids, one per position written after the prompt

    row = property(lambda self: self.lease.row)
    skip = property(lambda self: self.lease.skip)
    match = property(lambda self: self.lease.match)
    inserted = property(lambda self: self.lease.inserted)  # None: nothing inserted
    cache_owned = property(lambda self: self.lease.cache_owned)
    locks = property(lambda self: self.lease.locks)
    lock_node = property(lambda self: self.lease.lock_node)


class FakeRuntime:
    def __init__(self, pt: PageTable, cache: RadixPrefixCache) -> None:
        self.pt, self.cache = pt, cache
        self.kv: dict[int, tuple] = {}  # physical page -> fake KV value
        self.running: dict[int, Seq] = {}
        self.last_injector: Injector | None = None

    # ------------------------------------------------------------ protocol
    def start(self, prompt: Prompt, max_new: int = 0, fail_at: str | None = None) -> Seq:
        """prepare + fake prefill + commit, with an optional injected failure."""
        inj = self.last_injector = Injector(fail_at)
        with inj.patched(self.pt, self.cache):
            seq = self.begin(prompt, max_new, inj)
            return self.finish(seq, inj)

    def begin(self, prompt: Prompt, max_new: int = 0, inj: Injector | None = None) -> Seq:
        """``CacheLease.prepare``, then the fake prefill of positions skip..prompt_len-1."""
        lease = CacheLease.prepare(
            self.pt, self.cache, prompt.cache_tokens(), prompt.namespace,
            prompt_length=prompt.length, max_length=prompt.length + max_new,
            min_hit=prompt.min_hit,
        )  # fmt: skip
        seq = Seq(prompt, lease)
        try:
            if inj is not None:
                inj.step("prefill")
            self._prefill(seq)
        except BaseException:
            lease.abort()
            raise
        return seq

    def _prefill(self, seq: Seq) -> None:
        expected, plen, skip = seq.prompt.contents(), seq.prompt.length, seq.skip
        row = self.pt.get_pages(seq.row, 0, plen)
        assert [self.kv.get(p) for p in row[:skip]] == expected[:skip], "wrong KV reused"
        for pos in range(skip, plen):  # write only private pages
            assert not self.cache.owns_page(row[pos]), "prefill would write a shared page"
            self.kv[row[pos]] = expected[pos]
        seq.length = plen

    def finish(self, seq: Seq, inj: Injector | None = None) -> Seq:
        """``CacheLease.commit`` (insert, lock transfer); a failure after it aborts."""
        seq.lease.commit()
        try:
            if inj is not None:
                inj.step("after_commit")
        except BaseException:
            seq.lease.abort()
            raise
        assert len(seq.locks) == 1, "exactly one lock per running sequence"
        self.running[seq.row] = seq
        return seq

    def decode(self, seq: Seq, fed: tuple[int, ...]) -> None:
        """Feed ``fed`` (reserve evicts on demand), writing into private pages the KV a prefill
        of the prompt followed by these tokens would write: what retention may share."""
        new_len = seq.length + len(fed)
        self.pt.reserve(seq.row, new_len)
        row = self.pt.get_pages(seq.row, seq.length, new_len)
        want = seq.prompt.extended(seq.fed + fed).contents()
        for pos, page in enumerate(row, start=seq.length):
            assert not self.cache.owns_page(page), "decode would write a shared page"
            self.kv[page] = want[pos]
        seq.length, seq.fed = new_len, seq.fed + fed

    def release(self, seq: Seq, retain: bool = True, fail_at: str | None = None) -> None:
        """``CacheLease.release``: retain the decoded tokens (unless ``retain`` is false), one
        unlock, then erase with the cache-owned count. An injected failure (``"insert"``: the
        retention's insert) must still release everything, then propagate."""
        del self.running[seq.row]
        inj = self.last_injector = Injector(fail_at)
        with inj.patched(self.pt, self.cache):
            seq.lease.release(text(*seq.fed) if retain else ())


def all_nodes(cache: RadixPrefixCache) -> list[TreeNode]:
    """Every node including roots."""
    out, stack = [], list(cache.roots().values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def check_all(rt: FakeRuntime) -> None:
    """Every invariant of design.md section 4, plus the protocol's lock accounting."""
    pt, cache = rt.pt, rt.cache
    cache.check_integrity()
    owned = {p for n in all_nodes(cache) for p in n.physical_pages.tolist()}
    free = set(pt.free_pages)
    assert not owned & free, "a page is both free and cached"
    private = {p for b in pt.active_batch_indices() for p in pt.page_table_cpu[b]} - owned
    assert len(free) + len(owned) + len(private) == pt.n_pages - 1
    assert len(owned) == cache.total_cached_pages
    assert set(pt.active_batch_indices()) == set(rt.running)
    expected: dict[int, int] = {}
    for seq in rt.running.values():
        assert seq.lease.phase is LeasePhase.COMMITTED
        assert len(seq.locks) == 1 and not seq.lock_node.detached
        node = seq.lock_node
        while node is not None:
            expected[id(node)] = expected.get(id(node), 0) + 1
            node = node.parent
        row = pt.page_table_cpu[seq.row]
        assert all(cache.owns_page(p) for p in row[: seq.cache_owned])
        assert not any(cache.owns_page(p) for p in row[seq.cache_owned :])
        assert [rt.kv.get(p) for p in row[: seq.length]] == seq.prompt.extended(seq.fed).contents()
    for node in all_nodes(cache):
        assert node.lock_ref == expected.get(id(node), 0), f"lock_ref of {node!r}"


def make_cache(n_pages: int = 200, max_batch_size: int = 4) -> tuple[PageTable, RadixPrefixCache]:
    pt = PageTable(n_pages, max_batch_size=max_batch_size, max_seq_len=1024)
    cache = RadixPrefixCache(pt)
    pt.set_prefix_cache(cache)
    return pt, cache


def text(*ids: int) -> list[TextToken]:
    return [TextToken(i) for i in ids]
