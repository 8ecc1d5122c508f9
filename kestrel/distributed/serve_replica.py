"""One replica of ``kestrel serve --ray``: a Ray Serve deployment holding one :class:`Engine`.

The front door (:mod:`kestrel.distributed.frontdoor`) has already parsed, validated and decoded
the request; what arrives here is the Engine call itself, its image a
:class:`~kestrel.images.PreparedImage` (pixels and digest), which the engine uses as it is:
nothing is decoded or hashed again. An engine error comes back as a :class:`Failure` value
rather than a raised exception, so its message reaches the client as the engine wrote it (Ray
would wrap a raised one in a traceback). A streamed call yields the text deltas, then one
:class:`Final` (or a :class:`Failure`).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kestrel.errors import KestrelError

from .replica import ReplicaOptions

__all__ = ["SKILL_METHODS", "EngineReplica", "Failure", "Final"]

# Front-door skill -> the Engine's asyncio method.
SKILL_METHODS = {
    "query": "aquery",
    "caption": "acaption",
    "point": "apoint",
    "detect": "adetect",
    "chat": "achat",
    "segment": "asegment",  # an engine that cannot segment raises UnsupportedError
}


@dataclass(frozen=True, slots=True)
class Failure:
    """An engine error, carried back as a value (the front door raises it again)."""

    error: KestrelError


@dataclass(frozen=True, slots=True)
class Final:
    """The last item of a stream: the finished request's result."""

    result: Any


class EngineReplica:
    """The deployment's class: ``serve.deployment(EngineReplica).bind(options)``."""

    def __init__(self, options: ReplicaOptions) -> None:
        self.engine, self.name = options.open_engine()

    def describe(self) -> dict[str, Any]:
        """Who this replica is and what it serves (the front door's health probe, too)."""
        e = self.engine
        return {
            "name": self.name,
            "pid": os.getpid(),
            "model_path": str(e.model_path),
            "family": e.config.family,
            "adapters": e.adapters(),
            "max_batch_size": e.max_batch_size,
            "exif_orientation": e.exif_orientation,
            "segment": e.supports_segment,
        }

    async def call(self, skill: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """One blocking Engine call; an engine error is returned as a :class:`Failure`."""
        method = getattr(self.engine, SKILL_METHODS[skill])
        try:
            return await method(*args, **kwargs)
        except KestrelError as exc:
            return Failure(exc)

    async def stream(self, skill: str, args: tuple, kwargs: dict[str, Any]) -> AsyncIterator[Any]:
        """One streamed Engine call: the text deltas, then :class:`Final` or :class:`Failure`.
        Closing the generator early (the client left) cancels the engine request."""
        method = getattr(self.engine, SKILL_METHODS[skill])
        try:
            stream = await method(*args, stream=True, **kwargs)
            async for delta in stream:
                yield delta
            result = await stream.result()
        except KestrelError as exc:
            yield Failure(exc)
            return
        yield Final(result)

    def stats(self) -> dict[str, Any]:
        """The engine's snapshot, with the prompt positions behind its hit rate and the vision
        encoder runs (the runtime's cumulative counters), and this replica's process."""
        body = self.engine.stats().to_dict()
        counters = self.engine.runtime.counters
        body.update(
            name=self.name,
            prompt_tokens=counters.prompt_tokens,
            vision_encodes=counters.vision_encodes,
        )
        return body

    def __del__(self) -> None:  # Serve tears the replica down: stop the scheduler thread
        engine = getattr(self, "engine", None)
        if engine is not None and not engine.closed:
            engine.close()
