"""PageTable: the physical page pool and the per-row logical -> physical mapping.

page_size is 1: a page is one KV position, and logical page ``i`` of a row is its position
``i``. Physical page 0 is never handed out and batch row 0 is never allocated: both are padding
(a padded row reads page 0 through row 0). The host keeps ``page_table_cpu[row]`` (a list, the
source of truth) and mirrors it into ``page_table`` (int32 ``[max_batch_size + 1, max_seq_len]``
on ``device``, padding entries 0), which kernels read.

Page states and who moves pages between them are described in
``kestrel/prefix_cache/base.py``; this class owns the free pool and the batch rows, and asks
the attached prefix cache to evict when the pool runs dry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from kestrel.kv_storage import PagedKVCache

if TYPE_CHECKING:
    from kestrel.prefix_cache.radix_cache import RadixPrefixCache

__all__ = [
    "BatchSlotsExhausted",
    "DoubleFreeError",
    "PagePoolExhausted",
    "PageTable",
    "PageTableError",
    "PagedKVCache",
]


class PageTableError(ValueError):
    """A page-table call that breaks its contract (bad row, overlap, bad counts)."""


class DoubleFreeError(PageTableError):
    """A page returned to the free pool that is already free."""


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
        if n_pages < 2:
            raise PageTableError(f"n_pages must be >= 2 (page 0 is padding), got {n_pages}")
        if max_batch_size < 1 or max_seq_len < 1:
            raise PageTableError(
                f"max_batch_size and max_seq_len must be >= 1, got {max_batch_size}, {max_seq_len}"
            )
        self.n_pages = n_pages
        self.page_size = page_size
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.device = torch.device(device)
        # Stack of free pages: popping from the end hands out 1, 2, 3, ... on a fresh table.
        self._free: list[int] = list(range(n_pages - 1, 0, -1))
        self._is_free = bytearray(b"\x00" + b"\x01" * (n_pages - 1))
        self._free_rows: list[int] = list(range(max_batch_size, 0, -1))
        self._active = [False] * (max_batch_size + 1)
        self.page_table_cpu: list[list[int]] = [[] for _ in range(max_batch_size + 1)]
        self.page_table = torch.zeros(
            (max_batch_size + 1, max_seq_len), dtype=torch.int32, device=self.device
        )
        self.prefix_cache: RadixPrefixCache | None = None

    # ----------------------------------------------------------------- queries
    @property
    def pages_available(self) -> int:
        """Free pages (not counting what eviction could reclaim)."""
        return len(self._free)

    @property
    def free_pages(self) -> tuple[int, ...]:
        """A snapshot of the free pool (for tests and debugging; O(n))."""
        return tuple(self._free)

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    def capacity(self, batch_idx: int) -> int:
        """Mapped positions of a row (== pages, page_size 1)."""
        return len(self.page_table_cpu[self._row(batch_idx)])

    seq_len = capacity

    def active_batch_indices(self) -> list[int]:
        return [b for b in range(1, self.max_batch_size + 1) if self._active[b]]

    def get_pages(self, batch_idx: int, start: int, end: int) -> list[int]:
        row = self.page_table_cpu[self._row(batch_idx)]
        if not 0 <= start <= end <= len(row):
            raise PageTableError(
                f"get_pages({batch_idx}, {start}, {end}) outside the row's {len(row)} mapped "
                "positions"
            )
        return row[start:end]

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
        leak a private one."""
        row = self.page_table_cpu[self._row(batch_idx)]
        if not 0 <= cached_page_count <= len(row):
            raise PageTableError(
                f"cached_page_count={cached_page_count} outside 0..{len(row)} for row {batch_idx}"
            )
        cache = self.prefix_cache
        if cache is None and cached_page_count:
            raise PageTableError("cached_page_count > 0 but no prefix cache is attached")
        if cache is not None:
            bad = cache.first_not_owned(row[:cached_page_count])
            if bad is not None:
                raise PageTableError(
                    f"erase({batch_idx}, {cached_page_count}): page {bad} is inside the "
                    "cache-owned count but the cache does not own it (it would leak); use "
                    "skip + inserted_pages"
                )
            bad = cache.first_owned(row[cached_page_count:])
            if bad is not None:
                raise PageTableError(
                    f"erase({batch_idx}, {cached_page_count}): page {bad} is owned by the cache "
                    "but would be freed; use skip + inserted_pages"
                )
        self.free_pages_to_pool(row[cached_page_count:])
        self.page_table[batch_idx, : len(row)] = 0
        self.page_table_cpu[batch_idx] = []
        self._active[batch_idx] = False
        self._free_rows.append(batch_idx)

    # ------------------------------------------------------------- pages
    def set_prefix_cache(self, cache: RadixPrefixCache | None) -> None:
        """Attach the cache that ``allocate_pages`` evicts from when the pool is short."""
        if cache is not None and getattr(cache, "page_table", self) is not self:
            raise PageTableError("the prefix cache was built over a different PageTable")
        self.prefix_cache = cache

    def allocate_pages(self, count: int) -> list[int]:
        """``count`` free pages (batch-private once mapped), evicting cached pages if needed.

        Raises PagePoolExhausted, without evicting anything, when free plus reclaimable
        pages cannot cover the request.
        """
        if count < 0:
            raise PageTableError(f"count must be >= 0, got {count}")
        if count == 0:
            return []
        short = count - len(self._free)
        if short > 0:
            cache = self.prefix_cache
            if cache is None or cache.reclaimable_page_count() < short:
                raise PagePoolExhausted(self._exhausted_message(count))
            cache.evict(short)
            if len(self._free) < count:  # only if the cache's counters lie
                raise PagePoolExhausted(self._exhausted_message(count))
        pages = self._free[-count:]
        del self._free[-count:]
        pages.reverse()
        is_free = self._is_free
        for p in pages:
            is_free[p] = 0
        return pages

    def _exhausted_message(self, count: int) -> str:
        cache = self.prefix_cache
        cached = cache.total_cached_pages if cache is not None else 0
        reclaimable = cache.reclaimable_page_count() if cache is not None else 0
        return (
            f"cannot allocate {count} pages: {len(self._free)} free, {cached} cached of which "
            f"{cached - reclaimable} are locked by active sequences and {reclaimable} reclaimable "
            f"(pool of {self.n_pages - 1} usable pages). Admit fewer or shorter requests, or "
            "give the KV cache more pages"
        )

    def free_pages_to_pool(self, pages: Sequence[int]) -> None:
        """Return pages to the free pool (eviction and erase). A page already free raises
        DoubleFreeError and nothing changes."""
        if not pages:
            return
        if min(pages) < 1 or max(pages) >= self.n_pages:
            raise PageTableError(
                f"pages to free must lie in 1..{self.n_pages - 1}, got {min(pages)}..{max(pages)}"
            )
        is_free = self._is_free
        for idx, p in enumerate(pages):
            if is_free[p]:
                for q in pages[:idx]:
                    is_free[q] = 0
                raise DoubleFreeError(f"page {p} is already free (double free)")
            is_free[p] = 1
        self._free.extend(reversed(pages))

    def map_pages(self, batch_idx: int, logical_start: int, pages: Sequence[int]) -> None:
        """Append ``pages`` to a row at positions ``logical_start ..``; mappings are sequential
        and never overlap, so ``logical_start`` must equal the row's current length."""
        row = self.page_table_cpu[self._row(batch_idx)]
        if logical_start != len(row):
            raise PageTableError(
                f"map_pages({batch_idx}, {logical_start}, ...): mappings are sequential and "
                f"non-overlapping; the row has {len(row)} positions mapped, so logical_start "
                f"must be {len(row)}"
            )
        end = logical_start + len(pages)
        if end > self.max_seq_len:
            raise PageTableError(f"row {batch_idx} would map {end} > max_seq_len positions")
        if not pages:
            return
        if min(pages) < 1 or max(pages) >= self.n_pages:
            raise PageTableError(f"pages must lie in 1..{self.n_pages - 1}")
        is_free = self._is_free
        bad = next((p for p in pages if is_free[p]), None)
        if bad is not None:
            raise PageTableError(f"page {bad} is free; allocate it (or match it) before mapping")
        row.extend(pages)
        self.page_table[batch_idx, logical_start:end] = torch.as_tensor(
            list(pages), dtype=torch.int32
        ).to(self.device)

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
        return len(self._free) + reclaimable >= need

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
            self.free_pages_to_pool(pages)  # allocate + map is all or nothing
            raise

    def build_slot_mapping(
        self, batch_idx: int, positions: torch.Tensor | Sequence[int]
    ) -> torch.Tensor:
        """int64 physical pages (== KV slots) of a row's logical ``positions``, on ``device``.
        Host positions are bounds-checked; device tensors are gathered as they are."""
        row = self.page_table_cpu[self._row(batch_idx)]
        if isinstance(positions, torch.Tensor):
            pos = positions.to(dtype=torch.long)
            if pos.device.type == "cpu" and pos.numel():
                lo, hi = int(pos.min()), int(pos.max())
                if lo < 0 or hi >= len(row):
                    raise PageTableError(
                        f"positions {lo}..{hi} outside row {batch_idx}'s {len(row)} positions"
                    )
            pos = pos.to(self.device)
            return (
                self.page_table[batch_idx]
                .index_select(0, pos.reshape(-1))
                .reshape(pos.shape)
                .to(torch.int64)
            )
        positions = list(positions)
        if positions and (min(positions) < 0 or max(positions) >= len(row)):
            raise PageTableError(
                f"positions {min(positions)}..{max(positions)} outside row {batch_idx}'s "
                f"{len(row)} mapped positions"
            )
        return torch.tensor([row[p] for p in positions], dtype=torch.int64, device=self.device)

    def _row(self, batch_idx: int) -> int:
        if not 1 <= batch_idx <= self.max_batch_size or not self._active[batch_idx]:
            raise PageTableError(
                f"batch row {batch_idx} is not allocated (rows 1..{self.max_batch_size}; "
                "erased twice?)"
            )
        return batch_idx

    # ----------------------------------------------------------- integrity
    def check_integrity(self, cache_owned: Mapping[int, object] | None = None) -> None:
        """Check the page-state partition (design.md section 4). With a cache attached and no
        ``cache_owned`` map, runs the cache's full check (which calls back here)."""
        if cache_owned is None and self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
            return
        from kestrel.prefix_cache.integrity import check_page_table

        check_page_table(self, cache_owned or {})
