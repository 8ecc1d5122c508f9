"""MoondreamRuntime: prefix-cached prefill, batched decode and release.

The runtime owns the page pool, the paged K/V storage and the radix prefix cache, and runs the
model on them. It is driven by one thread (the scheduler's); nothing here is thread-safe.

Life of a sequence (design.md 3.4, the seed's ``start_sequence`` walk-through):

1. cache tokens ``[BOS, ImageToken(hash, image_tokens), text...]`` in the namespace
   ``(adapter id, image hash)``; match the longest cached prefix;
2. ``skip = min(matched, prompt_len - 1)``: at least one prompt position is always computed, into
   a private page, so a full-prompt hit still yields logits and never writes a shared page;
3. map only the reused pages, lock them for the prefill, allocate the suffix + decode pages
   (evicting unlocked cache entries on demand);
4. prefill: on a hit only the suffix, in one attention pass over cached + new KV (the vision
   encoder is skipped); on a miss the vision encoder and the whole prompt;
5. insert the prompt into the tree immediately, so the next request already hits it, and move
   the lock to the inserted node (keeping it when insert returns the locked node itself);
   ``cache_owned_page_count = skip + inserted_pages``.

Any failure after the match releases the temporary lock and every page taken.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kestrel.kv_cache import PagedKVCache, PageTable
from kestrel.moondream.config import MoondreamConfig
from kestrel.moondream.cuda_graphs import DecodeGraphs, graphs_supported
from kestrel.moondream.cuda_memory import DEFAULT_KV_MEMORY_FRACTION, KvPoolReport, size_kv_pool
from kestrel.moondream.decode import decode_eager
from kestrel.moondream.image_crops import normalize_pixels, overlap_crops
from kestrel.moondream.image_input import image_hash_int, load_image
from kestrel.moondream.lora import LoraAdapter
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.region import embed_tokens
from kestrel.moondream.sequence import (
    PromptToken,
    SequenceError,
    SequenceState,
    build_cache_tokens,
    cacheable_prefix,
    check_request,
    validate_image_regions,
)
from kestrel.moondream.text import lm_head, text_forward
from kestrel.moondream.tokenizer import MoondreamTokenizer
from kestrel.moondream.vision import encode_image
from kestrel.moondream.weights import resolve_checkpoint
from kestrel.prefix_cache.namespace import CacheNamespace
from kestrel.prefix_cache.radix_cache import MatchResult, RadixPrefixCache
from kestrel.prefix_cache.tokens import kv_length

__all__ = ["MoondreamRuntime", "RuntimeCounters", "SequenceError", "SequenceState"]

log = logging.getLogger("kestrel.runtime")


@dataclass(slots=True)
class RuntimeCounters:
    """Cumulative figures, for metrics and benchmarks."""

    sequences: int = 0
    prompt_tokens: int = 0  # KV positions of all prompts
    cached_tokens: int = 0  # of which reused from the cache
    prefill_tokens: int = 0  # of which computed
    vision_encodes: int = 0
    cache_hits: int = 0  # sequences that reused at least one page

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class MoondreamRuntime:
    """Cached prefill, batched decode and release over one KV pool (see the module doc).

    ``kv_cache_pages=None`` sizes the pool: on CUDA from the memory free after a warm-up,
    ``kv_memory_fraction`` of it (default 0.9; ``kv_report`` says what was found), elsewhere
    ``max_batch_size * max_context + 1``. ``cuda_graphs``: replay decode steps from CUDA graphs
    when the ``fa`` attention backend runs (see ``cuda_graphs``).
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
    ) -> None:
        self.model = model
        self.config: MoondreamConfig = model.config
        self.tokenizer = tokenizer
        self.device = model.device
        self.dtype = model.dtype
        self.attention_backend = attention_backend
        self.enable_prefix_cache = enable_prefix_cache
        text = self.config.text
        self.kv_report: KvPoolReport | None = None
        if kv_cache_pages is None and self.device.type == "cuda":
            fraction = kv_memory_fraction or DEFAULT_KV_MEMORY_FRACTION
            self.kv_report = size_kv_pool(model, fraction=fraction, backend=attention_backend)
            log.info("%s", self.kv_report)
            kv_cache_pages = self.kv_report.pages
        elif kv_cache_pages is None:
            # Enough for every slot to hold a full context, plus the reserved page 0.
            kv_cache_pages = max_batch_size * text.max_context + 1
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
            dtype=self.dtype,
            device=self.device,
        )
        self.prefix_cache = RadixPrefixCache(self.page_table)
        self.page_table.set_prefix_cache(self.prefix_cache)
        self.counters = RuntimeCounters()
        self._active: dict[int, SequenceState] = {}
        self.decode_graphs: DecodeGraphs | None = None
        if graphs_supported(model, attention_backend):
            self.decode_graphs = DecodeGraphs(
                model, self.kv, self.page_table.page_table, max_batch_size=max_batch_size,
                backend=attention_backend, capture=cuda_graphs,
            )  # fmt: skip

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

    def start_sequence(
        self,
        tokens: Sequence[PromptToken],
        image=None,
        *,
        image_hash: bytes | None = None,
        adapter: LoraAdapter | None = None,
        max_new_tokens: int = 256,
        cache_salt: str | None = None,
    ) -> tuple[SequenceState, torch.Tensor]:
        """Prefill a prompt (reusing its cached prefix) and return its state and last logits [V].

        ``tokens`` starts with ``TextToken(bos_id)``; for an image prompt the image's KV block is
        placed right after BOS. ``image_hash`` is the image's SHA-256 digest (computed when
        omitted). ``cache_salt`` puts the prompt in a namespace of its own (tenant isolation).
        """
        image_hash = check_request(self.config, tokens, image, image_hash, max_new_tokens)
        cfg = self.config
        image_kv = cfg.image_tokens if image is not None else 0
        hash_int = image_hash_int(image_hash) if image_hash is not None else None
        namespace = CacheNamespace(adapter.lora_id if adapter else None, hash_int, cache_salt)
        cache_tokens = build_cache_tokens(tokens, hash_int, image_kv)
        cacheable = cache_tokens[
            : cacheable_prefix(cache_tokens, cfg.region.coord_bins, cfg.region.size_bins)
        ]
        if self.enable_prefix_cache:
            match = self.prefix_cache.match_prefix(cacheable, namespace)
        else:
            match = MatchResult([], 0, 0, None, list(cacheable))
        prompt_len = len(tokens) + image_kv
        state = SequenceState(
            batch_idx=self.page_table.allocate(),
            length=0,
            max_length=prompt_len + max_new_tokens,
            prompt_length=prompt_len,
            namespace=namespace,
            adapter=adapter,
            image_regions=[(1, 1 + image_kv)] if image is not None else [],
            cache_tokens=cache_tokens,
        )
        try:
            validate_image_regions(state.image_regions, cfg)
            skip = self._map_reused(state, match, image is not None)
            self._map_private(state, skip)
            hidden_C = self._prefill(state, tokens, image, skip)
            logits_V = lm_head(hidden_C[None], self.model.text)[0]
            if self.enable_prefix_cache and match.matched_kv_length < prompt_len:
                self._insert_prompt(state, cacheable, match, skip)
            # else: a full-prompt hit keeps its lock on the matched node; nothing to insert
        except BaseException:
            self.prefix_cache.unlock(state.cache_lock_node)
            state.cache_lock_node = None
            self.page_table.erase(state.batch_idx, state.cache_owned_page_count)
            raise
        state.last_hidden = hidden_C
        state.length = prompt_len
        self._active[state.batch_idx] = state
        self._count(state)
        return state, logits_V

    def decode_step(
        self, states: Sequence[SequenceState], tokens: Sequence[PromptToken]
    ) -> torch.Tensor:
        """Feed one token per sequence in one batched forward; returns logits [B, V].

        Each new K/V goes to that sequence's private page at its current length. Coordinate and
        size tokens are embedded through the region encoders.
        """
        if len(states) != len(tokens) or not states:
            raise SequenceError(
                f"decode_step needs one token per sequence, got {len(states)} states and "
                f"{len(tokens)} tokens"
            )
        for s, t in zip(states, tokens, strict=True):
            if s.released or self._active.get(s.batch_idx) is not s:
                raise SequenceError(f"sequence in batch row {s.batch_idx} is not running")
            if s.length >= s.max_length:
                raise SequenceError(
                    f"sequence in batch row {s.batch_idx} has used all "
                    f"{s.max_length - s.prompt_length} new-token pages (max_new_tokens reached)"
                )
            if not isinstance(t, PromptToken):
                raise SequenceError(f"decode_step tokens must be cache tokens, got {t!r}")
        if len({s.batch_idx for s in states}) != len(states):
            raise SequenceError("a sequence appears twice in one decode_step")
        adapters = [s.adapter for s in states]
        if self.decode_graphs is not None and all(a is None for a in adapters):
            hidden_BC, logits_BV = self.decode_graphs.run(
                [s.batch_idx for s in states], [s.length for s in states], tokens
            )
        else:
            x_BC = embed_tokens(list(tokens), self.model)
            hidden_BC = decode_eager(
                self.model, self.kv, self.page_table.page_table, x_BC,
                [s.batch_idx for s in states], [s.length for s in states],
                adapters, self.attention_backend,
            )  # fmt: skip
            logits_BV = lm_head(hidden_BC, self.model.text)
        for i, s in enumerate(states):
            s.length += 1
            s.last_hidden = hidden_BC[i]
        return logits_BV

    def release_sequence(self, state: SequenceState) -> None:
        """Exactly one unlock, then free the row's private pages; cache-owned pages stay cached."""
        if state.released or self._active.get(state.batch_idx) is not state:
            raise SequenceError(f"sequence in batch row {state.batch_idx} was already released")
        state.released = True
        del self._active[state.batch_idx]
        self.prefix_cache.unlock(state.cache_lock_node)
        state.cache_lock_node = None
        self.page_table.erase(state.batch_idx, state.cache_owned_page_count)

    def check_integrity(self) -> None:
        """Cache + page-table invariants, plus one lock per running sequence."""
        self.prefix_cache.check_integrity()
        for s in self._active.values():
            node = s.cache_lock_node
            if self.enable_prefix_cache and node is None:
                raise AssertionError(f"running sequence {s.batch_idx} holds no cache lock")
            if node is not None and node.lock_ref < 1:
                raise AssertionError(f"sequence {s.batch_idx} locks a node with lock_ref 0")
            pages = self.page_table.page_table_cpu[s.batch_idx]
            if len(pages) != s.max_length:
                raise AssertionError(f"row {s.batch_idx} maps {len(pages)} != {s.max_length}")

    # ------------------------------------------------------------------ internals
    def _map_reused(self, state: SequenceState, match: MatchResult, has_image: bool) -> int:
        """Map the reused cached pages into the row and lock them; returns ``skip``.

        ``skip = min(matched, prompt_len - 1)``: a full-prompt hit still computes its last
        position, into a private page. The lock is recorded on the state only once held.
        """
        if match.matched_kv_length == 0:
            return 0
        skip = min(match.matched_kv_length, state.prompt_length - 1)
        prefix_len = self.config.prefix_len
        if has_image and skip < prefix_len:
            raise RuntimeError(
                f"prefix-cache invariant violated: a hit in an image namespace covers "
                f"{match.matched_kv_length} positions, less than BOS + image ({prefix_len})"
            )
        self.page_table.map_pages(state.batch_idx, 0, match.matched_pages[:skip])
        # The mapped pages are the cache's: erase() must never free them.
        state.cache_owned_page_count = state.reused_page_count = skip
        self.prefix_cache.lock(match.last_node)
        state.cache_lock_node = match.last_node
        return skip

    def _map_private(self, state: SequenceState, skip: int) -> None:
        """Fresh private pages for the suffix and the decode budget (evicting on demand)."""
        new_pages = self.page_table.allocate_pages(state.max_length - skip)
        try:
            self.page_table.map_pages(state.batch_idx, skip, new_pages)
        except BaseException:
            self.page_table.free_pages_to_pool(new_pages)  # not in the row: erase misses them
            raise

    def _insert_prompt(
        self, state: SequenceState, cacheable: list, match: MatchResult, skip: int
    ) -> None:
        """Insert the prompt's cacheable prefix and move the one lock to the inserted node.

        When insert returns the node already locked (identity case) the lock stays as it is.
        ``cache_owned_page_count = skip + inserted_pages``: a duplicate's pages stay private.
        """
        result = self.prefix_cache.insert(
            cacheable,
            self.page_table.get_pages(state.batch_idx, 0, kv_length(cacheable)),
            state.namespace,
            from_node=match.last_node,
            from_token_idx=match.matched_token_count,
            from_page_idx=skip,
        )
        state.cache_owned_page_count = skip + result.inserted_pages
        held = state.cache_lock_node
        if result.node is not held:
            self.prefix_cache.lock(result.node)
            state.cache_lock_node = result.node
            self.prefix_cache.unlock(held)

    def _encode_image(self, image) -> torch.Tensor:
        """Vision encoder: image -> [image_tokens, dim]."""
        crops = overlap_crops(load_image(image), self.config.vision)
        pixels = normalize_pixels(crops.crops, self.dtype, self.device)
        return encode_image(pixels, crops.tiling, self.model.vision, self.config.vision)

    def _prefill(self, state: SequenceState, tokens, image, skip: int) -> torch.Tensor:
        """Compute prompt positions skip..prompt_len-1; returns the last hidden state [C]."""
        cfg = self.config
        has_image = image is not None
        if skip == 0:
            parts = [embed_tokens([tokens[0]], self.model)]
            if has_image:
                parts.append(self._encode_image(image).to(self.dtype))
                state.vision_encoded = True
            parts.append(embed_tokens(list(tokens[1:]), self.model))
            x_TC = torch.cat([p for p in parts if p.shape[0] > 0], dim=0)
        else:
            # Tokens before the suffix are cached. With an image the KV layout is
            # [BOS][image block][text...]: cached text = skip - prefix_len.
            first = 1 + (skip - cfg.prefix_len) if has_image else skip
            x_TC = embed_tokens(list(tokens[first:]), self.model)
        n = x_TC.shape[0]
        if skip + n != state.prompt_length:
            raise RuntimeError(f"prefill covers {skip}+{n} != prompt {state.prompt_length}")
        dev = self.device
        positions = torch.arange(skip, state.prompt_length, device=dev)
        row = self.page_table.page_table[
            state.batch_idx : state.batch_idx + 1, : state.prompt_length
        ]
        slots = row[0, skip:].to(torch.long)
        bidir = None
        if has_image and skip < cfg.prefix_len:  # a hit's queries all follow the image block
            bidir = torch.tensor([[0, cfg.prefix_len]], dtype=torch.int32, device=dev)
        hidden_1TC = text_forward(
            x_TC[None],
            self.model.text,
            cfg.text,
            positions_BT=positions[None],
            kv=self.kv,
            slot_mapping=slots,
            page_table=row,
            seqused_k=torch.tensor([state.prompt_length], dtype=torch.int32, device=dev),
            bidir_regions=bidir,
            lora=[state.adapter] if state.adapter is not None else None,
            backend=self.attention_backend,
        )
        return hidden_1TC[0, -1]

    def _count(self, state: SequenceState) -> None:
        c = self.counters
        c.sequences += 1
        c.prompt_tokens += state.prompt_length
        c.cached_tokens += state.reused_page_count
        c.prefill_tokens += state.prompt_length - state.reused_page_count
        c.vision_encodes += int(state.vision_encoded)
        c.cache_hits += int(state.reused_page_count > 0)
