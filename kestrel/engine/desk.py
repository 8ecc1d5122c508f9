"""The Engine's request desk: a public call's input checked and drafted on the caller's thread
(:class:`Drafter`), then handed to the scheduler thread and answered: a result, a future, or a
stream (:class:`Submitter`).

Everything each needs comes in through its constructor. The Drafter: the request factory
(skills, prompts, budgets), the adapter registry, the reply memory of conversations, the Engine's
image decoder and whether the engine is closed. The Submitter: the scheduler loop and the crop
pool. The Engine's call methods and its asyncio twins are thin faces over the two.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from kestrel.crops.pool import CropPool
from kestrel.engine.adapters import AdapterRegistry
from kestrel.engine.chat import parse_messages
from kestrel.engine.replies import ReplyMemory
from kestrel.engine.requests import Draft, RequestFactory, salted
from kestrel.engine.skill_calls import ChatCall, SkillCall
from kestrel.engine.streams import AsyncTextStream, TextStream
from kestrel.errors import EngineClosedError
from kestrel.images import PreparedImage
from kestrel.runtime.embeddings import ImageEmbeddings
from kestrel.scheduler import Request
from kestrel.scheduler.loop import SchedulerLoop

__all__ = ["Drafter", "Submitter"]


def _images(image: PreparedImage | tuple[PreparedImage, ...] | None) -> tuple[PreparedImage, ...]:
    """A draft's images: none, one, or a conversation's tuple."""
    if image is None:
        return ()
    return image if isinstance(image, tuple) else (image,)


@dataclass(frozen=True, slots=True, eq=False)
class Drafter:
    """Drafts (validated requests) from a call's value, on the caller's thread: ``prepare``
    decodes an image, ``closed`` says whether the engine is closed."""

    factory: RequestFactory
    adapters: AdapterRegistry
    replies: ReplyMemory
    prepare: Callable[[object], PreparedImage]
    closed: Callable[[], bool]

    def draft(self, call: SkillCall) -> Draft:
        """Validate, decode and tokenize ``call`` on the caller's thread: its adapter looked
        up, its image (or a conversation's images) decoded, its salt checked last."""
        self.check_open()
        if isinstance(call, ChatCall):
            return salted(self._chat(call), call.cache_salt)
        lora = self.adapters.get(call.adapter)
        image = getattr(call, "image", None)  # every call's but a chat's (above)
        prepared = None if image is None else self.prepare(image)
        return salted(call.build(self.factory, prepared, lora), call.cache_salt)

    def _chat(self, call: ChatCall) -> Draft:
        conversation = parse_messages(call.messages, self.prepare)
        lora = self.adapters.get(call.adapter)
        first = conversation.image
        # the cache namespace's identity: replies are replayed only where they were retained
        key = (getattr(lora, "lora_id", None), call.cache_salt, first.digest if first else None)
        placed = conversation.placed(self.factory.config.image_tokens)
        turns = self.replies.replay(key, placed)
        images = tuple(image for _, image in conversation.images) or None
        draft = self.factory.chat(turns, images, call.settings, lora, reasoning=call.reasoning,
                                  **call.answer())  # fmt: skip
        return replace(draft, build_result=self.replies.recording(key, draft.build_result))

    def check_open(self) -> None:
        if self.closed():
            raise EngineClosedError("the engine is closed")


class Submitter:
    """Hands drafts to the scheduler loop, with their images' crops started in the pool
    (except an image whose embedding the tier holds: its prefill needs no crops)."""

    def __init__(self, loop: SchedulerLoop, crops: CropPool, embeddings: ImageEmbeddings) -> None:
        self.loop = loop
        self.crops = crops
        self.embeddings = embeddings
        self._ids = itertools.count(1)

    def submit(self, draft: Draft, on_text: Callable[[Any], None] | None = None) -> Future:
        """Queue ``draft``; the future gives its result. ``on_text`` gets the streamed deltas
        (shaped by the draft's ``deltas``, when it has one)."""
        future: Future = Future()
        if on_text is not None and draft.deltas is not None:
            on_text = draft.deltas(on_text)
        request = Request(
            request_id=next(self._ids),
            skill=draft.skill,
            image=draft.image,
            adapter=draft.adapter,
            cache_salt=draft.cache_salt,
            prompt_positions=draft.prompt_positions,
            max_new_tokens=draft.max_new_tokens,
            future=future,
            build_result=draft.build_result,
            submitted_at=time.perf_counter(),
            on_text=on_text,
        )
        # The image's crops start now, off the scheduler thread, and are let go when it ends;
        # none for an image whose embedding is cached (its prefill needs no crops).
        salt = draft.cache_salt
        images = [im for im in _images(draft.image) if not self.embeddings.cached(im, salt)]
        hold = self.crops.hold(images, skip_recent=True)
        future.add_done_callback(hold.release)
        try:
            self.loop.submit(request)
        except BaseException:
            hold.release()
            raise
        return future

    def call(self, draft: Draft, stream: bool) -> Any:
        """A blocking call's answer: the result, or with ``stream`` a TextStream of deltas."""
        if stream:
            return self._stream(draft, TextStream())
        return self.submit(draft).result()

    async def wait(self, draft: Draft, stream: bool) -> Any:
        """An awaited call's answer: the result, or with ``stream`` an AsyncTextStream."""
        if stream:
            return self._stream(draft, AsyncTextStream(asyncio.get_running_loop()))
        return await asyncio.wrap_future(self.submit(draft))

    def _stream(self, draft: Draft, stream: TextStream | AsyncTextStream):
        stream.attach(self.submit(draft, on_text=stream.push))
        return stream
