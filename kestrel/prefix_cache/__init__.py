"""Namespaced radix prefix cache: shares the KV pages of common prompt prefixes.

The contract (page ownership, locks, the runtime protocol) is stated once in ``base.py``;
``docs/prefix_cache.md`` explains it with diagrams.
"""

from __future__ import annotations

from .base import BasePrefixCache, CacheIntegrityError, CacheLockError, InsertError
from .eviction import LRUEvictionPolicy
from .namespace import CacheNamespace
from .radix_cache import CacheStats, InsertResult, MatchResult, RadixPrefixCache, TreeNode
from .tokens import (
    CacheToken,
    CoordToken,
    ImageToken,
    SizeToken,
    TextToken,
    cache_keys,
    kv_length,
)

__all__ = [
    "BasePrefixCache",
    "CacheIntegrityError",
    "CacheLockError",
    "CacheNamespace",
    "CacheStats",
    "CacheToken",
    "CoordToken",
    "ImageToken",
    "InsertError",
    "InsertResult",
    "LRUEvictionPolicy",
    "MatchResult",
    "RadixPrefixCache",
    "SizeToken",
    "TextToken",
    "TreeNode",
    "cache_keys",
    "kv_length",
]
