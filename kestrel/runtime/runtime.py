"""MoondreamRuntime: prefix-cached prefill, batched decode and release.

The runtime owns the page pool, the paged K/V storage and the radix prefix cache, and runs the
model on them. It is driven by one thread (the scheduler's); nothing here is thread-safe.

Life of a sequence (design.md 3.4). The cache protocol itself is written once, in
:class:`~kestrel.prefix_cache.lease.CacheLease`; the runtime adds the model work between its
steps:

1. ``prepare_sequence`` (no model work): cache tokens ``[BOS, ImageToken(hash, image_tokens),
   text...]`` (or wherever the prompt places its images, one ``ImageToken`` each) in the
   namespace ``(adapter id, first image's hash, salt)``; the lease matches the longest cached
   prefix, maps ``skip = matched`` reused pages (a full-prompt hit: back one cache token) into a
   fresh row, locks them and reserves private pages for the suffix and the decode budget
   (evicting unlocked cache entries on demand). At least one prompt position is always
   computed, into a private page, so a full-prompt hit still yields logits and never writes a
   shared page;
2. ``prefill_sequence``: on a hit only the suffix, in one attention pass over cached + new KV
   (the vision encoder is skipped); on a miss the whole prompt, its image's embedding taken
   from the image-embedding tier when it is there (``embeddings.py``: no crops, no encoder),
   else from the vision encoder; then the logits of the last position;
3. ``commit_sequence``: the lease inserts the prompt into the tree immediately, so the next
   request already hits it, and moves the lock to the inserted node;
   ``cache_owned_page_count = skip + inserted_pages``.

``start_sequence`` is these three steps; a failure in any of them aborts the lease
(``abort_sequence``), which releases the temporary lock and every page taken.

4. ``decode_step`` feeds tokens, each writing its KV into the row's next private page, and
   records them (``state.fed``);
5. ``release_sequence``: with ``retain_decoded`` the lease first inserts the fed tokens under
   the prompt (up to the first off-grid coordinate or size), so the next turn of a
   conversation hits through this answer; then one unlock and the private pages are freed.
   The last sampled token was never fed, so its KV was never written and it is not kept.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from kestrel.crops.pool import CropPool
from kestrel.images import PreparedImage, image_hash_int
from kestrel.kv.page_table import PagedKVCache, PageTable
from kestrel.moondream.config import MoondreamConfig
from kestrel.moondream.lora import LoraAdapter
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.text import lm_head
from kestrel.moondream.tokenizer import MoondreamTokenizer
from kestrel.moondream.vision import encode_image
from kestrel.moondream.weights import resolve_checkpoint
from kestrel.prefix_cache.lease import CacheLease, LeasePhase
from kestrel.prefix_cache.namespace import CacheNamespace
from kestrel.prefix_cache.node import token_kv_length
from kestrel.prefix_cache.radix_cache import RadixPrefixCache
from kestrel.runtime.compiled import CompiledPrefill, check_compile
from kestrel.runtime.cuda_graphs import DecodeGraphs
from kestrel.runtime.cuda_memory import KvPoolReport, pool_pages
from kestrel.runtime.decode_steps import DecodeSteps
from kestrel.runtime.embeddings import EmbeddingBatch, embedding_tier
from kestrel.runtime.graph_set import GraphSet, choose_decode_kernels
from kestrel.runtime.host_kv import host_kv_tier
from kestrel.runtime.prefill import prefill_batch, prefill_item
from kestrel.runtime.prefill_graphs import PrefillGraphs
from kestrel.runtime.sequence import (
    PromptToken,
    RuntimeCounters,
    SequenceError,
    SequenceState,
    build_cache_tokens,
    cacheable_prefix,
    check_request,
    image_regions,
    images_to_encode,
    prepared_images,
    validate_image_regions,
)
from kestrel.runtime.vision_graphs import VisionGraphs
from kestrel_kernels import pinned
from kestrel_kernels.contract import KV_FP8_DTYPE, KvScales

__all__ = ["MoondreamRuntime", "RuntimeCounters", "SequenceError", "SequenceState"]


log = logging.getLogger("kestrel.runtime")


def _pins_host(device: torch.device) -> bool:
    """Whether the runtime stages host data in pinned memory (CUDA; tests stand in)."""
    return device.type == "cuda"


class MoondreamRuntime(DecodeSteps):
    """Cached prefill, batched decode and release over one KV pool (see the module doc).

    ``kv_cache_pages=None`` sizes the pool: on CUDA from the memory free after a warm-up,
    ``kv_memory_fraction`` of it (default 0.9; ``kv_report`` says what was found), elsewhere
    ``max_batch_size * max_context + 1``. ``cuda_graphs``: replay decode steps from CUDA graphs
    when the ``fa`` attention backend runs (see ``cuda_graphs``). ``retain_decoded``: keep
    a finished sequence's decoded tokens in the cache under its prompt (module doc, step 5).
    ``kv_scales``: one ``KvScales`` per layer stores K/V as FP8 pages (opt-in; the scaled-KV
    case runs the torch attention reference, so decode steps are not graph-captured).
    ``compile``: decode and prefill through ``torch.compile`` (``compiled.py``; opt-in).
    ``embedding_cache_bytes``: the image-embedding tier's budget (``embeddings.py``; None:
    sized from the KV pool, 0: off; on CUDA an auto-sized pool gives those bytes up).
    ``host_kv_bytes``: pinned host memory for KV pages the cache evicts (CUDA; 0: off).
    ``device_crops``: a new image's crops made on the model's device from the uploaded image
    (``crops/device.py``: libvips' bytes; None: on CUDA, if a start-up probe agrees). The
    decode steps (a known token, or a look-ahead id on the device) are in ``decode_steps.py``.
    """

    def __init__(
        self,
        model: MoondreamModel,
        tokenizer: MoondreamTokenizer | None = None,
        *,
        kv_cache_pages: int | None = None,
        max_batch_size: int = 16,
        enable_prefix_cache: bool = True,
        attention_backend: str = "auto",
        kv_memory_fraction: float | None = None,
        cuda_graphs: bool = True,
        retain_decoded: bool = True,
        kv_scales: Sequence[KvScales] | None = None,
        compile: bool = False,
        embedding_cache_bytes: int | None = None,
        host_kv_bytes: int = 0,
        device_crops: bool | None = None,
    ) -> None:
        self.model = model
        self.retain_decoded = retain_decoded
        self.config: MoondreamConfig = model.config
        self.tokenizer = tokenizer
        self.device = model.device
        self.dtype = model.dtype
        self.attention_backend = attention_backend
        self.enable_prefix_cache = enable_prefix_cache
        text = self.config.text
        kv_dt = self.dtype if kv_scales is None else KV_FP8_DTYPE
        self.kv_report: KvPoolReport | None
        kv_cache_pages, self.kv_report = pool_pages(
            model, kv_cache_pages, max_batch_size=max_batch_size, fraction=kv_memory_fraction,
            backend=attention_backend, kv_dtype=kv_dt,
        )  # fmt: skip
        if self.kv_report is not None:
            log.info("%s", self.kv_report)
        kv_cache_pages, self.embeddings = embedding_tier(  # embeddings.py
            model, kv_cache_pages, kv_dt, embedding_cache_bytes,
            prefix_cache=enable_prefix_cache, carve=self.kv_report is not None,
        )  # fmt: skip
        if self.kv_report is not None:  # the tier's bytes came out of the sized pool
            self.kv_report = self.kv_report.carve(kv_cache_pages)
        if kv_cache_pages < 2:
            raise ValueError(f"kv_cache_pages must be >= 2, got {kv_cache_pages}")
        self.page_table = PageTable(
            kv_cache_pages,
            page_size=1,
            max_batch_size=max_batch_size,
            device=self.device,
            max_seq_len=text.max_context,
        )
        self.kv = PagedKVCache(
            n_pages=kv_cache_pages,
            n_layers=text.n_layers,
            n_kv_heads=text.n_kv_heads,
            head_dim=text.head_dim,
            dtype=kv_dt,
            device=self.device,
            kv_scales=kv_scales,
        )
        self.prefix_cache = RadixPrefixCache(self.page_table)
        if host_kv_bytes:  # evicted KV kept in pinned host memory (CUDA; host_kv.py)
            self.prefix_cache.host = host_kv_tier(self.kv, host_kv_bytes)
        self.page_table.set_prefix_cache(self.prefix_cache)
        self.counters = RuntimeCounters()
        self._active: dict[int, SequenceState] = {}
        fp8_kv = kv_scales is not None
        compile = compile and not fp8_kv  # FP8 pages: eager (not compiled yet)
        self._start_up(kv_cache_pages, max_batch_size, cuda_graphs, compile, fp8_kv, device_crops)

    def _start_up(self, kv_cache_pages: int, max_batch_size: int, capture: bool, compile: bool,
                  fp8_kv: bool, device_crops: bool | None) -> None:  # fmt: skip
        """Before anything is served: the compiled forms, each decode bucket's attention kernel
        chosen and the graphs built (``graph_set.py``), the pinned ring for uploads and
        read-backs, every graph captured (decode, prefill, vision; never under traffic), then
        the crop pool (idle until the first request) with its pinned staging."""
        if compile:
            check_compile(self.device)
        self.compiled_prefill = CompiledPrefill() if compile else None
        options = dict(max_batch_size=max_batch_size, backend=self.attention_backend,
                       capture=capture, compile=compile)  # fmt: skip
        table = self.page_table.page_table
        self.decode_trials = choose_decode_kernels(self.model, self.kv, table, **options)
        graphs = GraphSet.build(self.model, self.kv, table, fp8_kv=fp8_kv, **options)
        self.decode_graphs: DecodeGraphs | None = graphs.decode
        self.prefill_graphs: PrefillGraphs | None = graphs.prefill
        self.vision_graphs: VisionGraphs | None = graphs.vision
        pins = _pins_host(self.device)
        if pins:
            pinned.reserve(self.device)
        graphs.capture_all()
        # Crops off this thread (crops/pool.py); an image encoded lately is likely still cached.
        cached = (kv_cache_pages - 1) // self.config.image_tokens if self.enable_prefix_cache else 0
        vision = self.config.vision
        self.crops = CropPool.for_runtime(vision, self.device, pins, cached, device_crops)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        revision: str | None = None,
        **kwargs,
    ) -> MoondreamRuntime:
        ckpt = resolve_checkpoint(name_or_path, revision)  # once: a hub id downloads here
        model = MoondreamModel.from_pretrained(ckpt, device=device, dtype=dtype)
        tokenizer = MoondreamTokenizer.for_checkpoint(ckpt)
        return cls(model, tokenizer, **kwargs)

    # ------------------------------------------------------------------ public API
    @property
    def active_sequences(self) -> list[SequenceState]:
        return list(self._active.values())

    def prepare_sequence(
        self,
        tokens: Sequence[PromptToken],
        image: object = None,
        *,
        adapter: LoraAdapter | None = None,
        max_new_tokens: int = 256,
        cache_salt: str | None = None,
    ) -> SequenceState:
        """Validate a request and take its resources (no model work): match, batch row, reused
        pages mapped and locked, private pages for the suffix and ``max_new_tokens``.

        Same arguments as ``start_sequence``. Follow with ``prefill_sequence`` and
        ``commit_sequence``, or ``abort_sequence`` on failure."""
        images = prepared_images(image)
        check_request(self.config, tokens, len(images), max_new_tokens)
        cfg = self.config
        hashes = [image_hash_int(im.digest) for im in images]
        # the namespace is keyed by the conversation's first image (or none)
        first = hashes[0] if hashes else None
        namespace = CacheNamespace(adapter.lora_id if adapter else None, first, cache_salt)
        cache_tokens = build_cache_tokens(tokens, hashes, cfg.image_tokens)
        regions = image_regions(cache_tokens)
        validate_image_regions(regions, cfg)
        cacheable = cache_tokens[
            : cacheable_prefix(cache_tokens, cfg.region.coord_bins, cfg.region.size_bins)
        ]
        prompt_len = token_kv_length(cache_tokens)
        lease = CacheLease.prepare(
            self.page_table,
            self.prefix_cache if self.enable_prefix_cache else None,
            cacheable,
            namespace,
            prompt_length=prompt_len,
            max_length=prompt_len + max_new_tokens,
            min_hit=regions[0][1] if regions and regions[0][0] == 0 else 0,  # BOS + image
        )
        return SequenceState(
            lease=lease,
            namespace=namespace,
            adapter=adapter,
            image_regions=regions,
            cache_tokens=cache_tokens,
            prompt=tuple(tokens),
            images=images,
            host_pages=lease.restored,
        )

    def prefill_sequence(self, state: SequenceState) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute a prepared sequence's prompt positions ``skip .. prompt_len - 1`` into its
        private pages; returns the last position's hidden state [C] and logits [V]."""
        hidden_BC, logits_BV = self.prefill_sequences([state])
        return hidden_BC[0], logits_BV[0]

    def prefill_sequences(
        self, states: Sequence[SequenceState]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``prefill_sequence`` for several prepared sequences in batched forwards (similar
        lengths share one; see ``prefill.py``): last hidden states [B, C] and logits [B, V]."""
        if len({id(s) for s in states}) != len(states):
            raise SequenceError("a sequence appears twice in one prefill")
        for s in states:
            if s.lease.phase is not LeasePhase.PREPARED or s.released:
                raise SequenceError(f"sequence in batch row {s.batch_idx} is not prepared")
        # cached embeddings pinned, the misses' crops all started at once
        found = self.embeddings.batch(images_to_encode(states))
        with found, self.crops.hold(found.to_encode):
            items = [prefill_item(s, self.model, self.dtype, self._encode_images(s, found))
                     for s in states]  # fmt: skip
        if self.prefill_graphs is not None:  # replayed where the items fit its buckets
            return self.prefill_graphs.run_all(items, self._prefill_eager)
        return self._prefill_eager(items)

    def _prefill_eager(self, items: list) -> tuple[torch.Tensor, torch.Tensor]:
        run = (
            prefill_batch if self.compiled_prefill is None else self.compiled_prefill.prefill_batch
        )
        hidden_BC = run(self.model, self.kv, self.page_table.page_table, items,
                        self.attention_backend)  # fmt: skip
        return hidden_BC, lm_head(hidden_BC, self.model.text)

    def commit_sequence(self, state: SequenceState, hidden_C: torch.Tensor) -> None:
        """Insert the prefilled prompt into the cache and move the lock to it; the sequence is
        then running (``decode_step`` may feed it). A failure aborts the sequence."""
        state.lease.commit()
        state.last_hidden = hidden_C
        state.length = state.prompt_length
        state.prompt, state.images = (), ()
        self._active[state.batch_idx] = state
        self.counters.add(state)

    def abort_sequence(self, state: SequenceState) -> None:
        """Give back everything a prepared (or failed) sequence holds; a no-op if it has."""
        state.lease.abort()
        state.released = True
        state.prompt, state.images = (), ()

    def start_sequence(
        self,
        tokens: Sequence[PromptToken],
        image: object = None,
        *,
        adapter: LoraAdapter | None = None,
        max_new_tokens: int = 256,
        cache_salt: str | None = None,
    ) -> tuple[SequenceState, torch.Tensor]:
        """Prefill a prompt (reusing its cached prefix) and return its state and last logits [V].

        ``tokens`` starts with ``TextToken(bos_id)``; one ``image`` is placed right after BOS,
        unless ``tokens`` places its images itself (an ``ImageToken`` per image, in the order of
        ``image``, then a tuple; a conversation's later turns). Images are
        :class:`~kestrel.images.PreparedImage` (pixels and their digest), or anything
        ``prepare_image`` takes. ``cache_salt`` puts the prompt
        in a namespace of its own (tenant isolation).
        Prepare, prefill and commit in one call.
        """
        state = self.prepare_sequence(
            tokens, image, adapter=adapter, max_new_tokens=max_new_tokens, cache_salt=cache_salt,
        )  # fmt: skip
        try:
            hidden_C, logits_V = self.prefill_sequence(state)
            self.commit_sequence(state, hidden_C)
        except BaseException:
            self.abort_sequence(state)
            raise
        return state, logits_V

    def release_sequence(self, state: SequenceState) -> None:
        """Retain the decoded tokens (``retain_decoded``), then exactly one unlock, then free
        the row's private pages; cache-owned pages stay cached."""
        if state.released or self._active.get(state.batch_idx) is not state:
            raise SequenceError(f"sequence in batch row {state.batch_idx} was already released")
        if state.ahead:  # a look-ahead step nobody will read
            self.settle_ahead(state, None, None)
        state.released = True
        del self._active[state.batch_idx]
        fed, state.fed = state.fed, []
        if not self.retain_decoded:
            fed = []
        cfg = self.config.region
        state.lease.release(fed[: cacheable_prefix(fed, cfg.coord_bins, cfg.size_bins)])
        self.counters.retained_tokens += state.lease.retained

    def check_integrity(self) -> None:
        """Cache + page-table invariants, plus one lock per running sequence."""
        self.prefix_cache.check_integrity()
        self.embeddings.check_integrity()
        if self.prefix_cache.host is not None:
            self.prefix_cache.host.check_integrity()
        for s in self._active.values():
            s.check_running(self.page_table.capacity(s.batch_idx), self.enable_prefix_cache)

    # ------------------------------------------------------------------ internals
    def _encode_images(
        self, state: SequenceState, found: EmbeddingBatch
    ) -> list[torch.Tensor | None]:
        """Each of the sequence's images' embedding if its prefill computes it (the embedding
        tier's, else the vision encoder's); None for an image whose KV is cached."""
        return found.for_sequence(state, state.images_computed(), self.encode_image)

    def encode_image(self, image: PreparedImage) -> torch.Tensor:
        """Vision encoder: the prepared pixels' crops (made off this thread) -> [image_tokens,
        dim] (public for a caller counting the encoder alone: scripts/kernel_counts.py)."""
        self.counters.encoder_runs += 1
        crops, graphs = self.crops.pixels(image), self.vision_graphs
        pixels = crops.encoder_input(self.dtype, self.device, graphs and graphs.input_buffer)
        if graphs is not None:
            return graphs.encode(pixels, crops.tiling)
        return encode_image(pixels, crops.tiling, self.model.vision, self.config.vision)
