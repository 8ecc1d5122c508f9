"""A runtime built in one place: its options, then everything it runs on, made and started.

``MoondreamRuntime`` takes one :class:`RuntimeOptions` (or its fields as keywords) and asks
:func:`build_parts` for its :class:`RuntimeParts`, in this order: the KV pool sized
(``cuda_memory.py``) and the image-embedding tier's bytes carved out of it (``embeddings.py``),
the page table, the paged K/V, the radix prefix cache and its host KV tier (``host_kv.py``);
then the start-up, before anything is served: the compiled prefill (``compiled.py``), each
decode bucket's attention kernel measured and the graphs built (``graph_set.py``), the pinned
ring for uploads and read-backs reserved, every graph captured (decode, prefill, vision; never
under traffic), and the crop pool (idle until the first request) with its pinned staging.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kestrel.crops.pool import CropPool
from kestrel.kv.page_table import PagedKVCache, PageTable
from kestrel.moondream.model import MoondreamModel
from kestrel.prefix_cache.radix_cache import RadixPrefixCache
from kestrel.runtime.compiled import CompiledPrefill, check_compile
from kestrel.runtime.cuda_memory import KvPoolReport, pool_pages
from kestrel.runtime.embeddings import ImageEmbeddings, embedding_tier
from kestrel.runtime.graph_set import GraphSet, choose_decode_kernels
from kestrel.runtime.host_kv import host_kv_tier
from kestrel_kernels import pinned
from kestrel_kernels.backends import AttentionBackend
from kestrel_kernels.contract import KV_FP8_DTYPE, KvScales
from kestrel_kernels.decode_tune import DecodeTrial

__all__ = ["RuntimeOptions", "RuntimeParts", "build_parts"]

log = logging.getLogger("kestrel.runtime")


@dataclass(frozen=True, slots=True)
class RuntimeOptions:
    """How a ``MoondreamRuntime`` is built (``MoondreamRuntime(model, tokenizer, **fields)``).

    ``attention_backend``: a name (``kestrel_kernels.resolve_backend``: "auto", "torch",
    "fa") or a backend object, taken as it is (a stand-in). ``kv_cache_pages=None`` sizes
    the pool: on CUDA from the memory free after a warm-up,
    ``kv_memory_fraction`` of it (default 0.9; ``kv_report`` says what was found), elsewhere
    ``max_batch_size * max_context + 1``. ``cuda_graphs``: replay decode steps from CUDA graphs
    when the ``fa`` attention backend runs (see ``cuda_graphs``). ``retain_decoded``: keep
    a finished sequence's decoded tokens in the cache under its prompt (``runtime.py``, step 5).
    ``kv_scales``: one ``KvScales`` per layer stores K/V as FP8 pages (opt-in; the scaled-KV
    case runs the torch attention reference, so decode steps are not graph-captured).
    ``compile``: decode and prefill through ``torch.compile`` (``compiled.py``; opt-in; FP8
    pages stay eager). ``embedding_cache_bytes``: the image-embedding tier's budget
    (``embeddings.py``; None: sized from the KV pool, 0: off; on CUDA an auto-sized pool gives
    those bytes up). ``host_kv_bytes``: pinned host memory for KV pages the cache evicts (CUDA;
    0: off). ``device_crops``: a new image's crops made on the model's device from the uploaded
    image (``crops/device.py``: libvips' bytes; None: on CUDA, if a start-up probe agrees).
    """

    kv_cache_pages: int | None = None
    max_batch_size: int = 16
    enable_prefix_cache: bool = True
    attention_backend: str | AttentionBackend = "auto"
    kv_memory_fraction: float | None = None
    cuda_graphs: bool = True
    retain_decoded: bool = True
    kv_scales: Sequence[KvScales] | None = None
    compile: bool = False
    embedding_cache_bytes: int | None = None
    host_kv_bytes: int = 0
    device_crops: bool | None = None

    @classmethod
    def of(cls, options: RuntimeOptions | None = None, **overrides: Any) -> RuntimeOptions:
        """``options`` (None: the defaults) with ``overrides`` in place of its fields; an
        unknown name is a ``TypeError``."""
        base = cls() if options is None else options
        return dataclasses.replace(base, **overrides) if overrides else base


@dataclass(frozen=True, slots=True)
class RuntimeParts:
    """Everything a runtime runs on, built and started (module doc)."""

    page_table: PageTable
    kv: PagedKVCache
    prefix_cache: RadixPrefixCache
    embeddings: ImageEmbeddings
    kv_report: KvPoolReport | None  # how an auto-sized pool was sized (None: pages given)
    compiled_prefill: CompiledPrefill | None
    decode_trials: list[DecodeTrial]  # each decode bucket's attention kernel, as measured
    backend: AttentionBackend  # the attention backend served on (the measured decode route)
    graphs: GraphSet
    crops: CropPool


def _pins_host(device: torch.device) -> bool:
    """Whether the runtime stages host data in pinned memory (CUDA; tests stand in)."""
    return device.type == "cuda"


def _kv_dtype(model: MoondreamModel, o: RuntimeOptions) -> torch.dtype:
    return model.dtype if o.kv_scales is None else KV_FP8_DTYPE


def _kv_pool(
    model: MoondreamModel, o: RuntimeOptions, backend: AttentionBackend
) -> tuple[PageTable, PagedKVCache, ImageEmbeddings, KvPoolReport | None]:
    """The KV pool sized, the embedding tier carved out of it, the page table and pages."""
    kv_dt, text = _kv_dtype(model, o), model.config.text
    pages, report = pool_pages(
        model, o.kv_cache_pages, max_batch_size=o.max_batch_size,
        fraction=o.kv_memory_fraction, backend=backend, kv_dtype=kv_dt,
    )  # fmt: skip
    if report is not None:
        log.info("%s", report)
    pages, embeddings = embedding_tier(
        model, pages, kv_dt, o.embedding_cache_bytes,
        prefix_cache=o.enable_prefix_cache, carve=report is not None,
    )  # fmt: skip
    if report is not None:  # the tier's bytes came out of the sized pool
        report = report.carve(pages)
    if pages < 2:
        raise ValueError(f"kv_cache_pages must be >= 2, got {pages}")
    page_table = PageTable(pages, page_size=1, max_batch_size=o.max_batch_size,
                           device=model.device, max_seq_len=text.max_context)  # fmt: skip
    kv = PagedKVCache(n_pages=pages, n_layers=text.n_layers, n_kv_heads=text.n_kv_heads,
                      head_dim=text.head_dim, dtype=kv_dt, device=model.device,
                      kv_scales=o.kv_scales)  # fmt: skip
    return page_table, kv, embeddings, report


def build_parts(
    model: MoondreamModel, o: RuntimeOptions, backend: AttentionBackend
) -> RuntimeParts:
    """The pool, tiers and cache (``_kv_pool``), then the start-up (module doc), on
    ``backend``: the attention backend the runtime resolved (``RuntimeParts.backend``: the
    one to serve on, with the decode route measured at start-up)."""
    page_table, kv, embeddings, report = _kv_pool(model, o, backend)
    prefix_cache = RadixPrefixCache(page_table)
    if o.host_kv_bytes:  # evicted KV kept in pinned host memory (CUDA; host_kv.py)
        prefix_cache.host = host_kv_tier(kv, o.host_kv_bytes)
    page_table.set_prefix_cache(prefix_cache)
    fp8_kv = o.kv_scales is not None
    compile = o.compile and not fp8_kv  # FP8 pages: eager (not compiled yet)
    if compile:
        check_compile(model.device)
    compiled = CompiledPrefill() if compile else None
    options = dict(max_batch_size=o.max_batch_size, capture=o.cuda_graphs, compile=compile)
    table = page_table.page_table
    trials, backend = choose_decode_kernels(model, kv, table, backend=backend, **options)
    graphs = GraphSet.build(model, kv, table, fp8_kv=fp8_kv, backend=backend, **options)
    pins = _pins_host(model.device)
    if pins:
        pinned.reserve(model.device)
    graphs.capture_all()
    # Crops off the scheduler thread (crops/pool.py); an image encoded lately is likely cached.
    cached = (page_table.n_pages - 1) // model.config.image_tokens if o.enable_prefix_cache else 0
    crops = CropPool.for_runtime(model.config.vision, model.device, pins, cached, o.device_crops)
    return RuntimeParts(page_table, kv, prefix_cache, embeddings, report, compiled, trials,
                        backend, graphs, crops)  # fmt: skip
