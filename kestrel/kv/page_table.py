"""PageTable: the page pool plus the per-row logical -> physical mapping.

page_size is 1: a page is one KV position, and logical page ``i`` of a row is its position
``i``. Physical page 0 is never handed out and batch row 0 is never allocated: both are padding
(a padded row reads page 0 through row 0). The host keeps every row in one int32 numpy array
(``row_pages`` returns views of it) and mirrors it into ``page_table`` (int32
``[max_batch_size + 1, max_seq_len]`` on ``device``, padding entries 0), which kernels read; on
the CPU the two share memory.

Page states live in the :class:`~kestrel.kv.pool.PagePool` (free / private / cached, one byte
per page); who moves pages between them is described in ``kestrel/prefix_cache/base.py``. This
class owns the pool and the batch rows, and asks the attached prefix cache to evict when the
pool runs dry. Pages travel as 1-D int32 arrays; ``get_pages`` returns a list for callers that
want plain ints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from kestrel.kv.integrity import check_page_table
from kestrel.kv.pool import (
    EMPTY_PAGES,
    CacheIntegrityError,
    DoubleFreeError,
    PagePool,
    PageState,
    PageTableError,
    as_pages,
)
from kestrel.kv.storage import PagedKVCache

__all__ = [
    "BatchSlotsExhausted",
    "CacheIntegrityError",
    "CacheOwner",
    "DoubleFreeError",
    "PagePoolExhausted",
    "PageState",
    "PageTable",
    "PageTableError",
    "PagedKVCache",
]


class CacheOwner(Protocol):
    """What the page table asks of the prefix cache attached to it (the cache owns the
    CACHED pages and gives them back when evicting). Defined here, below the cache, so the
    KV layer never imports the cache."""

    page_table: PageTable

    @property
    def total_cached_pages(self) -> int: ...

    def reclaimable_page_count(self) -> int: ...

    def evict(self, needed_pages: int) -> int: ...

    def check_integrity(self) -> None: ...


_FREE, _PRIVATE, _CACHED, _PADDING = (int(s) for s in PageState)


class PagePoolExhausted(RuntimeError):
    """Not enough free plus reclaimable pages for an allocation."""


class BatchSlotsExhausted(RuntimeError):
    """Every batch row is in use."""


class PageTable:
    """Pages and batch rows. Single-threaded, like the cache (the scheduler thread)."""

    def __init__(
        self,
        n_pages: int,
        page_size: int = 1,
        max_batch_size: int = 16,
        device: str | torch.device = "cpu",
        max_seq_len: int = 2048,
    ) -> None:
        if page_size != 1:
            raise PageTableError(
                f"page_size must be 1 (the prefix cache shares KV per position), got {page_size}"
            )
        if max_batch_size < 1 or max_seq_len < 1:
            raise PageTableError(
                f"max_batch_size and max_seq_len must be >= 1, got {max_batch_size}, {max_seq_len}"
            )
        self.pool = PagePool(n_pages)
        self.n_pages = n_pages
        self.page_size = page_size
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.device = torch.device(device)
        self._free_rows: list[int] = list(range(max_batch_size, 0, -1))
        self._active = [False] * (max_batch_size + 1)
        self._lens = [0] * (max_batch_size + 1)
        self._rows = np.zeros((max_batch_size + 1, max_seq_len), dtype=np.int32)
        self._host_is_device = self.device.type == "cpu"
        if self._host_is_device:
            self.page_table = torch.from_numpy(self._rows)  # shares memory: no mirroring
        else:
            self.page_table = torch.zeros(
                (max_batch_size + 1, max_seq_len), dtype=torch.int32, device=self.device
            )
        self.prefix_cache: CacheOwner | None = None

    # ----------------------------------------------------------------- queries
    @property
    def pages_available(self) -> int:
        """Free pages (not counting what eviction could reclaim)."""
        return self.pool.free_count

    @property
    def free_pages(self) -> tuple[int, ...]:
        """A snapshot of the free pool (for tests and debugging; O(n))."""
        return tuple(self.pool.free_stack().tolist())

    def is_free(self, page: int) -> bool:
        return self.pool.state_of(page) is PageState.FREE

    def capacity(self, batch_idx: int) -> int:
        """Mapped positions of a row (== pages, page_size 1)."""
        return self._lens[self._row(batch_idx)]

    seq_len = capacity

    def active_batch_indices(self) -> list[int]:
        return [b for b in range(1, self.max_batch_size + 1) if self._active[b]]

    def free_batch_rows(self) -> tuple[int, ...]:
        return tuple(self._free_rows)

    def row_pages(self, batch_idx: int, start: int = 0, end: int | None = None) -> np.ndarray:
        """The row's physical pages at positions ``start:end`` (read-only int32 view, valid
        until the row changes; copy it to keep it)."""
        n = self._lens[self._row(batch_idx)]
        end = n if end is None else end
        if not 0 <= start <= end <= n:
            raise PageTableError(
                f"pages {start}:{end} of row {batch_idx} outside its {n} mapped positions"
            )
        view = self._rows[batch_idx, start:end]
        view.flags.writeable = False
        return view

    def get_pages(self, batch_idx: int, start: int, end: int) -> list[int]:
        """``row_pages`` as a list of ints."""
        return self.row_pages(batch_idx, start, end).tolist()

    def host_rows(self) -> np.ndarray:
        """The host copy of every row, ``[max_batch_size + 1, max_seq_len]`` (read-only)."""
        view = self._rows.view()
        view.flags.writeable = False
        return view

    def row_lengths(self) -> tuple[int, ...]:
        """Mapped positions of every row, row 0 (padding) included."""
        return tuple(self._lens)

    @property
    def page_table_cpu(self) -> list[list[int]]:
        """Every row's mapped pages as lists (a snapshot, for tests and debugging)."""
        return [self._rows[b, : self._lens[b]].tolist() for b in range(self.max_batch_size + 1)]

    # -------------------------------------------------------------- rows
    def allocate(self) -> int:
        """A free batch row (1..max_batch_size)."""
        if not self._free_rows:
            raise BatchSlotsExhausted(
                f"all {self.max_batch_size} batch rows are in use; release a sequence first"
            )
        b = self._free_rows.pop()
        self._active[b] = True
        return b

    def erase(self, batch_idx: int, cached_page_count: int = 0) -> None:
        """Release a row: its first ``cached_page_count`` pages are cache-owned and stay; the
        rest are freed. Refuses (changing nothing) counts that would free a cache page or
        leak a private one, and pages that are already free."""
        n = self._lens[self._row(batch_idx)]
        if not 0 <= cached_page_count <= n:
            raise PageTableError(
                f"cached_page_count={cached_page_count} outside 0..{n} for row {batch_idx}"
            )
        if self.prefix_cache is None and cached_page_count:
            raise PageTableError("cached_page_count > 0 but no prefix cache is attached")
        row = self._rows[batch_idx, :n]
        head, tail = row[:cached_page_count], row[cached_page_count:]
        states = self.pool.state_bytes(head)
        if states.count(_CACHED) != len(head):
            bad = self.pool.first_in_state(head, states, (_FREE, _PRIVATE))
            raise PageTableError(
                f"erase({batch_idx}, {cached_page_count}): page {bad} is inside the "
                "cache-owned count but the cache does not own it (it would leak); use "
                "skip + inserted_pages"
            )
        try:
            self.pool.free(tail)
        except DoubleFreeError:
            raise
        except PageTableError:  # a cache-owned page after the count: say which
            states = self.pool.state_bytes(tail)
            bad = self.pool.first_in_state(tail, states, (_CACHED,))
            raise PageTableError(
                f"erase({batch_idx}, {cached_page_count}): page {bad} is owned by the cache "
                "but would be freed; use skip + inserted_pages"
            ) from None
        self._write(batch_idx, 0, np.zeros(n, dtype=np.int32))
        self._lens[batch_idx] = 0
        self._active[batch_idx] = False
        self._free_rows.append(batch_idx)

    # ------------------------------------------------------------- pages
    def set_prefix_cache(self, cache: CacheOwner | None) -> None:
        """Attach the cache that ``allocate_pages`` evicts from when the pool is short."""
        if cache is not None and getattr(cache, "page_table", self) is not self:
            raise PageTableError("the prefix cache was built over a different PageTable")
        self.prefix_cache = cache

    def allocate_pages(self, count: int) -> np.ndarray:
        """``count`` free pages (batch-private once mapped), evicting cached pages if needed.

        Raises PagePoolExhausted, without evicting anything, when free plus reclaimable
        pages cannot cover the request.
        """
        if count < 0:
            raise PageTableError(f"count must be >= 0, got {count}")
        if count == 0:
            return EMPTY_PAGES
        short = count - self.pool.free_count
        if short > 0:
            cache = self.prefix_cache
            if cache is None or cache.reclaimable_page_count() < short:
                raise PagePoolExhausted(self._exhausted_message(count))
            cache.evict(short)
            if self.pool.free_count < count:  # only if the cache's counters lie
                raise PagePoolExhausted(self._exhausted_message(count))
        return self.pool.allocate(count)

    def _exhausted_message(self, count: int) -> str:
        cache = self.prefix_cache
        cached = cache.total_cached_pages if cache is not None else 0
        reclaimable = cache.reclaimable_page_count() if cache is not None else 0
        return (
            f"cannot allocate {count} pages: {self.pool.free_count} free, {cached} cached of "
            f"which {cached - reclaimable} are locked by active sequences and {reclaimable} "
            f"reclaimable (pool of {self.n_pages - 1} usable pages). Admit fewer or shorter "
            "requests, or give the KV cache more pages"
        )

    def free_pages_to_pool(self, pages: Sequence[int] | np.ndarray) -> None:
        """Return private pages to the free pool. A page already free (or listed twice)
        raises DoubleFreeError, a cache-owned one PageTableError; either way nothing changes."""
        self.pool.free(as_pages(pages))

    def claim_pages(self, pages: np.ndarray) -> None:
        """Private -> cache-owned (the prefix cache's insert); see ``PagePool.claim``."""
        self.pool.claim(pages)

    def evict_pages(self, chunks: list[np.ndarray]) -> None:
        """Cache-owned -> free (the prefix cache's eviction); see ``PagePool.evict``."""
        self.pool.evict(chunks)

    def map_pages(self, batch_idx: int, logical_start: int, pages: Sequence[int]) -> None:
        """Append ``pages`` to a row at positions ``logical_start ..``; mappings are sequential
        and never overlap, so ``logical_start`` must equal the row's current length."""
        n = self._lens[self._row(batch_idx)]
        if logical_start != n:
            raise PageTableError(
                f"map_pages({batch_idx}, {logical_start}, ...): mappings are sequential and "
                f"non-overlapping; the row has {n} positions mapped, so logical_start "
                f"must be {n}"
            )
        pages = as_pages(pages)
        end = logical_start + len(pages)
        if end > self.max_seq_len:
            raise PageTableError(f"row {batch_idx} would map {end} > max_seq_len positions")
        if not len(pages):
            return
        states = self.pool.state_bytes(pages)
        self.pool.check_range(pages, states, "mapped")
        if states.count(_FREE):
            bad = self.pool.first_in_state(pages, states, (_FREE,))
            raise PageTableError(f"page {bad} is free; allocate it (or match it) before mapping")
        self._write(batch_idx, logical_start, pages)
        self._lens[batch_idx] = end

    def _write(self, batch_idx: int, start: int, pages: np.ndarray) -> None:
        end = start + len(pages)
        self._rows[batch_idx, start:end] = pages
        if not self._host_is_device:
            if not (pages.flags.writeable and pages.flags.c_contiguous):
                pages = pages.copy()  # (torch wants a writable, contiguous source)
            self.page_table[batch_idx, start:end] = torch.from_numpy(pages).to(self.device)

    def can_reserve_with_eviction(self, size: int, batch_idx_int: int | None = None) -> bool:
        """Whether ``size`` positions fit: for a new request (``batch_idx_int is None``) a free
        row and ``size`` pages, else a row grown to ``size``; counts free + reclaimable."""
        if size > self.max_seq_len:
            return False
        if batch_idx_int is None:
            if not self._free_rows:
                return False
            need = size
        else:
            need = size - self.capacity(batch_idx_int)
        if need <= 0:
            return True
        cache = self.prefix_cache
        reclaimable = cache.reclaimable_page_count() if cache is not None else 0
        return self.pool.free_count + reclaimable >= need

    def reserve(self, batch_idx: int, seq_len: int) -> None:
        """Grow a row to ``seq_len`` positions with fresh private pages (evicting on demand).
        All or nothing: prefer it to ``allocate_pages`` + ``map_pages``, whose pages leak if
        the caller fails between the two calls."""
        have = self.capacity(batch_idx)
        if seq_len > self.max_seq_len:
            raise PageTableError(f"seq_len {seq_len} > max_seq_len {self.max_seq_len}")
        if seq_len <= have:
            return
        pages = self.allocate_pages(seq_len - have)
        try:
            self.map_pages(batch_idx, have, pages)
        except BaseException:
            self.pool.free(pages)  # allocate + map is all or nothing
            raise

    def build_slot_mapping(
        self, batch_idx: int, positions: torch.Tensor | Sequence[int]
    ) -> torch.Tensor:
        """int64 physical pages (== KV slots) of a row's logical ``positions``, on ``device``.
        Host positions are bounds-checked; device tensors are gathered as they are."""
        n = self._lens[self._row(batch_idx)]
        if isinstance(positions, torch.Tensor):
            pos = positions.to(dtype=torch.long)
            if pos.device.type == "cpu" and pos.numel():
                lo, hi = int(pos.min()), int(pos.max())
                if lo < 0 or hi >= n:
                    raise PageTableError(
                        f"positions {lo}..{hi} outside row {batch_idx}'s {n} positions"
                    )
            pos = pos.to(self.device)
            return (
                self.page_table[batch_idx]
                .index_select(0, pos.reshape(-1))
                .reshape(pos.shape)
                .to(torch.int64)
            )
        positions = list(positions)
        if positions and (min(positions) < 0 or max(positions) >= n):
            raise PageTableError(
                f"positions {min(positions)}..{max(positions)} outside row {batch_idx}'s "
                f"{n} mapped positions"
            )
        pages = self._rows[batch_idx].take(positions) if positions else EMPTY_PAGES
        return torch.tensor(pages, dtype=torch.int64, device=self.device)

    def _row(self, batch_idx: int) -> int:
        if not 1 <= batch_idx <= self.max_batch_size or not self._active[batch_idx]:
            raise PageTableError(
                f"batch row {batch_idx} is not allocated (rows 1..{self.max_batch_size}; "
                "erased twice?)"
            )
        return batch_idx

    # ----------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Design.md section 4. With a cache attached, runs the cache's full check (which
        calls ``check_pages`` back); raises CacheIntegrityError."""
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
        else:
            self.check_pages()

    def check_pages(self) -> None:
        """The page-table half of ``check_integrity`` (see ``kestrel/kv/integrity.py``)."""
        check_page_table(self)
