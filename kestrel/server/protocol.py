"""What the app needs of the engine it serves: :class:`ServedEngine`.

Two engines serve the same app: :class:`kestrel.Engine` (one process) and
:class:`kestrel.distributed.frontdoor.ClusterEngine` (``kestrel serve --ray``: replicas behind a
router). The routes use these members and nothing else; ``tests/server/test_served_engine.py``
holds both classes to this protocol.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, runtime_checkable

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "MEMBERS",
    "CallOptions",
    "ModelFacts",
    "ServedEngine",
    "StatsSnapshot",
    "call_options",
    "missing_members",
]


class CallOptions(TypedDict, total=False):
    """The keyword arguments every call takes: the generation ``settings`` (a dict, as the
    Engine's calls take it), the LoRA ``adapter`` by name, the tenant's ``cache_salt`` (the
    fields of the Engine's :class:`~kestrel.engine.skill_calls.SkillCall`; a test holds the
    two to the same names)."""

    settings: dict | None
    adapter: str | None
    cache_salt: str | None


class ModelFacts(Protocol):
    """What the app reads of the served model's configuration."""

    @property
    def family(self) -> str | None:
        """``moondream2`` / ``moondream3`` (None: not known)."""
        ...


class StatsSnapshot(Protocol):
    """An engine snapshot (:class:`kestrel.results.EngineStats` or the cluster's sum): the
    fields ``/metrics`` exports, and its JSON body for ``/v1/stats``."""

    def to_dict(self) -> dict[str, Any]: ...


@runtime_checkable
class ServedEngine(Protocol):
    """The engine behind the app.

    Model facts: ``model_path`` (the served name comes from it), ``config.family``. Limits:
    ``max_batch_size`` (the default admission queue is 4x it), ``exif_orientation`` (how the
    app decodes images). Capabilities: ``supports_segment``; an engine that cannot segment
    still has ``asegment``, which raises :class:`kestrel.errors.UnsupportedError` naming why
    (HTTP 501). The calls are the Engine's asyncio twins: each returns the result, or with
    ``stream=True`` a stream (``async for`` its deltas, then ``await stream.result()``,
    ``cancel()``); each takes the :class:`CallOptions`; errors are
    :class:`kestrel.errors.KestrelError` subclasses.
    """

    model_path: str | Path | None
    config: ModelFacts
    max_batch_size: int
    exif_orientation: bool

    @property
    def closed(self) -> bool: ...

    @property
    def supports_segment(self) -> bool: ...

    def adapters(self) -> list[str]: ...

    def stats(self) -> StatsSnapshot:
        """Blocking: the app calls it in a worker thread."""
        ...

    async def aquery(
        self,
        image: object,
        question: str,
        *,
        reasoning: bool = False,
        spatial_refs: Sequence[Sequence[float]] | None = None,
        stream: bool = False,
        **options: Unpack[CallOptions],
    ) -> Any: ...

    async def acaption(
        self,
        image: object,
        *,
        length: str = "normal",
        stream: bool = False,
        **options: Unpack[CallOptions],
    ) -> Any: ...

    async def apoint(self, image: object, object: str, **options: Unpack[CallOptions]) -> Any: ...

    async def adetect(self, image: object, object: str, **options: Unpack[CallOptions]) -> Any: ...

    async def asegment(
        self,
        image: object,
        object: str,
        *,
        spatial_refs: Sequence[Sequence[float]] | None = None,
        stream: bool = False,
        **options: Unpack[CallOptions],
    ) -> Any: ...

    async def achat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        reasoning: bool = False,
        stream: bool = False,
        **options: Unpack[CallOptions],
    ) -> Any: ...


MEMBERS = (
    "model_path", "config", "max_batch_size", "exif_orientation", "closed", "supports_segment",
    "adapters", "stats", "aquery", "acaption", "apoint", "adetect", "asegment", "achat",
)  # fmt: skip


def call_options(call: object) -> CallOptions:
    """The :class:`CallOptions` a parsed request carries: its attributes of those names (so an
    option every call takes is passed on by every route once the payloads parse it)."""
    return {name: getattr(call, name) for name in CallOptions.__annotations__}  # type: ignore[return-value]


def missing_members(engine: object) -> list[str]:
    """The members of :class:`ServedEngine` that ``engine`` lacks (empty: it has them all).
    Looked up as attributes, so an engine that forwards to another one qualifies."""
    return [m for m in MEMBERS if not hasattr(engine, m)]
