"""PagedKVCache: the K/V storage the page table indexes.

One (k, v) tensor pair per decoder layer, each ``[n_pages, n_kv_heads, head_dim]``: with
page_size 1 a page is one position, so a physical page index is directly a row of these
tensors (the "slot" that ``PageTable.build_slot_mapping`` returns). Page 0 is padding; it is
zero-filled so padded reads see finite values.

FP8 KV (opt-in, the kernel contract's "scaled KV" case): ``dtype=torch.float8_e4m3fn`` with
``kv_scales``, one ``KvScales`` (K and V scale) per layer, e.g. Moondream 3's
``kv_quantizer.{k_scale, v_scale}``; a page then takes half the bytes of a 16-bit one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kestrel_kernels.contract import KV_FP8_DTYPE, KvScales

__all__ = ["PagedKVCache"]


class PagedKVCache:
    """``k[layer]`` / ``v[layer]``: ``[n_pages, n_kv_heads, head_dim]`` tensors."""

    def __init__(
        self,
        n_pages: int,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_scales: Sequence[KvScales] | None = None,
    ) -> None:
        if (dtype == KV_FP8_DTYPE) != (kv_scales is not None):
            raise ValueError(
                "FP8 (float8_e4m3fn) KV pages need kv_scales, one KvScales per layer, and "
                f"scales go with FP8 pages only (dtype {dtype}, kv_scales "
                f"{'given' if kv_scales is not None else 'None'})"
            )
        if kv_scales is not None and len(kv_scales) != n_layers:
            raise ValueError(f"kv_scales has {len(kv_scales)} entries for {n_layers} layers")
        if n_pages < 2:
            raise ValueError(f"n_pages must be >= 2 (page 0 is padding), got {n_pages}")
        if min(n_layers, n_kv_heads, head_dim) < 1:
            raise ValueError(
                f"n_layers, n_kv_heads and head_dim must be >= 1, got "
                f"{n_layers}, {n_kv_heads}, {head_dim}"
            )
        self.n_pages = n_pages
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv_scales: tuple[KvScales, ...] | None = None
        if kv_scales is not None:
            self.kv_scales = tuple(
                KvScales(s.k.to(self.device, torch.float32), s.v.to(self.device, torch.float32))
                for s in kv_scales
            )
        shape = (n_pages, n_kv_heads, head_dim)
        self.k: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(n_layers)
        ]
        self.v: list[torch.Tensor] = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(n_layers)
        ]

    @property
    def bytes(self) -> int:
        """Total bytes held by all K and V tensors."""
        return self.n_pages * self.bytes_per_page(
            self.n_layers, self.n_kv_heads, self.head_dim, self.dtype
        )

    @staticmethod
    def bytes_per_page(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one position across all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * n_layers * n_kv_heads * head_dim * itemsize

    @staticmethod
    def pages_for_budget(
        budget_bytes: int, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """How many pages (padding page 0 included) fit in ``budget_bytes``."""
        per_page = PagedKVCache.bytes_per_page(n_layers, n_kv_heads, head_dim, dtype)
        return int(budget_bytes) // per_page

    @classmethod
    def from_memory_budget(
        cls,
        budget_bytes: int,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> PagedKVCache:
        """The largest cache that fits in ``budget_bytes``; raises if not even 2 pages fit."""
        n_pages = cls.pages_for_budget(budget_bytes, n_layers, n_kv_heads, head_dim, dtype)
        if n_pages < 2:
            per_page = cls.bytes_per_page(n_layers, n_kv_heads, head_dim, dtype)
            raise ValueError(
                f"a budget of {budget_bytes} bytes holds {n_pages} pages of {per_page} bytes; "
                "at least 2 are needed (page 0 is padding)"
            )
        return cls(n_pages, n_layers, n_kv_heads, head_dim, dtype=dtype, device=device)

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(n_pages={self.n_pages}, n_layers={self.n_layers}, "
            f"n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
            f"device={self.device}, bytes={self.bytes})"
        )
