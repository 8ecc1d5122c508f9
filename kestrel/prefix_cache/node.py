"""Tree nodes and the value types the radix cache returns, plus the key helpers.

The bottom of the package's own modules (below ``base``, ``eviction``, ``integrity`` and
``radix_cache``, which all use these types): it imports only the token types (and the page
pool's empty page array).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kestrel.kv.pool import EMPTY_PAGES
from kestrel.tokens import CoordToken, SizeToken, TextToken

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kestrel.tokens import CacheToken

    from .namespace import CacheNamespace

__all__ = [
    "BAD_TOKENS",
    "EMPTY_PAGES",
    "CacheStats",
    "InsertResult",
    "MatchResult",
    "TreeNode",
    "common_prefix_len",
    "frozen_pages",
    "key_of",
    "miss",
    "start_of",
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


def frozen_pages(pages: np.ndarray) -> np.ndarray:
    """A read-only int32 copy of ``pages``: what a node keeps (its slices stay read-only)."""
    out = pages.copy()
    out.setflags(write=False)
    return out


class TreeNode:
    """A cached run of tokens and the pages holding their KV.

    Invariants: ``len(physical_pages) == sum(t.kv_length() for t in tokens)``; ``keys`` are the
    tokens' keys (built on first use: a leaf no later request matches through never pays for
    them); the parent holds this node under ``key``, its first token's key. Roots have no
    tokens or pages and carry their ``namespace``. ``detached`` marks nodes that were evicted
    or pruned. ``physical_pages`` is a read-only int32 array, replaced (never written) by a
    split. Identity semantics: nodes are hashed and compared by object.
    """

    __slots__ = (
        "_keys",
        "children",
        "detached",
        "heap_version",
        "key",
        "last_access_time",
        "lock_ref",
        "namespace",
        "parent",
        "physical_pages",
        "tokens",
    )

    def __init__(
        self,
        parent: TreeNode | None = None,
        tokens: tuple[CacheToken, ...] = (),
        keys: tuple[tuple, ...] | None = None,
        physical_pages: np.ndarray = EMPTY_PAGES,
        last_access_time: int = 0,
        lock_ref: int = 0,
        namespace: CacheNamespace | None = None,
    ) -> None:
        self.children: dict[tuple, TreeNode] = {}
        self.parent = parent
        self.tokens = tokens
        self.key = tokens[0].key if tokens else None
        self._keys = keys
        self.physical_pages = physical_pages
        self.last_access_time = last_access_time
        self.lock_ref = lock_ref
        self.heap_version = 0
        self.namespace = namespace
        self.detached = False

    @property
    def keys(self) -> tuple[tuple, ...]:
        """The tokens' keys (what matching compares), built on first use."""
        keys = self._keys
        if keys is None:
            keys = self._keys = token_keys(self.tokens)
        return keys

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


class MatchResult(NamedTuple):
    """``matched_pages`` (int32, read-only) hold the KV of the first ``matched_token_count``
    tokens (``matched_kv_length`` positions); ``last_node`` is the node the match ends on
    (lock it), ``None`` on a miss. ``tokens`` is the query; ``unmatched_tokens`` the rest of it
    (built on demand: a miss costs no copy of a long prompt)."""

    matched_pages: np.ndarray
    matched_kv_length: int
    matched_token_count: int
    last_node: TreeNode | None
    tokens: Sequence[CacheToken]

    @property
    def unmatched_tokens(self) -> list[CacheToken]:
        return list(self.tokens[self.matched_token_count :])


def miss(tokens: Sequence[CacheToken]) -> MatchResult:
    """The result of a match that found nothing."""
    return tuple.__new__(MatchResult, (EMPTY_PAGES, 0, 0, None, tokens))


class InsertResult(NamedTuple):
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
    queued_entries: int = 0  # eviction-heap entries, stale ones included (bounded by compaction)


def start_of(node: TreeNode) -> tuple:
    """Where ``node`` starts: ``(namespace key, token keys of every node above it)``."""
    parts = []
    up = node.parent
    while up.parent is not None:
        parts.append(up.keys)
        up = up.parent
    return up.namespace.key, tuple(k for keys in reversed(parts) for k in keys)
