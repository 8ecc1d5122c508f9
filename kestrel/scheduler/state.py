"""The scheduler's per-sequence state (mutable, scheduler thread only) and the set of running
sequences that hold an executor handle."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kestrel.results import RequestMetrics
from kestrel.scheduler.protocol import Request
from kestrel.skills.base import PromptToken, Skill

__all__ = ["RunningSet", "SequenceRun"]


@dataclass(slots=True, eq=False)
class SequenceRun:
    """A request being generated: its executor handle, the token to feed next, its clock."""

    request: Request
    handle: Any
    admitted_at: float
    prefill_ms: float = 0.0
    input_tokens: int = 0
    cached_tokens: int = 0
    cache_tier: str = "none"
    next_token: PromptToken | None = None
    fed: int = 0  # tokens fed after the prompt
    first_token_at: float | None = None
    skill: Skill = field(init=False)  # the request's, read on every step
    budget_end: int = field(init=False)  # the request's max_new_tokens

    def __post_init__(self) -> None:
        self.skill = self.request.skill
        self.budget_end = self.request.max_new_tokens

    @property
    def budget(self) -> int:
        return self.budget_end - self.fed

    def metrics(self, output_tokens: int, reasoning_tokens: int = 0) -> RequestMetrics:
        now = time.perf_counter()
        req = self.request
        first = self.first_token_at if self.first_token_at is not None else now
        return RequestMetrics(
            input_tokens=self.input_tokens,
            cached_tokens=self.cached_tokens,
            output_tokens=output_tokens,
            ttft_ms=(first - req.submitted_at) * 1e3,
            prefill_ms=self.prefill_ms,
            decode_ms=(now - first) * 1e3,
            queue_ms=(self.admitted_at - req.submitted_at) * 1e3,
            cache_tier=self.cache_tier,
            reasoning_tokens=reasoning_tokens,
        )


class RunningSet:
    """The sequences that hold an executor handle (a batch row and pages)."""

    def __init__(self) -> None:
        self._runs: list[SequenceRun] = []

    def __len__(self) -> int:
        return len(self._runs)

    def __iter__(self) -> Iterator[SequenceRun]:
        return iter(list(self._runs))

    def add(self, run: SequenceRun) -> None:
        self._runs.append(run)

    def remove(self, run: SequenceRun) -> None:
        self._runs.remove(run)

    def feeding(self) -> list[SequenceRun]:
        """The sequences with a token to feed in the next decode step."""
        return [r for r in self._runs if r.next_token is not None]
