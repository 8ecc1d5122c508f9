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

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kestrel.images import PreparedImage, image_hash_int
from kestrel.moondream.lora import LoraAdapter
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.text import lm_head
from kestrel.moondream.tokenizer import MoondreamTokenizer
from kestrel.moondream.vision import encode_image
from kestrel.moondream.weights import resolve_checkpoint
from kestrel.prefix_cache.lease import CacheLease, LeasePhase
from kestrel.prefix_cache.namespace import CacheNamespace
from kestrel.prefix_cache.node import token_kv_length
from kestrel.runtime.build import RuntimeOptions, build_parts
from kestrel.runtime.cuda_graphs import DecodeGraphs
from kestrel.runtime.decode_steps import DecodeSteps
from kestrel.runtime.embeddings import EmbeddingBatch
from kestrel.runtime.prefill import prefill_batch, prefill_item
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
from kestrel_kernels.backends import resolve_backend

__all__ = ["MoondreamRuntime", "RuntimeCounters", "SequenceError", "SequenceState"]


class MoondreamRuntime:
    """Cached prefill, batched decode and release over one KV pool (see the module doc).

    Built from :class:`~kestrel.runtime.build.RuntimeOptions` (``options``, or its fields as
    keywords; each is documented there) by ``build.py``, which makes and starts everything it
    runs on. The decode steps (a known token, or a look-ahead id on the device) are its
    ``decoder`` (``decode_steps.py``); ``decode_step`` and its kin hand over to it.
    """

    def __init__(
        self,
        model: MoondreamModel,
        tokenizer: MoondreamTokenizer | None = None,
        options: RuntimeOptions | None = None,
        **overrides: Any,
    ) -> None:
        self.options = o = RuntimeOptions.of(options, **overrides)
        self.model, self.tokenizer, self.config = model, tokenizer, model.config
        self.device, self.dtype = model.device, model.dtype
        # the attention backend object, resolved once (kestrel_kernels.backends), and served
        # on the decode route the start-up measured (build.py: pool, tiers, start-up)
        p = build_parts(model, o, resolve_backend(o.attention_backend, self.device, self.dtype))
        self.attention_backend = p.backend
        self.page_table, self.kv, self.prefix_cache = p.page_table, p.kv, p.prefix_cache
        self.embeddings, self.crops, self.kv_report = p.embeddings, p.crops, p.kv_report
        self.compiled_prefill, self.decode_trials = p.compiled_prefill, p.decode_trials
        self.prefill_graphs, self.vision_graphs = p.graphs.prefill, p.graphs.vision
        self.counters = RuntimeCounters()
        self._active: dict[int, SequenceState] = {}
        self.decoder = DecodeSteps(model, self.kv, self.page_table, self._active,
                                   self.attention_backend, p.graphs.decode)  # fmt: skip

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, *, revision: str | None = None,
                        device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                        **options: Any) -> MoondreamRuntime:  # fmt: skip
        """A checkpoint directory or hub name (resolved once: a hub id downloads here), its
        model and tokenizer loaded and run under ``options`` (the constructor's)."""
        ckpt = resolve_checkpoint(name_or_path, revision)
        model = MoondreamModel.from_pretrained(ckpt, device=device, dtype=dtype)
        return cls(model, MoondreamTokenizer.for_checkpoint(ckpt), **options)

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        """The decode step's CUDA graphs (the decoder's; None: every step eager)."""
        return self.decoder.graphs

    @decode_graphs.setter
    def decode_graphs(self, graphs: DecodeGraphs | None) -> None:
        self.decoder.graphs = graphs

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

        Arguments as ``start_sequence`` describes them. Follow with ``prefill_sequence`` and
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
            self.prefix_cache if self.options.enable_prefix_cache else None,
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
        compiled = self.compiled_prefill
        run = prefill_batch if compiled is None else compiled.prefill_batch
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
        self, tokens: Sequence[PromptToken], image: object = None, **request: Any
    ) -> tuple[SequenceState, torch.Tensor]:
        """Prefill a prompt (reusing its cached prefix) and return its state and last logits [V].

        ``tokens`` starts with ``TextToken(bos_id)``; one ``image`` is placed right after BOS,
        unless ``tokens`` places its images itself (an ``ImageToken`` per image, in the order of
        ``image``, then a tuple; a conversation's later turns). Images are
        :class:`~kestrel.images.PreparedImage` (pixels and their digest), or anything
        ``prepare_image`` takes. ``request``: ``prepare_sequence``'s keywords, ``adapter``,
        ``max_new_tokens`` and ``cache_salt`` (the prompt in a namespace of its own: tenant
        isolation). Prepare, prefill and commit in one call.
        """
        state = self.prepare_sequence(tokens, image, **request)
        try:
            hidden_C, logits_V = self.prefill_sequence(state)
            self.commit_sequence(state, hidden_C)
        except BaseException:
            self.abort_sequence(state)
            raise
        return state, logits_V

    def decode_step(
        self, states: Sequence[SequenceState], tokens: Sequence[PromptToken]
    ) -> torch.Tensor:
        """One token fed per sequence in one batched forward: logits [B, V] (``DecodeSteps``)."""
        return self.decoder.decode_step(states, tokens)

    def decode_ahead(
        self, states: Sequence[SequenceState], ids_B: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A look-ahead step fed the ids ``ids_B`` on the device (``DecodeSteps``)."""
        return self.decoder.decode_ahead(states, ids_B)

    def settle_ahead(
        self, state: SequenceState, token: PromptToken | None, hidden_C: torch.Tensor | None
    ) -> None:
        """Confirm a look-ahead position, or (``token`` None) roll it back (``DecodeSteps``)."""
        self.decoder.settle_ahead(state, token, hidden_C)

    def confirm_ahead(self, states: Sequence[SequenceState], tokens: Sequence[PromptToken],
                      hidden_BC: torch.Tensor) -> None:  # fmt: skip
        """``settle_ahead`` confirming every row of a look-ahead step (``DecodeSteps``)."""
        self.decoder.confirm_ahead(states, tokens, hidden_BC)

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
        if not self.options.retain_decoded:
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
            s.check_running(self.page_table.capacity(s.batch_idx), self.options.enable_prefix_cache)

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
