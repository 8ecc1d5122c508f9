"""PagePool: the state of every KV page and the free stack, as numpy arrays.

page_size is 1, so a page is one KV position. Each page is in exactly one state (design.md
section 4): ``FREE`` (on the free stack), ``PRIVATE`` (handed out: mapped by one batch row, or
about to be), ``CACHED`` (owned by one prefix-cache node); page 0 is ``PADDING`` forever.

Pages travel as 1-D int32 arrays. Every transition checks the current state of *all* the pages
it moves with one vectorized gather and changes nothing when one is wrong, so the ownership
and double-free guards cost a few numpy calls per request instead of a Python loop per page:

    allocate  FREE    -> PRIVATE   (pops the free stack)
    free      PRIVATE -> FREE      (erase, rollbacks; a FREE page raises DoubleFreeError)
    claim     PRIVATE -> CACHED    (prefix-cache insert)
    evict     CACHED  -> FREE      (prefix-cache eviction)

Pages listed twice in one call are refused as well (a double free, or a double claim).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import numpy as np

__all__ = [
    "EMPTY_PAGES",
    "CacheIntegrityError",
    "DoubleFreeError",
    "PagePool",
    "PageState",
    "PageTableError",
    "as_pages",
    "first_duplicate",
]


class PageTableError(ValueError):
    """A page-table call that breaks its contract (bad row, overlap, bad counts, bad pages)."""


class DoubleFreeError(PageTableError):
    """A page returned to the free pool that is already free (or listed twice)."""


class CacheIntegrityError(AssertionError):
    """``check_integrity`` found a violated invariant (design.md section 4)."""


class PageState(IntEnum):
    FREE = 0
    PRIVATE = 1
    CACHED = 2
    PADDING = 3


_FREE, _PRIVATE, _CACHED, _PADDING = (int(s) for s in PageState)
_SMALL = 32  # up to this many pages a Python set finds duplicates faster than numpy
_PUT_MAX = 256  # ndarray.put beats fancy assignment on short index arrays, not on long ones

_INT32 = np.dtype(np.int32)
EMPTY_PAGES = np.empty(0, dtype=np.int32)
EMPTY_PAGES.flags.writeable = False


def as_pages(pages: Sequence[int] | np.ndarray) -> np.ndarray:
    """``pages`` as a 1-D int32 array (no copy when it already is one)."""
    if type(pages) is np.ndarray and pages.dtype is _INT32 and pages.ndim == 1:
        return pages
    arr = np.asarray(pages, dtype=np.int32)
    if arr.ndim != 1:
        raise PageTableError(f"pages must be a 1-D sequence of ints, got shape {arr.shape}")
    return arr


def first_duplicate(pages: np.ndarray, scratch: np.ndarray | None = None) -> int | None:
    """A page listed twice in ``pages``, or None. With ``scratch`` (an int32 array indexed by
    page, at least as long as the largest page + 1) large lists cost two vectorized passes."""
    k = len(pages)
    if k < 2:
        return None
    if k <= _SMALL or scratch is None:
        listed = pages.tolist()
        if len(set(listed)) == k:
            return None
    else:
        order = np.arange(k, dtype=np.int32)
        scratch.put(pages, order)  # with duplicates, the later position wins ...
        if scratch.take(pages).tobytes() == order.tobytes():  # ... and reads back wrong
            return None
        listed = pages.tolist()
    seen: set[int] = set()
    for p in listed:
        if p in seen:
            return p
        seen.add(p)
    return None  # unreachable


class PagePool:
    """Page states (uint8 per page) and the free stack (int32). Single-threaded."""

    def __init__(self, n_pages: int) -> None:
        if n_pages < 2:
            raise PageTableError(f"n_pages must be >= 2 (page 0 is padding), got {n_pages}")
        self.n_pages = n_pages
        # One byte per page, plus a PADDING sentinel at index n_pages: gathers clip every
        # out-of-range page (negative ones to page 0) onto a PADDING entry, so range checks
        # come free with the state check.
        self._bytes = bytearray(n_pages + 1)  # all FREE (0); short moves index it directly
        self._state = np.frombuffer(self._bytes, dtype=np.uint8)  # the same memory, for numpy
        self._state[0] = self._state[n_pages] = _PADDING
        # The free stack: popping from the top hands out 1, 2, 3, ... on a fresh pool.
        self._stack = np.arange(n_pages - 1, 0, -1, dtype=np.int32)
        self._top = n_pages - 1
        self._scratch = np.zeros(n_pages, dtype=np.int32)

    # ----------------------------------------------------------------- queries
    @property
    def free_count(self) -> int:
        return self._top

    def states(self) -> np.ndarray:
        """Every page's state (read-only view; index by page)."""
        view = self._state[: self.n_pages]
        view.flags.writeable = False
        return view

    def free_stack(self) -> np.ndarray:
        """The free pages, bottom of the stack first (read-only view)."""
        view = self._stack[: self._top]
        view.flags.writeable = False
        return view

    def state_of(self, page: int) -> PageState:
        return PageState(int(self._state[page]))

    def state_bytes(self, pages: np.ndarray) -> bytes:
        """One byte per page: its state (``bytes.count`` then counts pages per state in C).
        Pages outside 1..n_pages-1 read as PADDING."""
        return self._state.take(pages, mode="clip").tobytes()

    def check_range(self, pages: np.ndarray, states: bytes, what: str) -> None:
        """Raise for padding or out-of-range pages (``states`` from ``state_bytes``)."""
        if states.count(_PADDING):
            bad = self.first_in_state(pages, states, (_PADDING,))
            if bad == 0:
                raise PageTableError(f"page 0 cannot be {what} (page 0 is padding)")
            raise PageTableError(f"pages must lie in 1..{self.n_pages - 1}, got {bad}")

    def duplicate_of(self, pages: np.ndarray) -> int | None:
        """A page listed twice in ``pages``, or None (two vectorized passes)."""
        return first_duplicate(pages, self._scratch)

    def first_in_state(self, pages: np.ndarray, states: bytes, wanted: tuple[int, ...]) -> int:
        """The first page of ``pages`` whose state is in ``wanted`` (for error messages)."""
        return next(int(p) for p, s in zip(pages, states, strict=True) if s in wanted)

    # ------------------------------------------------------------- transitions
    def allocate(self, count: int) -> np.ndarray:
        """``count`` pages off the free stack, now PRIVATE. The caller checked the count."""
        top = self._top
        if not 0 <= count <= top:
            raise PageTableError(f"cannot take {count} pages from a pool with {top} free")
        pages = self._stack[top - count : top][::-1].copy()
        self._top = top - count
        self._set(pages, _PRIVATE)
        return pages

    def free(self, pages: np.ndarray) -> None:
        """PRIVATE -> FREE. A free page, a cache-owned one or a repeated one raises and
        nothing changes."""
        bad = self._move(pages, _PRIVATE, _FREE)
        if bad is not None:
            page, why = bad
            if why == "range":
                raise PageTableError(f"pages to free must lie in 1..{self.n_pages - 1}")
            if why == "repeat":
                raise DoubleFreeError(f"page {page} is listed twice (double free)")
            if self._state[page] == _FREE:
                raise DoubleFreeError(f"page {page} is already free (double free)")
            raise PageTableError(
                f"page {page} is owned by the prefix cache; only eviction returns it to the pool"
            )
        self._push(pages)

    def claim(self, pages: np.ndarray) -> None:
        """PRIVATE -> CACHED (the prefix cache takes ownership). Raises, changing nothing, for
        padding, free, already cached or repeated pages."""
        if len(pages) <= _SMALL:  # (the common case: a prompt's new suffix)
            bad = self._move_short(pages.tolist(), _PRIVATE, _CACHED)
        else:
            bad = self._move(pages, _PRIVATE, _CACHED)
        if bad is not None:
            page, why = bad
            if why == "range":
                if page == 0:
                    raise PageTableError("page 0 cannot be cached (page 0 is padding)")
                raise PageTableError(f"pages must lie in 1..{self.n_pages - 1}, got {page}")
            if why == "repeat":
                raise PageTableError("the pages to insert list a page twice")
            if self._state[page] == _CACHED:
                raise PageTableError(
                    f"page {page} is already owned by the cache; pages are claimed once"
                )
            raise PageTableError(f"page {page} is free; only allocated pages can be cached")

    def evict(self, chunks: list[np.ndarray]) -> None:
        """CACHED -> FREE for the pages of evicted nodes (a page not CACHED is a double free:
        it raises and nothing changes)."""
        pages = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
        bad = self._move(pages, _CACHED, _FREE, repeats_possible=False)
        if bad is not None:
            page, why = bad
            state = self._state[page] if why == "state" else _PADDING
            raise DoubleFreeError(
                f"evicting page {page}, which is {PageState(state).name} (double free)"
            )
        self._push(pages)

    def _move(
        self, pages: np.ndarray, src: int, dst: int, repeats_possible: bool = True
    ) -> tuple[int, str] | None:
        """Move every page from state ``src`` to ``dst``, all or nothing. Returns None, or
        (page, why) for the first offender: ``"range"`` (padding or outside the pool),
        ``"state"`` (not in ``src``) or ``"repeat"`` (listed twice); then nothing changed.
        Short lists take a Python loop over the state bytes (a numpy call costs more than
        the whole loop); long ones one vectorized gather, a duplicate scan and one scatter."""
        k = len(pages)
        if k <= _SMALL:
            return self._move_short(pages.tolist(), src, dst)
        states = self._state.take(pages, mode="clip").tobytes()
        if states.count(src) != k:
            page = self.first_in_state(pages, states, tuple(set(range(4)) - {src}))
            return page, ("range" if not 0 < page < self.n_pages else "state")
        if repeats_possible:
            dup = first_duplicate(pages, self._scratch)
            if dup is not None:
                return dup, "repeat"
        self._set(pages, dst)
        return None

    def _move_short(self, pages: list[int], src: int, dst: int) -> tuple[int, str] | None:
        st, n = self._bytes, self.n_pages
        for i, p in enumerate(pages):
            if not 0 < p < n or st[p] != src:
                why = "range" if not 0 < p < n else "repeat" if p in pages[:i] else "state"
                for q in pages[:i]:  # undo: nothing changes
                    st[q] = src
                return p, why
            st[p] = dst
        return None

    def _push(self, pages: np.ndarray) -> None:
        """Push freed pages (already marked FREE) reversed: the first is allocated first."""
        k = len(pages)
        top = self._top
        self._stack[top : top + k] = pages[::-1]
        self._top = top + k

    def _set(self, pages: np.ndarray, state: int) -> None:
        if len(pages) <= _PUT_MAX:
            self._state.put(pages, state)
        else:
            self._state[pages] = state

    # --------------------------------------------------------------- integrity
    def check(self) -> None:
        """The stack holds exactly the FREE pages, once each; page 0 is padding."""
        state, stack = self.states(), self.free_stack()
        if state[0] != _PADDING or np.count_nonzero(state[1:] == _PADDING):
            raise CacheIntegrityError("page 0 must be (and be the only) padding page")
        if int(state.max()) > _PADDING:
            raise CacheIntegrityError("a page has an unknown state")
        if len(stack) and (int(stack.min()) < 1 or int(stack.max()) >= self.n_pages):
            raise CacheIntegrityError("the free stack holds a page outside 1..n_pages-1")
        if first_duplicate(stack, self._scratch) is not None:
            raise CacheIntegrityError("the free pool lists a page twice")
        if np.count_nonzero(state == _FREE) != len(stack) or np.count_nonzero(
            state.take(stack) != _FREE
        ):
            raise CacheIntegrityError("free-page flags disagree with the free pool")
