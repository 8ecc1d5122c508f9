"""Budgets of the cache tiers: a number of megabytes (or gigabytes) from a caller, checked.

A budget is a plain non-negative number; 0 turns its tier off. Anything else (a bool, a string,
NaN, infinity, a negative number, more than the memory the tier would live in) is refused with a
message that names the option, so a typo never silently becomes "no cache" or an allocation that
cannot succeed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from numbers import Real
from typing import Protocol, TypeVar

__all__ = ["GIB", "MIB", "BudgetError", "budget_bytes", "host_memory_bytes", "make_room"]

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
    nbytes: int


_E = TypeVar("_E", bound=_Sized)


def make_room(
    entries: Iterable[_E],
    used: int,
    budget: int,
    nbytes: int,
    evictable: Callable[[_E], bool],
    remove: Callable[[_E], None],
) -> int | None:
    """Make ``nbytes`` more fit under ``budget`` (``used`` taken): the first ``evictable`` of
    ``entries`` (oldest first) that together free enough go through ``remove``. Returns how
    many were evicted, or None when all of them cannot free enough (then none is)."""
    need = used + nbytes - budget
    victims, freed = [], 0
    for entry in entries:
        if freed >= need:
            break
        if evictable(entry):
            victims.append(entry)
            freed += entry.nbytes
    if freed < need:
        return None
    for entry in victims:
        remove(entry)
    return len(victims)
