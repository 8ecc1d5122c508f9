"""Size the KV page pool from the memory a CUDA device has free after a warm-up.

Measure instead of guess: with the weights loaded, a warm-up runs the worst single request the
model can see (the vision encoder on the most crops, then a prefill of ``max_context`` positions
with the BOS + image block bidirectional) on a scratch KV cache, and records how much memory
that needed above what was allocated before it. The pool then gets

    kv_bytes = fraction * free_after_warmup - warmup_peak

where ``free_after_warmup`` is what the driver reports free plus what PyTorch's allocator holds
unused. ``fraction`` (default 0.9) is the user's knob; the rest stays for CUDA graphs, sampling
buffers and other processes. The warm-up also compiles the attention kernels, so the first real
request does not pay for it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kestrel.kv.storage import PagedKVCache
from kestrel.moondream.forward_inputs import ForwardInputs
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.text import text_forward
from kestrel.moondream.vision import encode_image
from kestrel_kernels.backends import AttentionBackend
from kestrel_kernels.batch import AttentionBatch

__all__ = [
    "DEFAULT_KV_MEMORY_FRACTION",
    "MAX_POOL_PAGES",
    "KvPoolReport",
    "pool_pages",
    "size_kv_pool",
]

DEFAULT_KV_MEMORY_FRACTION = 0.9
# Host bookkeeping is per page (free list, page states); past a million pages a small model
# would spend seconds and gigabytes of host memory on a pool no workload fills.
MAX_POOL_PAGES = 1 << 20

_GIB = float(1 << 30)


@dataclass(frozen=True, slots=True)
class KvPoolReport:
    """How the KV pool was sized (``MoondreamRuntime.kv_report``)."""

    pages: int  # including the reserved padding page 0
    bytes_per_page: int  # K and V of one position, all layers
    free_bytes: int  # free after the warm-up (driver free + allocator cache)
    warmup_peak_bytes: int  # extra memory the warm-up needed at its peak
    fraction: float
    capped: bool  # limited by MAX_POOL_PAGES rather than by memory
    carved_pages: int = 0  # given up to the image-embedding tier (runtime/embeddings.py)

    @property
    def kv_bytes(self) -> int:
        return self.pages * self.bytes_per_page

    def carve(self, pages: int) -> KvPoolReport:
        """This report once the pool has given up all but ``pages`` pages (to the tier)."""
        return replace(self, pages=pages, carved_pages=self.carved_pages + self.pages - pages)

    def __str__(self) -> str:
        limit = f"capped at {MAX_POOL_PAGES} pages" if self.capped else "memory-bound"
        return (
            f"KV pool: {self.pages:,} pages x {self.bytes_per_page / 1024:.0f} KiB = "
            f"{self.kv_bytes / _GIB:.2f} GiB ({limit}; fraction {self.fraction:.2f} of "
            f"{self.free_bytes / _GIB:.2f} GiB free after warm-up, minus a "
            f"{self.warmup_peak_bytes / _GIB:.2f} GiB warm-up peak"
            + (f"; {self.carved_pages * self.bytes_per_page / _GIB:.2f} GiB of it to the "
               "image-embedding tier)" if self.carved_pages else ")")
        )  # fmt: skip


def _warmup(model: MoondreamModel, backend: AttentionBackend | None) -> None:
    """The largest single request: vision on the most crops, a ``max_context`` prefill."""
    cfg, dev, dt = model.config, model.device, model.dtype
    text = cfg.text
    crops = max(1, cfg.vision.max_crops)
    pixels = torch.zeros(1 + crops, cfg.vision.in_channels, cfg.vision.crop_size,
                         cfg.vision.crop_size, dtype=dt, device=dev)  # fmt: skip
    encode_image(pixels, (1, crops), model.vision, cfg.vision)
    n = text.max_context
    scratch = PagedKVCache(n + 1, text.n_layers, text.n_kv_heads, text.head_dim, dt, dev)
    pages_1P = torch.arange(1, n + 1, dtype=torch.int32, device=dev)[None]
    attention = AttentionBatch(
        positions_BT=torch.arange(n, device=dev)[None],
        slot_mapping=pages_1P[0].to(torch.int64),
        page_table=pages_1P,
        seqused_k=torch.tensor([n], dtype=torch.int32, device=dev),
        bidir_regions=torch.tensor([[0, cfg.prefix_len]], dtype=torch.int32, device=dev),
        backend=backend,
    )
    x_1NC = torch.zeros(1, n, text.dim, dtype=dt, device=dev)
    text_forward(x_1NC, model.text, text, ForwardInputs(attention), scratch)


def size_kv_pool(
    model: MoondreamModel,
    *,
    fraction: float = DEFAULT_KV_MEMORY_FRACTION,
    backend: AttentionBackend | None = None,
    max_pages: int = MAX_POOL_PAGES,
    kv_dtype: torch.dtype | None = None,
) -> KvPoolReport:
    """Run the warm-up on ``model``'s CUDA device and size the pool; see the module doc.
    ``kv_dtype``: the pages' dtype (default the model's; FP8 pages hold twice the positions
    of 16-bit ones in the same bytes)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"kv_memory_fraction must be in (0, 1], got {fraction}")
    dev = model.device
    if dev.type != "cuda":
        raise ValueError(f"KV sizing from free memory needs a CUDA model, got {dev}")
    text = model.config.text
    per_page = PagedKVCache.bytes_per_page(text.n_layers, text.n_kv_heads, text.head_dim,
                                           kv_dtype or model.dtype)  # fmt: skip
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with torch.inference_mode():
        _warmup(model, backend)
    torch.cuda.synchronize(dev)
    peak = max(0, torch.cuda.max_memory_allocated(dev) - before)
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(dev)
    free += torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    budget = int(fraction * free) - peak
    pages = budget // per_page
    if pages < 2:
        raise RuntimeError(
            f"no room for a KV pool on {dev}: {free / _GIB:.2f} GiB free after warm-up, "
            f"fraction {fraction}, warm-up peak {peak / _GIB:.2f} GiB; pass kv_cache_pages "
            "or raise kv_memory_fraction"
        )
    capped = pages > max_pages
    return KvPoolReport(min(pages, max_pages), per_page, free, peak, fraction, capped)


def pool_pages(
    model: MoondreamModel,
    pages: int | None,
    *,
    max_batch_size: int,
    fraction: float | None,
    backend: AttentionBackend | None,
    kv_dtype: torch.dtype,
) -> tuple[int, KvPoolReport | None]:
    """The KV pool's page count and, where it was sized from free memory, how: ``pages`` when
    given; on CUDA ``size_kv_pool``; elsewhere a full context for every batch row plus the
    reserved page 0."""
    if pages is not None:
        return pages, None
    if model.device.type == "cuda":
        report = size_kv_pool(
            model, fraction=fraction or DEFAULT_KV_MEMORY_FRACTION, backend=backend,
            kv_dtype=kv_dtype,
        )  # fmt: skip
        return report.pages, report
    return max_batch_size * model.config.text.max_context + 1, None
