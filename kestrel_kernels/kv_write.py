"""What a fused K/V write is given (``fused.rope_write_kv`` and its Triton form): the heads of
a fused qkv projection and the pages its keys and values go to."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kestrel_kernels.contract import KvScales

__all__ = ["HeadLayout", "KvWrite"]


@dataclass(frozen=True, slots=True)
class HeadLayout:
    """A fused qkv projection's heads: ``n_heads`` query heads, ``n_kv_heads`` key / value
    heads, ``head_dim`` each."""

    n_heads: int
    n_kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True, eq=False)
class KvWrite:
    """Where new keys and values go: one layer's pages ``k_cache`` / ``v_cache``
    ``[n_pages, Hkv, D]``, the page of each position ``slots`` (int64 ``[N]``, < 0 = none) and,
    for FP8 pages, their ``kv_scales``."""

    k_cache: Tensor
    v_cache: Tensor
    slots: Tensor
    kv_scales: KvScales | None = None
