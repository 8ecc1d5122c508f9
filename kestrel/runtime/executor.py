"""The batch executor: MoondreamRuntime behind the scheduler's executor protocol.

All tensor work of the engine happens here, on the scheduler thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kestrel.kv.page_table import BatchSlotsExhausted, PagePoolExhausted
from kestrel.prefix_cache.node import token_kv_length
from kestrel.runtime.heads import BatchChoice, RowLogits, batch_rows, choose
from kestrel.runtime.lookahead import AheadStep, LookaheadCounters, settle
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.runtime.sequence import SequenceState
from kestrel.scheduler.protocol import Capacity, ExecutorOverloaded, Request, Started
from kestrel.skills.base import Draw, PromptToken
from kestrel_kernels.transfer import upload

__all__ = ["DEFER_MIN_POSITIONS", "BatchExecutor"]

# A request waits for the next prefill wave when it shares at least this many not-yet-cached
# KV positions with a miss of the current wave (an image block always qualifies).
DEFER_MIN_POSITIONS = 16


def _waits_for(state: SequenceState, other: SequenceState) -> bool:
    """Whether ``state`` would recompute positions that ``other`` (earlier in the same wave)
    inserts into the cache at its commit: same namespace, a common prefix beyond what
    ``state`` matched, of at least ``DEFER_MIN_POSITIONS`` positions."""
    a, b = state.lease, other.lease
    if a.cache is None or a.namespace != b.namespace:
        return False
    start = a.match.matched_token_count
    if b.match.matched_token_count > start or len(b.tokens) <= start:
        return False  # other reuses more than state: nothing new for state in its insert
    shared = 0
    for x, y in zip(a.tokens[start:], b.tokens[start:], strict=False):
        if x != y:
            break
        shared += token_kv_length((x,))
        if shared >= DEFER_MIN_POSITIONS:
            return True
    return False


class BatchExecutor:
    """Runs the scheduler's batches on the runtime (``scheduler.protocol.Executor``): a step's
    admitted requests prefilled in waves, then one decode step for every running sequence.

    It keeps each running sequence's skill so that, before a step's logits exist, it can ask
    every row how its token will be chosen (``Skill.next_draw``): the whole batch is then
    sampled on the device together and read back once (``heads.batch_rows``).
    """

    def __init__(self, runtime: MoondreamRuntime, *, lookahead: bool | None = None) -> None:
        self.runtime = runtime
        # look ahead where the device runs beside the host (CUDA): on a CPU the host computes
        # the step itself, and a wasted look-ahead row is work, not idle time
        self.lookahead = runtime.device.type == "cuda" if lookahead is None else lookahead
        # batch row -> its request's ``skill.next_draw`` (bound once: called every step)
        self._next_draw: dict[int, Callable[[], Draw | None]] = {}
        # batch rows whose skill may draw under a grammar or ask for log-probabilities: with
        # none, a step's choice looks for neither (heads.choose's ``special``)
        self._shaped: set[int] = set()
        self._ahead: AheadStep | None = None
        self.lookahead_counters = LookaheadCounters()

    def capacity(self) -> Capacity:
        rt = self.runtime
        pt = rt.page_table
        return Capacity(
            free_rows=pt.max_batch_size - len(rt.active_sequences),
            available_pages=pt.pages_available + rt.prefix_cache.reclaimable_page_count(),
            total_pages=pt.n_pages - 1,
        )

    def start_many(self, requests: Sequence[Request]) -> list[Started | Exception]:
        """Prefill admitted requests in waves of batched forwards; one outcome per request.

        A wave prepares requests in order. One that would recompute a stretch another miss of
        the same wave is about to insert (the same image, a shared system prompt) waits for the
        next wave, where that stretch is a cache hit: its vision encoder and prefix are not run
        twice. Once the pool is short, the rest get ``ExecutorOverloaded``.
        """
        out: list[Started | Exception | None] = [None] * len(requests)
        pending = list(range(len(requests)))
        with torch.inference_mode():
            while pending:
                wave, pending = self._prepare_wave(requests, pending, out)
                if wave:
                    self._run_wave(requests, wave, out)
        return out  # type: ignore[return-value]

    def _prepare_wave(self, requests, pending: list[int], out: list) -> tuple[list, list[int]]:
        wave: list[tuple[int, SequenceState]] = []
        deferred: list[int] = []
        for pos, i in enumerate(pending):
            try:
                state = self._prepare(requests[i])
            except (PagePoolExhausted, BatchSlotsExhausted) as exc:
                for j in pending[pos:]:
                    out[j] = ExecutorOverloaded(str(exc))
                return wave, deferred
            except Exception as exc:
                out[i] = exc
                continue
            if any(_waits_for(state, other) for _, other in wave):
                self.runtime.abort_sequence(state)
                deferred.append(i)
            else:
                wave.append((i, state))
        return wave, deferred

    def _prepare(self, request: Request) -> SequenceState:
        return self.runtime.prepare_sequence(
            request.skill.prompt,
            request.image,
            adapter=request.adapter,
            max_new_tokens=request.max_new_tokens,
            cache_salt=request.cache_salt,
        )

    def _run_wave(self, requests, wave: list[tuple[int, SequenceState]], out: list) -> None:
        """Prefill a wave, then commit each sequence; anything left uncommitted (a failure, an
        interrupt) is aborted, so nothing is held for a request that did not start."""
        rt = self.runtime
        try:
            draws = [requests[i].skill.next_draw() for i, _ in wave]
            for i, s, hidden_C, logits in self._prefill_wave(wave, draws, out):
                try:
                    rt.commit_sequence(s, hidden_C)  # aborts its own lease if it raises
                except Exception as exc:
                    out[i] = exc
                    continue
                image = requests[i].image
                self._next_draw[s.batch_idx] = requests[i].skill.next_draw
                if requests[i].skill.shaped:
                    self._shaped.add(s.batch_idx)
                out[i] = Started(
                    handle=s,
                    logits_V=logits,
                    hidden_C=hidden_C,
                    input_tokens=s.prompt_length,
                    cached_tokens=s.reused_page_count,
                    vision_skipped=image is not None and not s.vision_encoded,
                    cache_tier=s.cache_tier,
                )
        finally:
            for i, s in wave:
                if not isinstance(out[i], Started):
                    rt.abort_sequence(s)  # a no-op for those already given back

    def _prefill_wave(
        self, wave: list[tuple[int, SequenceState]], draws: list[Draw | None], out: list
    ) -> list:
        """(index, state, hidden [C], RowLogits) per prefilled sequence: one batched call; if
        that fails, each sequence alone, so a fault fails only the request it belongs to."""
        rt = self.runtime
        states = [s for _, s in wave]
        try:
            hidden_BC, logits_BV = rt.prefill_sequences(states)
            rows = batch_rows(logits_BV, draws)
            return [(i, s, hidden_BC[b], rows[b]) for b, (i, s) in enumerate(wave)]
        except Exception as exc:
            if len(wave) == 1:
                out[wave[0][0]] = exc
                return []
        done = []
        for (i, s), draw in zip(wave, draws, strict=True):
            try:
                hidden_C, logits_V = rt.prefill_sequence(s)
            except Exception as exc:
                out[i] = exc
                continue
            done.append((i, s, hidden_C, batch_rows(logits_V[None], [draw])[0]))
        return done

    def decode(
        self,
        handles: Sequence[SequenceState],
        tokens: Sequence[PromptToken],
        *,
        lookahead: bool = False,
    ) -> tuple[list[RowLogits], list[Any]]:
        """Logits per row, each row's token chosen with the batch's (one transfer), hiddens.

        ``lookahead``: the caller plans no admission before the next step, so this one may
        queue the next step before reading its tokens (``lookahead.py``; only if the executor
        looks ahead at all), for every row whose draw is not ``final``."""
        next_draw = self._next_draw
        draws = [next_draw[h.batch_idx]() if h.batch_idx in next_draw else None for h in handles]
        with torch.inference_mode():
            logits_BV, hidden = self._forward(handles, tokens)
            choice = choose(logits_BV, draws, special=bool(self._shaped))
            keep = self._ahead_rows(handles, draws) if lookahead and self.lookahead else None
            ahead = None if keep is None else self._queue_ahead(handles, choice, keep)
            rows = choice.rows()  # the one read (deferred when a look-ahead step is queued)
        if ahead is not None and keep is not None:
            picks = choice.picks
            ahead.fed_ids = picks if len(keep) == len(picks) else [picks[b] for b in keep]
            self._ahead = ahead
        return rows, hidden

    def _forward(
        self, handles: Sequence[SequenceState], tokens: Sequence[PromptToken]
    ) -> tuple[torch.Tensor, list[Any]]:
        """This step's logits [B, V] and hidden states: from the queued look-ahead step where
        it guessed right, from a fresh forward for every other row."""
        rt, ahead, self._ahead = self.runtime, self._ahead, None
        if ahead is None:
            return rt.decode_step(handles, tokens), [h.last_hidden for h in handles]
        used = settle(rt, ahead, handles, tokens, self.lookahead_counters)
        fresh = [i for i, j in enumerate(used) if j < 0]
        if not fresh and used == list(range(len(ahead.states))):
            return ahead.logits_BV, [h.last_hidden for h in handles]
        parts = [ahead.logits_BV]
        if fresh:
            parts.append(rt.decode_step([handles[i] for i in fresh], [tokens[i] for i in fresh]))
        base = iter(range(len(ahead.states), len(ahead.states) + len(fresh)))
        order = [j if j >= 0 else next(base) for j in used]
        index = upload(order, torch.int64, ahead.logits_BV.device)
        return torch.cat(parts).index_select(0, index), [h.last_hidden for h in handles]

    @staticmethod
    def _ahead_rows(
        handles: Sequence[SequenceState], draws: Sequence[Draw | None]
    ) -> list[int] | None:
        """The rows a look-ahead step may feed, or None when none is queued.

        Every row must sample its next token from the logits (a region skill reads the hidden
        state). A row whose draw is ``final`` is left out: its token ends its output unfed,
        so it will retire without another forward (queued, it would be computed and rolled
        back for nothing). The rest must have a page left, and at least one must remain."""
        if not all(d is not None for d in draws):
            return None
        keep = [b for b, d in enumerate(draws) if d is not None and not d.final]
        if not keep or not all(handles[b].length < handles[b].max_length for b in keep):
            return None
        return keep

    def _queue_ahead(
        self, handles: Sequence[SequenceState], choice: BatchChoice, keep: list[int]
    ) -> AheadStep:
        """Queue the look-ahead step for the rows ``keep``, fed the ids the device chose."""
        ids_B = choice.chosen_B
        if len(keep) < len(handles):  # a gather on the device: nothing is read back
            ids_B = ids_B.index_select(0, upload(keep, torch.int64, ids_B.device))
        states = [handles[b] for b in keep] if len(keep) < len(handles) else list(handles)
        h_BC, l_BV = self.runtime.decode_ahead(states, ids_B)
        self.lookahead_counters.steps += 1
        self.lookahead_counters.rows += len(states)
        return AheadStep(states, h_BC, l_BV, [])

    def release(self, handle: SequenceState) -> None:
        self._next_draw.pop(handle.batch_idx, None)
        self._shaped.discard(handle.batch_idx)
        self.runtime.release_sequence(handle)  # rolls back a look-ahead position
        if self._ahead is not None and not self._ahead.live:  # every row of it retired
            self.lookahead_counters.rolled_back += len(self._ahead.states)
            self._ahead = None

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
