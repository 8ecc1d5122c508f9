"""The page table's invariants (design.md section 4), read through its public accessors.

``check_page_table(pt)`` checks the pool (the free stack holds exactly the FREE pages, once
each), every row (active rows map only allocated or cached pages, their cache-owned pages
first, and agree with the device mirror; inactive rows map nothing) and the partition: each
private page is mapped by exactly one row, once, and no private page is unmapped (leaked).
The cache-owned half (the trees hold exactly the CACHED pages) is checked by the prefix cache,
which then calls this. Raises CacheIntegrityError.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from kestrel.kv.pool import EMPTY_PAGES, CacheIntegrityError, PagePool, PageState

__all__ = ["PageRows", "check_page_table"]


class PageRows(Protocol):
    """The page table as this check reads it (its public accessors; ``PageTable`` is one)."""

    pool: PagePool
    prefix_cache: Any
    page_table: torch.Tensor
    max_batch_size: int
    n_pages: int

    def host_rows(self) -> np.ndarray: ...

    def row_lengths(self) -> tuple[int, ...]: ...

    def row_pages(self, batch_idx: int, start: int = 0, end: int | None = None) -> np.ndarray: ...

    def active_batch_indices(self) -> list[int]: ...

    def free_batch_rows(self) -> tuple[int, ...]: ...


_FREE, _PRIVATE, _CACHED, _PADDING = (int(s) for s in PageState)


def _fail(msg: str) -> None:
    raise CacheIntegrityError(msg)


def check_page_table(pt: PageRows) -> None:
    pt.pool.check()
    states = pt.pool.states()
    if pt.prefix_cache is None and np.count_nonzero(states == _CACHED):
        _fail("pages are cache-owned but no prefix cache is attached")
    host, lens = pt.host_rows(), pt.row_lengths()
    device = pt.page_table.cpu().numpy()
    active = set(pt.active_batch_indices())
    private: list[np.ndarray] = []
    for b in range(pt.max_batch_size + 1):
        n = lens[b]
        if b not in active:
            if n or host[b].any() or device[b].any():
                _fail(f"inactive batch row {b} still maps pages")
            continue
        row = host[b, :n]
        if not np.array_equal(device[b], host[b]) or host[b, n:].any():
            _fail(f"device page_table row {b} is out of sync with its host copy")
        private.append(_check_row(b, row, states))
    _check_private(pt, states, private)
    inactive = set(range(1, pt.max_batch_size + 1)) - active
    rows = pt.free_batch_rows()
    if set(rows) != inactive or len(rows) != len(inactive):
        _fail("free batch rows disagree with the active flags")


def _check_row(b: int, row: np.ndarray, states: np.ndarray) -> np.ndarray:
    """The row's private pages, after checking it maps no free page and its cache-owned
    pages come first."""
    row_states = states.take(row)
    bad = np.flatnonzero((row_states == _FREE) | (row_states == _PADDING))
    if len(bad):
        pos = int(bad[0])
        _fail(f"row {b} position {pos} maps page {row[pos]}, which is padding or free")
    cached = row_states == _CACHED
    n_head = len(row) if cached.all() else int(np.argmin(cached))
    if cached[n_head:].any():
        _fail(f"row {b}: a cache-owned page after a private page (erase would free it)")
    return row[n_head:]


def _check_private(pt: PageRows, states: np.ndarray, private: list[np.ndarray]) -> None:
    mapped = np.concatenate(private) if private else EMPTY_PAGES
    dup = pt.pool.duplicate_of(mapped)
    if dup is not None:
        rows = [b for b in pt.active_batch_indices() if dup in pt.row_pages(b)]
        _fail(f"private page {dup} is mapped twice (rows {rows})")
    n_private = int(np.count_nonzero(states == _PRIVATE))
    if n_private != len(mapped):
        leaked = np.setdiff1d(np.flatnonzero(states == _PRIVATE), mapped)
        _fail(
            f"{n_private} pages are private but rows map {len(mapped)}: free "
            f"{pt.pool.free_count} + cached {int(np.count_nonzero(states == _CACHED))} + "
            f"private {len(mapped)} != {pt.n_pages - 1} usable pages; leaked pages: "
            f"{leaked[:20].tolist()}"
        )
