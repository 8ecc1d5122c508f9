"""The front door of ``kestrel serve --ray``: a ServedEngine over replica deployments.

:class:`ClusterEngine` is a :class:`~kestrel.server.protocol.ServedEngine`, as the Engine is:
the asyncio calls (``aquery``, ``acaption``, ``apoint``, ``adetect``, ``asegment``, ``achat``),
``stats``, ``adapters``, the model facts, limits and capabilities the app reads. So
``kestrel.server.create_app(ClusterEngine(...))`` is the very app of ``kestrel serve``: the
same routes, payloads, limits, API key and error bodies. The app parses and decodes each
request once (an image becomes a :class:`~kestrel.images.PreparedImage`: pixels and their
SHA-256 digest); each call here takes the routing key from it (a chat: its first image), asks
the :class:`~kestrel.distributed.ring.Router` for a replica and forwards the call, prepared
image included, through that replica's Serve handle.

A replica that dies fails only the requests in flight on it: each gets
:class:`ReplicaLostError` (HTTP 503 with ``Retry-After``), the replica leaves the ring at once
and its keys go to the next replica; the :class:`~kestrel.distributed.serve_cluster.HealthMonitor`
puts it back when Serve has restarted it and its model is loaded.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import (
    DeploymentUnavailableError,
    ReplicaUnavailableError,
    RequestCancelledError,
)

from kestrel.errors import EngineClosedError, KestrelError
from kestrel.images import PreparedImage
from kestrel.server.errors import ApiError

from .ring import NoReplicaError, Router
from .serve_replica import Failure, Final
from .serve_stats import ClusterStats, cluster_stats

__all__ = ["ClusterEngine", "ReplicaLink", "ReplicaLostError", "ServedModel", "routing_key"]

log = logging.getLogger("kestrel.distributed")
# What a call through a handle raises when its replica's process is gone or going.
LOST = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)
_STATS_TIMEOUT_S = 10.0


class ReplicaLostError(ApiError, EngineClosedError):
    """The replica running a request died (or none is live): HTTP 503 with ``Retry-After``.
    An :class:`ApiError` (its status and headers) that is also an engine error, so a stream
    whose replica dies reports it the way it reports any engine failure."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        headers = {"Retry-After": str(retry_after_s)}
        super().__init__(503, "replica_unavailable", message, headers)


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the app reads from ``engine.config``: the served model's family."""

    family: str | None


@dataclass(slots=True)
class ReplicaLink:
    """One replica deployment: its stable ``name`` (the ring's node), its Serve handle, and
    what it said about itself (``describe()``: process, model, adapters), renewed on return."""

    name: str
    handle: Any
    info: dict[str, Any] = field(default_factory=dict)


def routing_key(image: object, text: object = None) -> bytes:
    """A request's key: its image's digest, else a digest of its text."""
    if isinstance(image, PreparedImage):
        return image.digest
    blob = json.dumps(text, sort_keys=True, default=str).encode()
    return hashlib.sha256(b"text:" + blob).digest()


def _chat_key(messages: Sequence[Mapping[str, Any]]) -> bytes:
    """A conversation goes by its first image (every turn repeats it); none: its first message."""
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, Mapping) and isinstance(part.get("image"), PreparedImage):
                return part["image"].digest
    return routing_key(None, messages[0] if messages else None)


def _cancel_soon(response: Any) -> None:
    """Cancel a Serve call without blocking the event loop (``cancel`` may wait for the
    request to be assigned to its replica)."""
    try:
        asyncio.get_running_loop().run_in_executor(None, response.cancel)
    except RuntimeError:  # no running loop
        response.cancel()


