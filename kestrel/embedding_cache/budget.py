"""Budgets of the cache tiers: a number of megabytes (or gigabytes) from a caller, checked.

A budget is a plain non-negative number; 0 turns its tier off. Anything else (a bool, a string,
NaN, infinity, a negative number, more than the memory the tier would live in) is refused with a
message that names the option, so a typo never silently becomes "no cache" or an allocation that
cannot succeed.
"""

from __future__ import annotations

import itertools
import math
import os
from collections import OrderedDict
from numbers import Real
from typing import Generic, Protocol, TypeVar

__all__ = [
    "GIB",
    "MIB",
    "BudgetError",
    "ByteLRU",
    "budget_bytes",
    "host_memory_bytes",
]

MIB = 1 << 20
GIB = 1 << 30


class BudgetError(ValueError):
    """A cache budget that cannot be used as given."""


def host_memory_bytes() -> int | None:
    """This machine's physical memory, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def budget_bytes(value: object, *, name: str, unit: int, limit: int | None) -> int:
    """``value`` (in ``unit`` bytes: ``MIB`` or ``GIB``) as a whole number of bytes.

    ``name`` is the option's name for the message; ``limit``: the most bytes the tier's memory
    has (None: unknown, not checked)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise BudgetError(f"{name} must be a number (0 turns the tier off), got {value!r}")
    v = float(value)
    if math.isnan(v) or math.isinf(v):
        raise BudgetError(f"{name} must be a finite number, got {value!r}")
    if v < 0:
        raise BudgetError(f"{name} must be >= 0 (0 turns the tier off), got {value!r}")
    size = int(v * unit)
    if limit is not None and size > limit:
        unit_name = "MiB" if unit == MIB else "GiB"
        raise BudgetError(
            f"{name}={value!r} asks for {size / GIB:.1f} GiB, more than the "
            f"{limit / GIB:.1f} GiB of memory the tier would live in; pass a budget in "
            f"{unit_name} below that"
        )
    return size


class _Sized(Protocol):
    seq: int
    nbytes: int


_E = TypeVar("_E", bound=_Sized)


class ByteLRU(Generic[_E]):
    """Entries held under ``budget`` bytes, oldest first by their ``seq``: the bookkeeping both
    cache tiers share. A tier says which entries may go (``_evictable``) and takes one out of
    its own indexes as well (``_remove``, which also gives its bytes back)."""

    def __init__(self, budget: int, what: str) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"{what} needs a budget >= 1 byte, got {budget!r}")
        self.budget = budget
        self._lru: OrderedDict[int, _E] = OrderedDict()  # by entry seq, oldest first
        self._seq = itertools.count()
        self._bytes = 0
        self._evictions = 0

    def _evictable(self, entry: _E) -> bool:
        raise NotImplementedError

    def _remove(self, entry: _E) -> None:
        raise NotImplementedError

    def _make_room(self, nbytes: int) -> bool:
        """Evict the oldest evictable entries until ``nbytes`` more fit; evict nothing and
        return False when all of them cannot free enough."""
        need = self._bytes + nbytes - self.budget
        victims, freed = [], 0
        for entry in self._lru.values():
            if freed >= need:
                break
            if self._evictable(entry):
                victims.append(entry)
                freed += entry.nbytes
        if freed < need:
            return False
        for entry in victims:
            self._remove(entry)
        self._evictions += len(victims)
        return True
