"""The Engine's calls: for each skill (``query``, ``caption``, ``point``, ``detect``,
``segment``, ``chat``) a blocking call, its ``submit_*`` future and its ``a*`` asyncio twin
(``aio.py``). Each is a face over the request desk (:mod:`kestrel.engine.desk`): its arguments
make the skill's call value (:mod:`kestrel.engine.skill_calls`), drafted on the caller's
thread, then submitted. A call's keywords and signature are its value's fields."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kestrel.engine.aio import awaiting
from kestrel.engine.desk import Drafter, Submitter
from kestrel.engine.skill_calls import (
    CaptionCall,
    ChatCall,
    DetectCall,
    PointCall,
    QueryCall,
    SegmentCall,
    SkillCall,
    face,
    stream_of,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from kestrel.engine.streams import AsyncTextStream, TextStream
    from kestrel.results import (
        CaptionResult,
        ChatResult,
        DetectResult,
        PointResult,
        QueryResult,
        SegmentResult,
    )

__all__ = ["SkillCalls", "faces"]


def _submitting(call: type[SkillCall]) -> Any:
    def method(self: Any, *args: Any, **options: Any) -> Future:
        value = call(*args, **options)  # an unknown keyword: a TypeError, as for any call
        return self._requests.submit(self._drafts.draft(value))

    return face(method, call, "submit")


def _blocking(call: type[SkillCall]) -> Any:
    def method(self: Any, *args: Any, **options: Any) -> Any:
        stream = stream_of(call, options)
        value = call(*args, **options)
        return self._requests.call(self._drafts.draft(value), stream)

    return face(method, call, "blocking")


def faces(call: type[SkillCall]) -> tuple[Any, Any, Any]:
    """``call``'s three methods: ``submit_<skill>``, ``<skill>`` and ``a<skill>``."""
    return _submitting(call), _blocking(call), awaiting(call)


class SkillCalls:
    """Mixed into :class:`kestrel.Engine`, whose two members it uses are ``_drafts`` (a
    :class:`~kestrel.engine.desk.Drafter`) and ``_requests`` (a
    :class:`~kestrel.engine.desk.Submitter`). ``help(Engine.query)`` gives a call's
    arguments; every call takes ``settings``, ``adapter`` and ``cache_salt``."""

    _drafts: Drafter
    _requests: Submitter

    # What each face gives, for type checkers and editors (their keywords are the call values'
    # fields: ``help(Engine.query)`` lists them).
    submit_query: Callable[..., Future[QueryResult]]
    query: Callable[..., QueryResult | TextStream]
    aquery: Callable[..., Awaitable[QueryResult | AsyncTextStream]]
    submit_caption: Callable[..., Future[CaptionResult]]
    caption: Callable[..., CaptionResult | TextStream]
    acaption: Callable[..., Awaitable[CaptionResult | AsyncTextStream]]
    submit_point: Callable[..., Future[PointResult]]
    point: Callable[..., PointResult]
    apoint: Callable[..., Awaitable[PointResult]]
    submit_detect: Callable[..., Future[DetectResult]]
    detect: Callable[..., DetectResult]
    adetect: Callable[..., Awaitable[DetectResult]]
    submit_segment: Callable[..., Future[SegmentResult]]
    segment: Callable[..., SegmentResult | TextStream]
    asegment: Callable[..., Awaitable[SegmentResult | AsyncTextStream]]
    submit_chat: Callable[..., Future[ChatResult]]
    chat: Callable[..., ChatResult | TextStream]
    achat: Callable[..., Awaitable[ChatResult | AsyncTextStream]]

    submit_query, query, aquery = faces(QueryCall)
    submit_caption, caption, acaption = faces(CaptionCall)
    submit_point, point, apoint = faces(PointCall)
    submit_detect, detect, adetect = faces(DetectCall)
    submit_segment, segment, asegment = faces(SegmentCall)
    submit_chat, chat, achat = faces(ChatCall)
