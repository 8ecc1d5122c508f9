"""The host KV tier's device side: pinned host buffers and the copies between them and the
paged KV pool (``kestrel/prefix_cache/host_tier.py`` keeps the entries and their states).

CUDA only. On a CPU device the KV pool already is host memory: there is nothing to spill to,
and asking for the tier is refused with that reason. Copies are queued on the current stream
(the one the model runs on), so a spill reads the pages before anything later can overwrite
them, and a copy-in lands before the prefill that reads it; the events tell the tier when a
host buffer is free again.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kestrel.kv.storage import PagedKVCache
from kestrel.prefix_cache.host_tier import HostKVTier
from kestrel_kernels.transfer import upload

__all__ = ["PinnedKVMover", "host_kv_tier", "host_kv_unavailable_reason"]


def host_kv_unavailable_reason(device: torch.device | str) -> str | None:
    """Why the host KV tier cannot run on ``device`` (None: it can)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return (
            f"the host KV tier spills a CUDA device's KV pages to host memory; on a {dev.type} "
            "device the KV pool already lives in host memory, so there is nothing to spill "
            "(leave host_kv_gb unset, or 0)"
        )
    return None


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Pages as bytes for the 1-byte float types (index ops need not support them)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


class PinnedKVMover:
    """Copies pages' K and V (every layer) to new pinned host buffers and back."""

    def __init__(self, kv: PagedKVCache) -> None:
        self.kv = kv
        self.bytes_per_page = PagedKVCache.bytes_per_page(
            kv.n_layers, kv.n_kv_heads, kv.head_dim, kv.dtype
        )

    def _index(self, pages: np.ndarray) -> torch.Tensor:
        return upload(torch.from_numpy(np.array(pages, np.int64)), torch.int64, self.kv.device)

    def copy_out(self, pages: np.ndarray) -> tuple[torch.Tensor, Any]:
        kv, idx = self.kv, self._index(pages)
        shape = (2, kv.n_layers, len(pages), kv.n_kv_heads, kv.head_dim)
        raw = _raw(kv.k[0])
        buffer = torch.empty(shape, dtype=raw.dtype, pin_memory=True)
        for layer in range(kv.n_layers):
            for i, side in enumerate((kv.k, kv.v)):
                buffer[i, layer].copy_(_raw(side[layer]).index_select(0, idx), non_blocking=True)
        return buffer, self._record()

    def copy_in(self, buffer: torch.Tensor, pages: np.ndarray) -> Any:
        kv, idx = self.kv, self._index(pages)
        for layer in range(kv.n_layers):
            for i, side in enumerate((kv.k, kv.v)):
                src = buffer[i, layer].to(kv.device, non_blocking=True)
                _raw(side[layer]).index_copy_(0, idx, src)
        return self._record()

    def _record(self) -> Any:
        event = torch.cuda.Event()
        event.record()
        return event

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def wait(self, event: Any) -> None:
        event.synchronize()


def host_kv_tier(kv: PagedKVCache, budget: int) -> HostKVTier:
    """The tier for ``kv``'s pool under ``budget`` bytes of pinned host memory (CUDA)."""
    reason = host_kv_unavailable_reason(kv.device)
    if reason is not None:
        raise ValueError(reason)
    return HostKVTier(budget, PinnedKVMover(kv))
