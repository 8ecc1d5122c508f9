"""The Engine's asyncio twins (``aquery``, ``acaption``, ...): the same calls, awaitable, never
blocking the event loop.

Validation, image decoding and hashing run in a worker thread (``asyncio.to_thread``); the
request then goes to the scheduler like any other, and its future is bridged into the loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kestrel.engine.skill_calls import SkillCall, face, stream_of

__all__ = ["awaiting"]


def awaiting(call: type[SkillCall]) -> Any:
    """The ``a*`` twin of ``call``'s skill: ``await engine.aquery(...)`` -> the result; where
    the skill streams, ``stream=True`` gives an AsyncTextStream (then ``await
    stream.result()``). Its owner has the Engine's ``_drafts`` and ``_requests``."""

    async def method(self: Any, *args: Any, **options: Any) -> Any:
        stream = stream_of(call, options)
        value = call(*args, **options)
        draft = await asyncio.to_thread(self._drafts.draft, value)
        return await self._requests.wait(draft, stream)

    return face(method, call, "async")
