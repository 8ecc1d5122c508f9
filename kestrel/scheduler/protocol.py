"""What the scheduler needs of its executor (the model side), and the values they exchange.

The scheduler never imports model code: it drives any object with this shape. The engine's
executor (``kestrel.runtime.executor.BatchExecutor``) wraps ``MoondreamRuntime``; tests drive the
scheduler with fakes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from kestrel.results import RequestMetrics
from kestrel.skills.base import PromptToken, Skill

__all__ = ["Capacity", "Executor", "ExecutorOverloaded", "Request", "Started"]


class ExecutorOverloaded(RuntimeError):
    """The executor could not take a request right now (rows or pages short); retry later."""


@dataclass(frozen=True, slots=True)
class Capacity:
    free_rows: int
    available_pages: int  # free + reclaimable by evicting unlocked cache entries
    total_pages: int  # the whole usable pool


@dataclass(frozen=True, slots=True)
class Started:
    """A prefilled sequence: the executor's handle, the last position's logits and hidden state."""

    handle: Any
    logits_V: Any
    hidden_C: Any
    input_tokens: int  # KV positions of the prompt
    cached_tokens: int  # of which reused from the prefix cache
    vision_skipped: bool  # an image prompt whose image KV came from the cache
    cache_tier: str = "none"  # which cache tier served the prompt (RequestMetrics.cache_tier)


@dataclass(frozen=True, slots=True, eq=False)
class Request:
    """What a caller asked for, immutable once submitted.

    ``skill`` is a fresh state machine handed over with the request: from submission on only
    the scheduler thread touches it. ``image`` is already decoded and hashed (on the caller's
    thread); ``max_new_tokens`` is the decode budget, already clamped to the model context;
    ``cache_salt`` (optional) isolates the request's cache namespace (tenants).
    ``build_result(skill, metrics)`` turns the finished skill into the caller's result;
    ``on_text`` (optional) receives streamed text deltas.
    """

    request_id: int
    skill: Skill
    image: Any
    adapter: Any
    prompt_positions: int
    max_new_tokens: int
    future: Future
    build_result: Callable[[Skill, RequestMetrics], Any]
    submitted_at: float
    on_text: Callable[[str], None] | None = None
    cache_salt: str | None = None

    @property
    def pages_needed(self) -> int:
        """Upper bound on the KV pages the request holds while it runs."""
        return self.prompt_positions + self.max_new_tokens


class Executor(Protocol):
    """The model side of the scheduler (single-threaded: only the scheduler calls it)."""

    def capacity(self) -> Capacity: ...

    def start_many(self, requests: Sequence[Request]) -> list[Started | Exception]:
        """Prefill admitted requests (reusing cached prefixes), batched as the executor sees
        fit; one outcome per request, in order: ``Started``, ``ExecutorOverloaded`` (cannot take
        it now: retry later) or the exception that fails it. Nothing is held for a request
        that did not start."""
        ...

    def decode(
        self, handles: Sequence[Any], tokens: Sequence[PromptToken], *, lookahead: bool = False
    ) -> tuple[Any, list]:
        """Feed one token per sequence in one batched step: (logits [B, V], hidden per row).
        ``lookahead``: no admission is due before the next step, so the executor may queue it
        before this one is read back (it guesses each row's token; the guess is checked)."""
        ...

    def release(self, handle: Any) -> None: ...

    def check_integrity(self) -> None: ...
