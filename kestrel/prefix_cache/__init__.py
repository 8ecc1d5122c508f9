"""Namespaced radix prefix cache: shares the KV pages of common prompt prefixes.

The contract (page ownership, locks, the runtime protocol) is stated once in ``base.py``; the
protocol itself is implemented once, by ``CacheLease`` (``lease.py``).
``docs/prefix_cache.md`` explains it with diagrams.

Modules, bottom up (each imports only those above it): ``tokens``, ``namespace``, ``node``
(tree node and result types), ``base`` (contract, errors), ``eviction``, ``integrity``,
``radix_cache`` (the tree), ``lease`` (the per-request protocol).
"""

from __future__ import annotations

from kestrel.tokens import (
    CacheToken,
    CoordToken,
    ImageToken,
    SizeToken,
    TextToken,
    cache_keys,
    kv_length,
)

from .base import BasePrefixCache, CacheIntegrityError, CacheLockError, InsertError
from .eviction import LRUEvictionPolicy
from .lease import CacheLease, LeaseError, LeasePhase
from .namespace import CacheNamespace
from .node import CacheStats, InsertResult, MatchResult, TreeNode
from .radix_cache import RadixPrefixCache

__all__ = [
    "BasePrefixCache",
    "CacheIntegrityError",
    "CacheLease",
    "CacheLockError",
    "CacheNamespace",
    "CacheStats",
    "CacheToken",
    "CoordToken",
    "ImageToken",
    "InsertError",
    "InsertResult",
    "LRUEvictionPolicy",
    "LeaseError",
    "LeasePhase",
    "MatchResult",
    "RadixPrefixCache",
    "SizeToken",
    "TextToken",
    "TreeNode",
    "cache_keys",
    "kv_length",
]
