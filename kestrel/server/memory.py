"""Keeping a long-running server's resident memory near what its objects need (glibc Linux).

A server decodes images and builds tensors on many threads (the event loop, the decode worker
pool, the scheduler). glibc malloc gives each thread that contends for the heap an arena of
its own (up to 8 per core), and raises its mmap threshold after large blocks are freed, so
later large blocks come from those arenas too. Freed memory then stays in a dozen arenas
instead of going back to the system: under a conversation load the resident size roughly
doubles while Python's own heap stays flat.

:func:`tune_allocator` (called by ``kestrel serve`` before the model loads) bounds the arenas
and fixes the mmap and trim thresholds through ``mallopt``; :class:`IdleTrimmer` calls
``malloc_trim(0)`` when the server goes idle (at most once per ``interval_s``), in a thread of
its own. Both do nothing off glibc, or when ``KESTREL_MALLOC=system`` asks to keep the
allocator's defaults. A ``MALLOC_ARENA_MAX`` / ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` set in the environment wins over the value here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
import time
from functools import cache

__all__ = ["ALLOCATOR_SETTINGS", "IdleTrimmer", "glibc", "trim", "tune_allocator"]

# mallopt parameter numbers (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# name, mallopt parameter, environment variable that overrides it, value
ALLOCATOR_SETTINGS: tuple[tuple[str, int, str, int], ...] = (
    ("arena_max", _M_ARENA_MAX, "MALLOC_ARENA_MAX", 2),
    ("mmap_threshold", _M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", 256 << 10),
    ("trim_threshold", _M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", 4 << 20),
)


@cache
def glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc with ``mallopt`` and ``malloc_trim``; None otherwise."""
    if not sys.platform.startswith("linux") or os.environ.get("KESTREL_MALLOC") == "system":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (musl has no such symbol)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


def tune_allocator() -> dict[str, int]:
    """Apply :data:`ALLOCATOR_SETTINGS` (those the environment does not set); returns what was
    applied, empty off glibc. Call it early: arenas that exist already stay."""
    libc = glibc()
    if libc is None:
        return {}
    applied = {}
    for name, param, env, value in ALLOCATOR_SETTINGS:
        if env not in os.environ and libc.mallopt(param, value) == 1:
            applied[name] = value
    return applied


def trim() -> bool:
    """Give free heap memory at the top of every arena back to the system (glibc only)."""
    libc = glibc()
    return libc is not None and bool(libc.malloc_trim(0))


class IdleTrimmer:
    """Runs :func:`trim` in a background thread when poked, at most once per ``interval_s``
    and never twice at a time. :meth:`poke` never blocks its caller (the event loop)."""

    def __init__(self, interval_s: float = 2.0) -> None:
        glibc()  # found now (ctypes asks ldconfig, a process): never inside a request
        self.interval_s = interval_s
        self.trims = 0
        self._last = -interval_s
        self._running = threading.Lock()

    def poke(self) -> bool:
        """Start a trim unless one ran recently or is running; whether one started."""
        now = time.monotonic()
        if glibc() is None or now - self._last < self.interval_s:
            return False
        if not self._running.acquire(blocking=False):
            return False
        self._last = now
        threading.Thread(target=self._run, name="kestrel-trim", daemon=True).start()
        return True

    def _run(self) -> None:
        try:
            trim()
            self.trims += 1
        finally:
            self._running.release()
