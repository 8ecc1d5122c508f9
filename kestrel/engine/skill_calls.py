"""One value per skill call: what a caller asked (``QueryCall``, ``CaptionCall``, ``PointCall``,
``DetectCall``, ``SegmentCall``, ``ChatCall``), frozen, with the options every call takes
(``settings``, ``adapter``, ``cache_salt``) in their common base :class:`SkillCall`.

The Engine's public calls are made from these (:func:`face`): ``query``, ``submit_query`` and
``aquery`` each build a :class:`QueryCall` from their arguments and hand it to the request desk
(:mod:`kestrel.engine.desk`), which drafts it; their signatures are the value's fields. So an
option that every call takes (a deadline, a priority) is one field of :class:`SkillCall`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kestrel.engine.options import parameters

if TYPE_CHECKING:
    from kestrel.engine.requests import Draft, RequestFactory
    from kestrel.images import PreparedImage

__all__ = [
    "CALLS",
    "CaptionCall",
    "ChatCall",
    "DetectCall",
    "PointCall",
    "QueryCall",
    "SegmentCall",
    "SkillCall",
    "face",
    "stream_of",
]

Refs = Sequence[Sequence[float]]


@dataclass(frozen=True, slots=True, kw_only=True)
class SkillCall:
    """What every call takes: the generation ``settings`` (a dict), the LoRA ``adapter`` by
    name, and ``cache_salt`` (a tenant's string: requests with different salts never share
    cache entries)."""

    skill: ClassVar[str]
    streams: ClassVar[bool] = False  # whether the call takes ``stream=True``

    settings: dict | None = None
    adapter: str | None = None
    cache_salt: str | None = None

    def build(self, factory: RequestFactory, image: PreparedImage | None, lora: Any) -> Draft:
        """The draft of an image call (``image`` decoded, ``lora`` looked up)."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True, kw_only=True)
class AnswerCall(SkillCall):
    """A call that answers in text (query, chat): ``reasoning`` (think first), ``stop``,
    ``response_format`` and ``logprobs``."""

    streams: ClassVar[bool] = True

    reasoning: bool = False
    stop: str | Sequence[str] | None = None
    response_format: Any = None
    logprobs: int | None = None

    def answer(self) -> dict[str, Any]:
        return {"stop": self.stop, "response_format": self.response_format,
                "logprobs": self.logprobs}  # fmt: skip


@dataclass(frozen=True, slots=True)
class QueryCall(AnswerCall):
    """Answer ``question`` about ``image`` (None: text only): a QueryResult.

    ``stop``: strings that end the answer (not returned); ``response_format``: the shape the
    answer must take (a JSON schema, any JSON object, a regex, a choice; the result's
    ``parsed`` is its value; docs/structured.md); ``logprobs``: each answer token's
    log-probability and that many most likely alternatives (0 to 20); ``spatial_refs``:
    points or boxes the question refers to."""

    skill: ClassVar[str] = "query"

    image: object
    question: str
    _: KW_ONLY
    spatial_refs: Refs | None = None

    def build(self, factory: RequestFactory, image: PreparedImage | None, lora: Any) -> Draft:
        return factory.query(
            image, self.question, self.settings, lora, reasoning=self.reasoning,
            spatial_refs=self.spatial_refs, **self.answer(),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class ChatCall(AnswerCall):
    """The assistant's reply to ``messages``: a ChatResult. Message shapes and limits:
    docs/chat.md; ``stop``, ``response_format`` and ``logprobs`` as for ``query``."""

    skill: ClassVar[str] = "chat"

    messages: Sequence[Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class CaptionCall(SkillCall):
    """Caption ``image`` (``length``: "short", "normal" or "long"): a CaptionResult."""

    skill: ClassVar[str] = "caption"
    streams: ClassVar[bool] = True

    image: object
    _: KW_ONLY
    length: str = "normal"

    def build(self, factory: RequestFactory, image: PreparedImage | None, lora: Any) -> Draft:
        return factory.caption(image, self.length, self.settings, lora)


@dataclass(frozen=True, slots=True)
class RegionCall(SkillCall):
    """Point or detect: every ``object`` in ``image``."""

    image: object
    object: str

    def build(self, factory: RequestFactory, image: PreparedImage | None, lora: Any) -> Draft:
        make = factory.point if self.skill == "point" else factory.detect
        return make(image, self.object, self.settings, lora)


@dataclass(frozen=True, slots=True)
class PointCall(RegionCall):
    """The centers of every ``object`` in the image: a PointResult (coordinates in [0, 1])."""

    skill: ClassVar[str] = "point"


@dataclass(frozen=True, slots=True)
class DetectCall(RegionCall):
    """The boxes of every ``object`` in the image: a DetectResult (coordinates in [0, 1])."""

    skill: ClassVar[str] = "detect"


@dataclass(frozen=True, slots=True)
class SegmentCall(SkillCall):
    """The box and outline of ``object``: a SegmentResult (SVG path data relative to the
    box); streamed, the box (a dict) comes first, then the path's text.
    ``settings["max_tokens"]`` bounds the path. A model without the segment skill raises
    UnsupportedError (``supports_segment`` says ahead); a checkpoint without segmentation
    weights stops after the box, and the call raises NoPathError (docs/models.md)."""

    skill: ClassVar[str] = "segment"
    streams: ClassVar[bool] = True

    image: object
    object: str
    _: KW_ONLY
    spatial_refs: Refs | None = None

    def build(self, factory: RequestFactory, image: PreparedImage | None, lora: Any) -> Draft:
        return factory.segment(image, self.object, self.settings, lora,
                               spatial_refs=self.spatial_refs)  # fmt: skip


CALLS: tuple[type[SkillCall], ...] = (
    QueryCall, CaptionCall, PointCall, DetectCall, SegmentCall, ChatCall,
)  # fmt: skip

_FACES = {  # name pattern, how it answers, and how when streamed
    "submit": ("submit_{}", "Queued: returns a Future that gives the result", ""),
    "blocking": ("{}", "Blocks for the result", "; with ``stream=True`` returns a TextStream "
                 "of the deltas at once"),
    "async": ("a{}", "Awaitable: ``await`` gives the result", "; with ``stream=True`` an "
              "AsyncTextStream to ``async for`` over (then ``await stream.result()``)"),
}  # fmt: skip


def face(fn: Callable[..., Any], call: type[SkillCall], kind: str) -> Any:
    """``fn(self, *args, **kwargs)`` dressed as the ``kind`` face of ``call`` (``submit``,
    ``blocking`` or ``async``): the Engine method's name, its docstring and a signature made
    of the call's fields (and ``stream`` where the skill streams, but for a future)."""
    pattern, answers, streamed = _FACES[kind]
    streams = call.streams and kind != "submit"
    fn.__name__ = pattern.format(call.skill)
    fn.__qualname__ = f"Engine.{fn.__name__}"
    fn.__doc__ = f"{call.__doc__}\n\n    {answers}{streamed if streams else ''}."
    stream = inspect.Parameter("stream", inspect.Parameter.KEYWORD_ONLY, default=False)
    own = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = [own, *parameters(call), *([stream] if streams else [])]
    fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return fn


def stream_of(call: type[SkillCall], options: dict[str, Any]) -> bool:
    """Take ``stream`` out of a blocking or awaited call's keywords where the skill streams
    (elsewhere it stays, and the call value refuses it as the unknown keyword it is there)."""
    return bool(options.pop("stream", False)) if call.streams else False
