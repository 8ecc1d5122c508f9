"""The scheduler: one loop that admits, prefills, decodes and retires.

``step()`` is ``schedule`` (drop cancelled requests, admit what fits), ``run`` (prefill the
admitted requests, which the executor batches, then one batched decode over every running
sequence) and ``postprocess`` (each sequence's skill decides its next token, text is streamed,
finished sequences retire and release what they hold). It is a plain class, driven by the
engine's thread or directly by tests; nothing here is thread-safe, and nothing here imports
model code.

Failure isolation: an exception while prefilling fails that request alone (the executor retries a
failed batched prefill one sequence at a time); one inside a decode step fails the sequences of
that step; a skill that raises fails its own sequence. Every failure releases the sequence's
handle before the caller hears of it, so nothing leaks."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

from kestrel.errors import CapacityError, InvalidInputError, KestrelError, ModelError
from kestrel.scheduler.protocol import Capacity, Executor, ExecutorOverloaded, Request, Started
from kestrel.scheduler.state import RunningSet, SequenceRun

__all__ = ["Scheduler", "SchedulerCounters", "WaitQueue"]

log = logging.getLogger("kestrel.scheduler")


@dataclass(slots=True)
class SchedulerCounters:
    served: int = 0
    failed: int = 0
    cancelled: int = 0
    vision_skipped: int = 0
    steps: int = 0
    decode_steps: int = 0


def as_request_error(exc: BaseException) -> KestrelError:
    """The error a caller sees for an exception raised while running its request."""
    if isinstance(exc, KestrelError):
        return exc
    if isinstance(exc, ValueError):  # the runtime's own request checks (SequenceError, ...)
        err: KestrelError = InvalidInputError(str(exc))
    else:
        err = ModelError(f"the model failed on this request: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


def _settle(future: Future, *, result: Any = None, error: BaseException | None = None) -> bool:
    """Complete a future unless its caller cancelled it first; True if it was completed."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled by the caller in the meantime
        return False
    return True


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


