"""The second cache tier: image embeddings kept past their KV (``cache.py``), and the budget
checks shared by the tiers (``budget.py``). Pure Python over tensors."""

from __future__ import annotations

from kestrel.embedding_cache.budget import GIB, MIB, BudgetError, budget_bytes, host_memory_bytes
from kestrel.embedding_cache.cache import (
    EmbeddingCache,
    EmbeddingIntegrityError,
    EmbeddingKey,
    EmbeddingLease,
    EmbeddingStats,
)

__all__ = [
    "GIB",
    "MIB",
    "BudgetError",
    "EmbeddingCache",
    "EmbeddingIntegrityError",
    "EmbeddingKey",
    "EmbeddingLease",
    "EmbeddingStats",
    "budget_bytes",
    "host_memory_bytes",
]
