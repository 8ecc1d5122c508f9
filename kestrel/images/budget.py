"""Decoded image bytes in flight, bounded: what a flood of uploads may make the process hold.

A request holds its decoded pixels from the decode until it ends (its crops are cut from them
on a miss). Counting requests does not bound that: 48 concurrent 49 MP PNGs, 208 kB each on
the wire, once took a server from 420 MB to 9.8 GB. :class:`DecodeBudget` counts bytes: a
decode first takes what it may hold at its peak (from the header, before any pixel is
decoded: ``Shrink.peak_bytes``), waits while that does not fit, and once decoded keeps only
its array's bytes, given back when the array is freed (``weakref.finalize``: the request
dropped it, or an error did). A decode that has waited ``wait_s`` raises
:class:`~kestrel.errors.OverloadedError` (the server's 503 with ``Retry-After``). One image
larger than the whole budget is let in alone, when nothing else is held, so it is never
refused for its size (the pixel limit does that).
"""

from __future__ import annotations

import os
import threading
import time
import weakref

import numpy as np

from kestrel.errors import OverloadedError

__all__ = ["DEFAULT_WAIT_S", "Charge", "DecodeBudget", "default_budget_bytes"]

DEFAULT_WAIT_S = 30.0
_MIB = 1 << 20


def default_budget_bytes() -> int:
    """A sixteenth of the machine's memory, at least 256 MiB and at most 1 GiB: 1 GiB holds
    ~340 decoded 1 MP images, or seven 49 MP ones decoded in full."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 << 30
    return max(256 * _MIB, min(1024 * _MIB, total // 16))


class Charge:
    """Bytes one decode holds of a :class:`DecodeBudget`; given back once (``release``, or
    with the array it was settled on)."""

    __slots__ = ("__weakref__", "_budget", "_lock", "nbytes")

    def __init__(self, budget: DecodeBudget, nbytes: int) -> None:
        self._budget = budget
        self._lock = threading.Lock()
        self.nbytes = nbytes

    def settle(self, array: np.ndarray) -> np.ndarray:
        """Keep only ``array``'s bytes (the decode's peak is over) until it is freed."""
        self._give(max(0, self.nbytes - array.nbytes))
        weakref.finalize(array, self.release)
        return array

    def release(self) -> None:
        self._give(self.nbytes)

    def _give(self, nbytes: int) -> None:
        with self._lock:
            nbytes = min(nbytes, self.nbytes)
            self.nbytes -= nbytes
        if nbytes:
            self._budget._give(nbytes)


class DecodeBudget:
    """At most ``limit`` bytes of decoded images at once (module doc); ``wait_s``: how long a
    decode waits for room by default. Thread-safe."""

    def __init__(self, limit: int | None = None, wait_s: float = DEFAULT_WAIT_S) -> None:
        limit = default_budget_bytes() if limit is None else int(limit)
        if limit < 1:
            raise ValueError(f"the image memory budget must be positive, got {limit} bytes")
        if wait_s < 0:
            raise ValueError(f"wait_s must be >= 0, got {wait_s}")
        self.limit = limit
        self.wait_s = wait_s
        self._room = threading.Condition()
        self.in_use = 0
        self.peak = 0  # the most bytes held at once
        self.waited = 0  # decodes that had to wait for room
        self.refused = 0  # decodes that waited wait_s in vain

    def take(self, nbytes: int, what: str = "image", wait_s: float | None = None) -> Charge:
        """Hold ``nbytes`` (waiting up to ``wait_s``, default the budget's), or raise
        OverloadedError."""
        nbytes = max(0, int(nbytes))
        deadline = time.monotonic() + (self.wait_s if wait_s is None else wait_s)
        with self._room:
            if not self._fits(nbytes):
                self.waited += 1
            while not self._fits(nbytes):
                left = deadline - time.monotonic()
                if left <= 0:
                    self.refused += 1
                    raise OverloadedError(
                        f"decoding {what} needs {nbytes / _MIB:,.1f} MiB, and the "
                        f"{self.limit / _MIB:,.0f} MiB of image memory stayed in use by "
                        "other requests; retry shortly"
                    )
                self._room.wait(left)
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
        return Charge(self, nbytes)

    def stats_fields(self) -> dict[str, int]:
        """The budget's figures under their ``EngineStats`` names."""
        with self._room:
            return {"image_memory_bytes": self.in_use, "image_memory_peak_bytes": self.peak,
                    "image_memory_budget_bytes": self.limit,
                    "image_decodes_waited": self.waited,
                    "image_decodes_refused": self.refused}  # fmt: skip

    def _fits(self, nbytes: int) -> bool:
        return self.in_use + nbytes <= self.limit or self.in_use == 0

    def _give(self, nbytes: int) -> None:
        with self._room:
            self.in_use -= nbytes
            self._room.notify_all()
