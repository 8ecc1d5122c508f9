"""The Engine's asyncio twins: the same calls, awaitable, never blocking the event loop.

Validation, image decoding and hashing run in a worker thread (``asyncio.to_thread``); the
request then goes to the scheduler like any other, and its future is bridged into the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from kestrel.engine.desk import Drafter, Submitter

__all__ = ["AsyncTwins"]


class AsyncTwins:
    """Mixed into :class:`kestrel.Engine`, whose two members it uses are
    ``_drafts`` (a :class:`~kestrel.engine.desk.Drafter`) and ``_requests`` (a
    :class:`~kestrel.engine.desk.Submitter`)."""

    _drafts: Drafter
    _requests: Submitter

    async def aquery(
        self,
        image: object,
        question: str,
        *,
        settings: dict | None = None,
        adapter: str | None = None,
        cache_salt: str | None = None,
        reasoning: bool = False,
        spatial_refs: Sequence[Sequence[float]] | None = None,
        stream: bool = False,
        stop: str | Sequence[str] | None = None,
        response_format: Any = None,
        logprobs: int | None = None,
    ) -> Any:
        """``await engine.aquery(...)`` -> QueryResult; with ``stream=True`` an
        AsyncTextStream to ``async for`` over (then ``await stream.result()``)."""
        args = (image, question, settings, adapter, cache_salt, reasoning, spatial_refs)
        answer = {"stop": stop, "response_format": response_format, "logprobs": logprobs}
        draft = await asyncio.to_thread(self._drafts.query, *args, **answer)
        return await self._requests.wait(draft, stream)

    async def achat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        settings: dict | None = None,
        adapter: str | None = None,
        cache_salt: str | None = None,
        reasoning: bool = False,
        stream: bool = False,
        stop: str | Sequence[str] | None = None,
        response_format: Any = None,
        logprobs: int | None = None,
    ) -> Any:
        """``await engine.achat(messages)`` -> ChatResult (or an AsyncTextStream)."""
        args = (messages, settings, adapter, cache_salt, reasoning)
        answer = {"stop": stop, "response_format": response_format, "logprobs": logprobs}
        draft = await asyncio.to_thread(self._drafts.chat, *args, **answer)
        return await self._requests.wait(draft, stream)

    async def acaption(
        self,
        image: object,
        *,
        length: str = "normal",
        settings: dict | None = None,
        adapter: str | None = None,
        cache_salt: str | None = None,
        stream: bool = False,
    ) -> Any:
        args = (image, length, settings, adapter, cache_salt)
        draft = await asyncio.to_thread(self._drafts.caption, *args)
        return await self._requests.wait(draft, stream)

    async def apoint(
        self,
        image: object,
        object: str,
        *,
        settings: dict | None = None,
        adapter: str | None = None,
        cache_salt: str | None = None,
    ) -> Any:
        args = (image, object, settings, adapter, cache_salt)
        draft = await asyncio.to_thread(self._drafts.point, *args)
        return await self._requests.wait(draft, False)

    async def adetect(
        self,
        image: object,
        object: str,
        *,
        settings: dict | None = None,
        adapter: str | None = None,
        cache_salt: str | None = None,
    ) -> Any:
        args = (image, object, settings, adapter, cache_salt)
        draft = await asyncio.to_thread(self._drafts.detect, *args)
        return await self._requests.wait(draft, False)

    async def asegment(
        self,
        image: object,
        object: str,
        *,
        settings: dict | None = None,
        adapter: str | None = None,
        cache_salt: str | None = None,
        spatial_refs: Sequence[Sequence[float]] | None = None,
        stream: bool = False,
    ) -> Any:
        """``await engine.asegment(...)`` -> SegmentResult; with ``stream=True`` an
        AsyncTextStream: the box (a dict), then the path's text."""
        args = (image, object, settings, adapter, cache_salt, spatial_refs)
        draft = await asyncio.to_thread(self._drafts.segment, *args)
        return await self._requests.wait(draft, stream)
