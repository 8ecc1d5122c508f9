"""Shared memory the crop worker processes write into, taken once and reused.

An image's crops travel through a shared-memory file (``memfd``): the serving process copies
the pixels in, the worker processes write the crops beside them. A fresh file per image costs
more than the copies: every page is allocated and faulted in on both sides (on the machine
that measured it, ~2 us a page: ~6 ms of a 1280 x 960 image's ~13 ms). So the process keeps
``SLOTS`` arenas, shared by every crop pool like the workers themselves: a request takes a free
one, grown (a new file, the slot's next ``generation``) when too small, and gives it back:
when its crops are copied out, or, lent with them, when they are gone (``maker.py``).
Each worker maps a slot's file once, with the slot's first request it serves, and keeps the
mapping until that slot's next generation replaces it (``worker.py``), so the pages
stay allocated and mapped across requests. A request larger than ``MAX_BYTES`` or one that
finds every arena taken gets a file of its own, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import mmap
import os
import threading
from dataclasses import dataclass

__all__ = ["ARENAS", "Arena", "Arenas"]

SLOTS = 8
MAX_BYTES = 48 << 20  # a 13-crop float32 image and its 2000 x 2000 source fit
_GRAIN = 1 << 20
# Slot numbers are unique in the process: the workers, shared by every set of arenas, keep
# their mappings by slot (a second set, as tests make, must not find the first one's there).
_SLOT_NUMBERS = itertools.count()
_SLOT_LOCK = threading.Lock()


@dataclass(slots=True, eq=False)
class Arena:
    """One shared-memory file and this process's mapping of it."""

    slot: int
    generation: int
    fd: int
    memory: mmap.mmap

    @property
    def size(self) -> int:
        return len(self.memory)

    @property
    def key(self) -> tuple[int, int]:
        return (self.slot, self.generation)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a view still reads it: freed with the view
            self.memory.close()
        os.close(self.fd)


def one_off(size: int, slot: int = -1) -> Arena:
    """A shared-memory file of ``size`` bytes, mapped here (``slot`` -1: not an arena)."""
    fd = os.memfd_create("kestrel-crops", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        return Arena(slot, 0, fd, mmap.mmap(fd, size))
    except BaseException:
        os.close(fd)
        raise


class Arenas:
    """``slots`` reusable arenas of at most ``max_bytes`` each (module doc)."""

    def __init__(self, slots: int = SLOTS, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        with _SLOT_LOCK:
            self.slots = tuple(next(_SLOT_NUMBERS) for _ in range(slots))
        self._free: list[int] = list(self.slots)
        self._arenas: dict[int, Arena] = {}
        self._generations = dict.fromkeys(self.slots, 0)
        self.made = 0  # files made for arenas (a reused arena makes none)

    def take(self, size: int) -> Arena | None:
        """A free arena of at least ``size`` bytes (grown if it was smaller), or None when
        ``size`` is over the limit or every arena is taken."""
        if size > self.max_bytes:
            return None
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            arena = self._arenas.pop(slot, None)
        if arena is not None and arena.size >= size:
            return arena
        if arena is not None:
            arena.close()
        try:
            grown = one_off(min(self.max_bytes, -(-size // _GRAIN) * _GRAIN), slot)
        except BaseException:
            self._give_slot(slot)
            raise
        with self._lock:
            self._generations[slot] += 1
            grown.generation = self._generations[slot]
            self.made += 1
        return grown

    def give(self, arena: Arena) -> None:
        """``arena`` is free again (its workers are done writing and its crops were copied out
        or, lent with them, are gone)."""
        with self._lock:
            self._arenas[arena.slot] = arena
            self._free.append(arena.slot)

    def close(self) -> None:
        """Unmap and close every free arena (at exit; taken ones close when given back)."""
        with self._lock:
            arenas, self._arenas = list(self._arenas.values()), {}
        for arena in arenas:
            arena.close()

    def _give_slot(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)


ARENAS = Arenas()
atexit.register(ARENAS.close)
