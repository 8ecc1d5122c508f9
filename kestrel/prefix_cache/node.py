"""Tree nodes and the value types the radix cache returns, plus the key helpers.

Kept apart from ``radix_cache.py`` (the algorithms) so each file manages one thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING

from .tokens import CoordToken, SizeToken, TextToken

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .namespace import CacheNamespace
    from .tokens import CacheToken

__all__ = [
    "BAD_TOKENS",
    "CacheStats",
    "InsertResult",
    "MatchResult",
    "TreeNode",
    "common_prefix_len",
    "key_of",
    "token_keys",
    "token_kv_length",
]

BAD_TOKENS = "tokens must be cache tokens (Text/Coord/Size/ImageToken), got {!r:.200}"
key_of = attrgetter("key")
_UNIT_TYPES = frozenset((TextToken, CoordToken, SizeToken))  # one KV position each


def token_keys(tokens: Sequence[CacheToken]) -> tuple[tuple, ...]:
    try:
        return tuple(map(key_of, tokens))
    except AttributeError:
        raise TypeError(BAD_TOKENS.format(tokens)) from None


def token_kv_length(tokens: Sequence[CacheToken]) -> int:
    """Total KV positions. The set of token types is built in C, so a run without images
    costs no per-token Python call; only other tokens (images) are asked their length."""
    if _UNIT_TYPES.issuperset(map(type, tokens)):
        return len(tokens)
    try:
        return sum(1 if type(t) in _UNIT_TYPES else t.kv_length() for t in tokens)
    except AttributeError:
        raise TypeError(BAD_TOKENS.format(tokens)) from None


def common_prefix_len(a: tuple, b: tuple) -> int:
    """Length of the common prefix of two key tuples whose first elements are known equal.

    Binary search over C-level slice comparisons: O(n log n) element compares in C instead of
    a Python loop over every token.
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n - 1  # invariant: a[:lo] == b[:lo] and a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(slots=True, eq=False)
class TreeNode:
    """A cached run of tokens and the pages holding their KV.

    Invariants: ``len(physical_pages) == sum(t.kv_length() for t in tokens)``; ``keys`` are the
    tokens' keys; the parent holds this node under ``keys[0]``. Roots have no tokens or pages
    and carry their ``namespace``. ``detached`` marks nodes that were evicted or pruned.
    Identity semantics (``eq=False``): nodes are hashed and compared by object.
    """

    children: dict[tuple, TreeNode] = field(default_factory=dict)
    parent: TreeNode | None = None
    tokens: tuple[CacheToken, ...] = ()
    keys: tuple[tuple, ...] = ()
    physical_pages: tuple[int, ...] = ()
    lock_ref: int = 0
    last_access_time: int = 0
    heap_version: int = 0
    namespace: CacheNamespace | None = None
    detached: bool = False

    @property
    def total_kv_length(self) -> int:
        return len(self.physical_pages)

    def is_leaf(self) -> bool:
        return not self.children

    def is_root(self) -> bool:
        return self.parent is None and self.namespace is not None

    def __repr__(self) -> str:
        kind = "root" if self.is_root() else "node"
        return (
            f"TreeNode({kind}, tokens={len(self.tokens)}, pages={len(self.physical_pages)}, "
            f"children={len(self.children)}, lock_ref={self.lock_ref}, "
            f"detached={self.detached})"
        )


@dataclass(frozen=True, slots=True)
class MatchResult:
    """``matched_pages`` hold the KV of the first ``matched_token_count`` tokens
    (``matched_kv_length`` positions); ``last_node`` is the node the match ends on (lock it),
    ``None`` on a miss."""

    matched_pages: list[int]
    matched_kv_length: int
    matched_token_count: int
    last_node: TreeNode | None
    unmatched_tokens: list


@dataclass(frozen=True, slots=True)
class InsertResult:
    """``node`` ends at the deepest position the caller's pages are cached for;
    ``inserted_pages`` is how many of the caller's pages the cache claimed (0 if none)."""

    node: TreeNode
    inserted_pages: int


@dataclass(frozen=True, slots=True)
class CacheStats:
    namespaces: int
    nodes: int
    cached_pages: int
    evictable_pages: int
    reclaimable_pages: int
    locked_pages: int
    evicted_pages: int = 0  # cumulative since the cache was made
