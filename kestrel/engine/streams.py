"""Streams of text deltas, for threads and for asyncio, fed by the scheduler thread.

Iterating yields the answer's text as it is generated; the concatenation of every delta equals
the blocking call's answer. After the last delta, ``result()`` gives the full result (with its
metrics). A request that fails raises its error from the iteration. Leaving the iteration early
(``break``, an exception, garbage collection) cancels the request, which releases what it holds
at the scheduler's next step.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from typing import Any

__all__ = ["AsyncTextStream", "TextStream"]

_END = object()


def _leave(future: Future, finished: bool) -> None:
    """An iteration's end: left early (``break``, an error, garbage collection), the request is
    cancelled; after the last delta, the request's error is raised, if it failed."""
    if not finished:
        future.cancel()
    elif not future.cancelled() and future.exception() is not None:
        raise future.exception()


class TextStream:
    """A blocking iterator of text deltas (thread callers)."""

    def __init__(self) -> None:
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()
        self._ended = False
        self.future: Future | None = None

    # called by the scheduler thread
    def push(self, delta: str) -> None:
        self._chunks.put(delta)

    def attach(self, future: Future) -> None:
        self.future = future
        future.add_done_callback(lambda _f: self._chunks.put(_END))

    def __iter__(self) -> Iterator[str]:
        assert self.future is not None
        finished = self._ended  # a second iteration yields nothing more
        try:
            while not self._ended and (item := self._chunks.get()) is not _END:
                yield item
            finished = self._ended = True
        finally:
            _leave(self.future, finished)

    def result(self, timeout: float | None = None) -> Any:
        """The finished request's result (blocks until it is done)."""
        assert self.future is not None
        return self.future.result(timeout)

    def cancel(self) -> bool:
        assert self.future is not None
        return self.future.cancel()


class AsyncTextStream:
    """``async for delta in stream`` (asyncio callers); never blocks the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._chunks: asyncio.Queue = asyncio.Queue()
        self._ended = False
        self.future: Future | None = None

    def push(self, delta: str) -> None:  # scheduler thread
        self._loop.call_soon_threadsafe(self._chunks.put_nowait, delta)

    def attach(self, future: Future) -> None:
        self.future = future
        future.add_done_callback(
            lambda _f: self._loop.call_soon_threadsafe(self._chunks.put_nowait, _END)
        )

    async def _iterate(self) -> AsyncIterator[str]:
        assert self.future is not None
        finished = self._ended
        try:
            while not self._ended and (item := await self._chunks.get()) is not _END:
                yield item
            finished = self._ended = True
        finally:
            _leave(self.future, finished)

    def __aiter__(self) -> AsyncIterator[str]:
        return self._iterate()

    async def result(self) -> Any:
        assert self.future is not None
        return await asyncio.wrap_future(self.future)

    def cancel(self) -> bool:
        assert self.future is not None
        return self.future.cancel()