class ClusterEngine:
    """A :class:`~kestrel.server.protocol.ServedEngine` over replica deployments (see the module
    docstring)."""

    def __init__(self, links: Sequence[ReplicaLink], router: Router, *, retry_after_s: int = 1):
        if not links:
            raise ValueError("a ClusterEngine needs at least one replica")
        self.links = {link.name: link for link in links}
        self.router = router
        self.retry_after_s = retry_after_s
        first = links[0].info
        self.model_path = first.get("model_path")
        self.config = ServedModel(first.get("family"))
        self.max_batch_size = int(first.get("max_batch_size", 16)) * len(links)
        self.exif_orientation = bool(first.get("exif_orientation", True))
        self._adapters = list(first.get("adapters", []))
        self.supports_segment = bool(first.get("segment", False))
        self._closed = False
        self.last_stats: ClusterStats | None = None

    # ------------------------------------------------------------------ the ServedEngine members
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True

    def adapters(self) -> list[str]:
        return list(self._adapters)

    async def aquery(self, image: object, question: str, *, stream: bool = False, **kw: Any):
        return await self._dispatch("query", routing_key(image, question), (image, question),
                                    kw, stream)  # fmt: skip

    async def acaption(self, image: object, *, stream: bool = False, **kw: Any):
        return await self._dispatch("caption", routing_key(image), (image,), kw, stream)

    async def apoint(self, image: object, object: str, **kw: Any):
        return await self._dispatch("point", routing_key(image, object), (image, object), kw)

    async def adetect(self, image: object, object: str, **kw: Any):
        return await self._dispatch("detect", routing_key(image, object), (image, object), kw)

    async def asegment(self, image: object, object: str, *, stream: bool = False, **kw: Any):
        """Forwarded whatever ``supports_segment`` says: a replica's engine that cannot segment
        raises the UnsupportedError that Engine raises, in the same words."""
        return await self._dispatch("segment", routing_key(image, object), (image, object), kw,
                                    stream)  # fmt: skip

    async def achat(self, messages: Sequence[Mapping[str, Any]], *, stream: bool = False, **kw):
        return await self._dispatch("chat", _chat_key(messages), (messages,), kw, stream)

    def stats(self) -> ClusterStats:
        """Every replica's snapshot (a replica that does not answer is listed as down) and
        their sum; blocking (the app calls it in a worker thread)."""
        snap = self.router.snapshot()
        pending = {n: self.links[n].handle.stats.remote() for n, up in snap.live.items() if up}
        found: dict[str, dict[str, Any] | None] = {}
        deadline = time.monotonic() + _STATS_TIMEOUT_S  # for all of them together
        for name in self.links:
            response = pending.get(name)
            try:
                wait = max(0.01, deadline - time.monotonic())
                found[name] = None if response is None else response.result(timeout_s=wait)
            except Exception:  # dead or stuck: reported as down, not as an error
                found[name] = None
        self.last_stats = cluster_stats(found, snap)
        return self.last_stats

    # ------------------------------------------------------------------ routing
    def _begin(self, key: bytes) -> str:
        if self._closed:
            raise EngineClosedError("the server is shutting down")
        try:
            return self.router.begin(key)
        except NoReplicaError as exc:
            raise ReplicaLostError(f"{exc}; retry shortly", self.retry_after_s) from None

    def lost(self, name: str, exc: BaseException) -> ReplicaLostError:
        """Take ``name`` off the ring (the monitor puts it back) and make its requests' 503."""
        if self.router.set_live(name, False):
            log.warning("replica %s lost (%s); its keys move to the next replica",
                        name, type(exc).__name__)  # fmt: skip
        message = f"replica {name} was lost while running this request; retry"
        return ReplicaLostError(message, self.retry_after_s)

    async def _dispatch(
        self, skill: str, key: bytes, args: tuple, kw: dict[str, Any], stream: bool = False
    ) -> Any:
        name = self._begin(key)
        if stream:
            return await self._streamed(name, skill, args, kw)
        try:
            response = self.links[name].handle.call.remote(skill, args, kw)
            try:
                out = await response
            except asyncio.CancelledError:  # the client left: stop the replica's work too
                _cancel_soon(response)
                raise
        except LOST as exc:
            raise self.lost(name, exc) from None
        finally:
            self.router.end(name)
        if isinstance(out, Failure):
            raise out.error
        return out

    async def _streamed(self, name: str, skill: str, args: tuple, kw: dict[str, Any]) -> Any:
        try:
            relay = RelayStream(self, name, skill, args, kw)
        except BaseException as exc:
            self.router.end(name)
            if isinstance(exc, LOST):
                raise self.lost(name, exc) from None
            raise
        try:
            await relay.prime()
        except BaseException:
            relay.cancel()
            raise
        return relay


class RelayStream:
    """A replica's stream, relayed: ``async for delta in stream``, then ``await
    stream.result()``; ``cancel()`` stops it on the replica. The front door counts it in
    flight on its replica until it ends, fails or is cancelled."""

    def __init__(self, door: ClusterEngine, name: str, skill: str, args: tuple, kw: dict) -> None:
        self._door = door
        self._name = name
        handle = door.links[name].handle.options(stream=True)
        self._gen = handle.stream.remote(skill, args, kw)
        self._first: Any = None
        self._result: Any = None
        self._ended = False

    def _end(self, cancel: bool) -> None:
        if self._ended:
            return
        self._ended = True
        self._door.router.end(self._name)
        if cancel:
            _cancel_soon(self._gen)

    async def _next(self) -> Any:
        try:
            item = await self._gen.__anext__()
        except StopAsyncIteration:
            raise KestrelError("the replica's stream ended without a result") from None
        except RequestCancelledError as exc:
            if self._ended:  # cancelled here (the client left): end quietly, as a cancellation
                raise asyncio.CancelledError from None
            raise self._door.lost(self._name, exc) from None  # cancelled by its replica's end
        except LOST as exc:
            raise self._door.lost(self._name, exc) from None
        if isinstance(item, Failure):
            raise item.error
        return item

    async def prime(self) -> None:
        """Wait for the first item, so an error before any text raises from the call."""
        self._first = await self._next()

    async def _iterate(self) -> AsyncIterator[str]:
        finished = False
        try:
            item = self._first
            while not isinstance(item, Final):
                yield item
                item = await self._next()
            self._result = item.result
            finished = True
        finally:
            self._end(cancel=not finished)

    def __aiter__(self) -> AsyncIterator[str]:
        return self._iterate()

    async def result(self) -> Any:
        if self._result is None:
            async for _ in self._iterate():
                pass
        return self._result

    def cancel(self) -> bool:
        done = self._ended
        self._end(cancel=True)
        return not done
