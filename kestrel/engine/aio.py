"""The Engine's asyncio twins: the same calls, awaitable, never blocking the event loop.

Validation, image decoding and hashing run in a worker thread (``asyncio.to_thread``); the
request then goes to the scheduler like any other, and its future is bridged into the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["AsyncTwins"]


class AsyncTwins:
    """Mixed into :class:`kestrel.Engine`; relies on its ``_draft``, ``_query_draft``,
    ``_draft_chat``, ``_factory`` and ``_await``."""

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
    ) -> Any:
        """``await engine.aquery(...)`` -> QueryResult; with ``stream=True`` an
        AsyncTextStream to ``async for`` over (then ``await stream.result()``)."""
        args = (image, question, settings, adapter, cache_salt, reasoning, spatial_refs)
        draft = await asyncio.to_thread(self._query_draft, *args)
        return await self._await(draft, stream)

    async def achat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        settings: dict | None = None,
        adapter: str | None = None,
        cache_salt: str | None = None,
        reasoning: bool = False,
        stream: bool = False,
    ) -> Any:
        """``await engine.achat(messages)`` -> ChatResult (or an AsyncTextStream)."""
        draft = await asyncio.to_thread(
            self._draft_chat, messages, settings, adapter, cache_salt, reasoning
        )
        return await self._await(draft, stream)

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
        draft = await asyncio.to_thread(
            self._draft, self._factory.caption, image, length, settings, adapter, cache_salt
        )
        return await self._await(draft, stream)

    async def apoint(
        self,
        image: object,
        object: str,
        *,
        settings: dict | None = None,
        adapter: str | None = None,
        cache_salt: str | None = None,
    ) -> Any:
        draft = await asyncio.to_thread(
            self._draft, self._factory.point, image, object, settings, adapter, cache_salt
        )
        return await self._await(draft, False)

    async def adetect(
        self,
        image: object,
        object: str,
        *,
        settings: dict | None = None,
        adapter: str | None = None,
        cache_salt: str | None = None,
    ) -> Any:
        draft = await asyncio.to_thread(
            self._draft, self._factory.detect, image, object, settings, adapter, cache_salt
        )
        return await self._await(draft, False)
