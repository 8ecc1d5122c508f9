"""The engine's model runner: MoondreamRuntime behind the scheduler's runner protocol.

All tensor work of the engine happens here, on the scheduler thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kestrel.kv_cache import BatchSlotsExhausted, PagePoolExhausted
from kestrel.moondream.heads import RowLogits, batch_rows
from kestrel.moondream.runtime import MoondreamRuntime
from kestrel.moondream.sequence import SequenceState
from kestrel.scheduler.protocol import Capacity, Request, RunnerOverloaded, Started
from kestrel.skills.base import PromptToken

__all__ = ["MoondreamRunner", "PageCounts"]


class PageCounts(dict):
    """Page accounting of the pool (free / cached / private / locked / evictable / total)."""


class MoondreamRunner:
    def __init__(self, runtime: MoondreamRuntime) -> None:
        self.runtime = runtime
        self.evicted_pages = 0

    def capacity(self) -> Capacity:
        rt = self.runtime
        pt = rt.page_table
        return Capacity(
            free_rows=pt.max_batch_size - len(rt.active_sequences),
            available_pages=pt.pages_available + rt.prefix_cache.reclaimable_page_count(),
            total_pages=pt.n_pages - 1,
        )

    def start(self, request: Request) -> Started:
        image = request.image
        try:
            with torch.inference_mode():
                state, logits_V = self.runtime.start_sequence(
                    request.skill.prompt,
                    None if image is None else image.pixels,
                    image_hash=None if image is None else image.digest,
                    adapter=request.adapter,
                    max_new_tokens=request.max_new_tokens,
                    cache_salt=request.cache_salt,
                )
        except (PagePoolExhausted, BatchSlotsExhausted) as exc:
            raise RunnerOverloaded(str(exc)) from exc
        return Started(
            handle=state,
            logits_V=batch_rows(logits_V[None])[0],
            hidden_C=state.last_hidden,
            input_tokens=state.prompt_length,
            cached_tokens=state.reused_page_count,
            vision_skipped=image is not None and not state.vision_encoded,
        )

    def decode(
        self, handles: Sequence[SequenceState], tokens: Sequence[PromptToken]
    ) -> tuple[list[RowLogits], list[Any]]:
        """Logits per row (with the batch's argmaxes read back in one transfer), hiddens."""
        with torch.inference_mode():
            logits_BV = self.runtime.decode_step(handles, tokens)
            return batch_rows(logits_BV), [h.last_hidden for h in handles]

    def release(self, handle: SequenceState) -> None:
        self.runtime.release_sequence(handle)

    def check_integrity(self) -> None:
        self.runtime.check_integrity()

    def pages(self) -> dict[str, int]:
        rt = self.runtime
        pt, cache = rt.page_table, rt.prefix_cache
        stats = cache.stats()
        total = pt.n_pages - 1
        free = pt.pages_available
        return {
            "pages_total": total,
            "pages_free": free,
            "pages_cached": stats.cached_pages,
            "pages_private": total - free - stats.cached_pages,
            "pages_locked": stats.locked_pages,
            "pages_evictable": stats.evictable_pages,
            "evictions": stats.evicted_pages,
            "namespaces": stats.namespaces,
        }
