"""The scheduler's per-sequence state (mutable, scheduler thread only) and the two managers
that own requests: the wait queue and the running set."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kestrel.results import RequestMetrics
from kestrel.scheduler.protocol import Capacity, Request
from kestrel.skills.base import PromptToken

__all__ = ["RunningSet", "SequenceRun", "WaitQueue"]


@dataclass(slots=True, eq=False)
class SequenceRun:
    """A request being generated: its runner handle, the token to feed next, its clock."""

    request: Request
    handle: Any
    admitted_at: float
    prefill_ms: float = 0.0
    input_tokens: int = 0
    cached_tokens: int = 0
    next_token: PromptToken | None = None
    fed: int = 0  # tokens fed after the prompt
    first_token_at: float | None = None

    @property
    def budget(self) -> int:
        return self.request.max_new_tokens - self.fed

    def metrics(self, output_tokens: int) -> RequestMetrics:
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
        )


class WaitQueue:
    """FIFO of submitted requests. Admission is in order: the head waits for capacity rather
    than being overtaken, so a large request is never starved by a stream of small ones."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    def push(self, request: Request) -> None:
        self._q.append(request)

    def push_front(self, request: Request) -> None:
        self._q.appendleft(request)

    def drop_cancelled(self) -> list[Request]:
        gone = [r for r in self._q if r.future.cancelled()]
        if gone:
            self._q = deque(r for r in self._q if not r.future.cancelled())
        return gone

    def pop_all(self) -> list[Request]:
        out = list(self._q)
        self._q.clear()
        return out

    def admit(self, cap: Capacity) -> tuple[list[Request], list[Request]]:
        """(requests that fit now, requests that can never fit), both removed from the queue."""
        admitted: list[Request] = []
        never: list[Request] = []
        rows, pages = cap.free_rows, cap.available_pages
        while self._q and rows > 0:
            head = self._q[0]
            need = head.pages_needed
            if need > cap.total_pages:
                never.append(self._q.popleft())
                continue
            if need > pages:
                break
            admitted.append(self._q.popleft())
            rows -= 1
            pages -= need
        return admitted, never


class RunningSet:
    """The sequences that hold a runner handle (a batch row and pages)."""

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