class Scheduler:
    def __init__(self, executor: Executor, *, clock: Callable[[], float] = time.perf_counter):
        self.executor = executor
        self.clock = clock
        self.waiting = WaitQueue()
        self.running = RunningSet()
        self.counters = SchedulerCounters()
        self._retired = 0  # sequences retired since the last decode step

    # ------------------------------------------------------------------ public
    def submit(self, request: Request) -> None:
        """Queue a request; one that could never fit the page pool fails right away."""
        if request.pages_needed > self.executor.capacity().total_pages:
            self._fail_never_fits(request)
        else:
            self.waiting.push(request)

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def step(self) -> None:
        self.counters.steps += 1
        self.step_prefill()
        self.step_decode()

    def step_prefill(self) -> None:
        """A step's first half: drop what was cancelled, admit what fits, prefill it. (The
        halves are public for a caller that counts or times one alone: kernel_counts.py.)"""
        self._prefill(self._schedule())

    def step_decode(self) -> None:
        """A step's second half: one batched decode step of every running sequence."""
        self._decode()

    def abort_all(self, make_error: Callable[[], KestrelError]) -> None:
        """Fail every waiting and running request (running ones are released first)."""
        for run in self.running:
            self._retire(run, error=make_error())
        for request in self.waiting.pop_all():
            self._fail(request, make_error())

    def check_integrity(self) -> None:
        self.executor.check_integrity()
        running = {id(r.request) for r in self.running}
        if any(id(r) in running for r in self.waiting):
            raise AssertionError("a request is both waiting and running")
        for run in self.running:
            if run.fed > run.request.max_new_tokens:
                raise AssertionError(f"request {run.request.request_id} fed past its budget")

    # ------------------------------------------------------------------ schedule
    def _schedule(self) -> list[Request]:
        self.counters.cancelled += len(self.waiting.drop_cancelled())
        for run in self.running:
            if run.request.future.cancelled():
                self._retire(run, cancelled=True)
        admitted, never = self.waiting.admit(self.executor.capacity())
        for request in never:
            self._fail_never_fits(request)
        return admitted

    def _fail_never_fits(self, request: Request) -> None:
        total = self.executor.capacity().total_pages
        self._fail(
            request,
            CapacityError(
                f"the request needs up to {request.pages_needed} KV pages (prompt "
                f"{request.prompt_positions} + {request.max_new_tokens} new tokens) but the "
                f"pool has {total}; lower max_tokens / max_objects or raise kv_cache_pages"
            ),
        )

    # ------------------------------------------------------------------ run
    def _prefill(self, admitted: list[Request]) -> None:
        if not admitted:
            return
        t0 = self.clock()
        outcomes = self.executor.start_many(admitted)
        prefill_ms = (self.clock() - t0) * 1e3
        overloaded: list[tuple[Request, ExecutorOverloaded]] = []
        for request, out in zip(admitted, outcomes, strict=True):
            if isinstance(out, ExecutorOverloaded):
                overloaded.append((request, out))
            elif isinstance(out, BaseException):
                self._fail(request, as_request_error(out))
            else:
                self._begin(request, out, t0, prefill_ms)
        if overloaded and not self.running:  # nothing running will free capacity
            request, exc = overloaded.pop(0)
            self._fail(request, CapacityError(str(exc)))
        for request, _ in reversed(overloaded):
            self.waiting.push_front(request)

    def _begin(self, request: Request, started: Started, t0: float, prefill_ms: float) -> None:
        run = SequenceRun(
            request,
            started.handle,
            admitted_at=t0,
            prefill_ms=prefill_ms,
            input_tokens=started.input_tokens,
            cached_tokens=started.cached_tokens,
            cache_tier=started.cache_tier,
        )
        self.counters.vision_skipped += int(started.vision_skipped)
        self.running.add(run)
        self._advance(run, started.logits_V, started.hidden_C)

    def _decode(self) -> None:
        batch = self.running.feeding()
        if not batch:
            return
        self.counters.decode_steps += 1
        tokens = [r.next_token for r in batch]
        # The executor may queue the next step before reading this one's tokens. Rows admitted
        # before that step would miss it and cost a second forward, so not while requests wait
        # or rows have just retired (their replacements are on the way).
        lookahead = not self.waiting and not self._retired
        self._retired = 0
        try:
            logits_BV, hidden = self.executor.decode(
                [r.handle for r in batch], tokens, lookahead=lookahead
            )
        except Exception as exc:
            log.exception("decode step failed; failing its %d sequences", len(batch))
            for run in batch:
                self._retire(run, error=as_request_error(exc))
            return
        for run, logits_V, hidden_C in zip(batch, logits_BV, hidden, strict=True):
            run.fed += 1
            run.next_token = None
            self._advance(run, logits_V, hidden_C)

    # ------------------------------------------------------------------ postprocess
    def _advance(self, run: SequenceRun, logits_V: Any, hidden_C: Any) -> None:
        try:
            fed = run.skill.advance(logits_V, hidden_C, run.budget)
        except Exception as exc:
            self._retire(run, error=as_request_error(exc))
            return
        if run.first_token_at is None:
            run.first_token_at = self.clock()
        if run.request.on_text is not None:
            self._stream(run)
        if fed is None:
            self._retire(run)
        else:
            run.next_token = fed

    def _stream(self, run: SequenceRun) -> None:
        on_text = run.request.on_text
        if on_text is None:
            return
        delta = run.request.skill.take_text()
        if delta:
            try:
                on_text(delta)
            except Exception:  # a broken consumer must not take the scheduler down
                log.exception("stream consumer of request %s raised", run.request.request_id)

    def _retire(
        self, run: SequenceRun, *, error: KestrelError | None = None, cancelled: bool = False
    ) -> None:
        """Release the sequence, then tell its caller (result, error, or nothing if cancelled)."""
        self.running.remove(run)
        self._retired += 1
        try:
            self.executor.release(run.handle)
        except Exception as exc:
            log.exception("releasing request %s failed", run.request.request_id)
            error = error or as_request_error(exc)
        request = run.request
        if cancelled:
            self.counters.cancelled += 1
            return
        if error is None:
            skill = request.skill
            try:
                metrics = run.metrics(len(skill.output_tokens()), skill.reasoning_tokens())
                result = request.build_result(skill, metrics)
            except Exception as exc:
                error = as_request_error(exc)
        if error is not None:
            self._fail(request, error)
        elif _settle(request.future, result=result):
            self.counters.served += 1
        else:
            self.counters.cancelled += 1

    def _fail(self, request: Request, error: KestrelError) -> None:
        if _settle(request.future, error=error):
            self.counters.failed += 1
        else:
            self.counters.cancelled += 1
