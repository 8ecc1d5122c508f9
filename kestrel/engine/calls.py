"""The Engine's blocking calls and their ``submit_*`` futures: ``query``, ``caption``, ``point``,
``detect``, ``segment``, ``chat``. Each is a face over the request desk
(:mod:`kestrel.engine.desk`): drafted on the caller's thread, then submitted."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from kestrel.engine.desk import Drafter, Submitter

__all__ = ["BlockingCalls"]


class BlockingCalls:
    """Mixed into :class:`kestrel.Engine`, whose two members it uses are
    ``_drafts`` (a :class:`~kestrel.engine.desk.Drafter`) and ``_requests`` (a
    :class:`~kestrel.engine.desk.Submitter`)."""

    _drafts: Drafter
    _requests: Submitter

    # ------------------------------------------------------------------ futures
    def submit_query(
        self,
        image: object,
        question: str,
        *,
        settings: dict | None = None,
        adapter: str | None = None,
        cache_salt: str | None = None,
        reasoning: bool = False,
        spatial_refs: Sequence[Sequence[float]] | None = None,
        stop: str | Sequence[str] | None = None,
        response_format: Any = None,
        logprobs: int | None = None,
    ) -> Future:
        """Queue a question about ``image`` (None: text only); the future gives a QueryResult."""
        d, r = self._drafts, self._requests
        answer = {"stop": stop, "response_format": response_format, "logprobs": logprobs}
        args = (image, question, settings, adapter, cache_salt, reasoning, spatial_refs)
        return r.submit(d.query(*args, **answer))

    def submit_caption(
        self,
        image: object,
        *,
        length: str = "normal",
        settings: dict | None = None,
        adapter: str | None = None,
        cache_salt: str | None = None,
    ) -> Future:
        """Queue a caption ("short", "normal" or "long"); the future gives a CaptionResult."""
        d, r = self._drafts, self._requests
        return r.submit(d.caption(image, length, settings, adapter, cache_salt))

    def submit_point(
        self,
        image: object,
        object: str,
        *,
        settings: dict | None = None,
        adapter: str | None = None,
        cache_salt: str | None = None,
    ) -> Future:
        """Queue pointing at every ``object``; the future gives a PointResult."""
        d, r = self._drafts, self._requests
        return r.submit(d.point(image, object, settings, adapter, cache_salt))

    def submit_detect(
        self,
        image: object,
        object: str,
        *,
        settings: dict | None = None,
        adapter: str | None = None,
        cache_salt: str | None = None,
    ) -> Future:
        """Queue detecting every ``object``; the future gives a DetectResult."""
        d, r = self._drafts, self._requests
        return r.submit(d.detect(image, object, settings, adapter, cache_salt))

    def submit_segment(
        self,
        image: object,
        object: str,
        *,
        settings: dict | None = None,
        adapter: str | None = None,
        cache_salt: str | None = None,
        spatial_refs: Sequence[Sequence[float]] | None = None,
    ) -> Future:
        """Queue outlining ``object``; the future gives a SegmentResult. A model without the
        segment skill raises UnsupportedError here (``supports_segment`` says ahead)."""
        d, r = self._drafts, self._requests
        return r.submit(d.segment(image, object, settings, adapter, cache_salt, spatial_refs))

    def submit_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        settings: dict | None = None,
        adapter: str | None = None,
        cache_salt: str | None = None,
        reasoning: bool = False,
        stop: str | Sequence[str] | None = None,
        response_format: Any = None,
        logprobs: int | None = None,
    ) -> Future:
        """Queue the reply to a conversation; the future gives a ChatResult."""
        d, r = self._drafts, self._requests
        answer = {"stop": stop, "response_format": response_format, "logprobs": logprobs}
        return r.submit(d.chat(messages, settings, adapter, cache_salt, reasoning, **answer))

    # ------------------------------------------------------------------ blocking calls
    def query(
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
    ):
        """Answer ``question`` (QueryResult), or with ``stream=True`` a TextStream of deltas.

        ``stop``: strings that end the answer (not returned); ``response_format``: the shape
        the answer must take (a JSON schema, any JSON object, a regex, a choice; the result's
        ``parsed`` is its value; docs/structured.md); ``logprobs``: each answer token's
        log-probability and that many most likely alternatives (0 to 20)."""
        d, r = self._drafts, self._requests
        answer = {"stop": stop, "response_format": response_format, "logprobs": logprobs}
        draft = d.query(image, question, settings, adapter, cache_salt, reasoning, spatial_refs,
                        **answer)  # fmt: skip
        return r.call(draft, stream)

    def caption(
        self,
        image: object,
        *,
        length: str = "normal",
        settings: dict | None = None,
        adapter: str | None = None,
        cache_salt: str | None = None,
        stream: bool = False,
    ):
        """Caption ``image`` (CaptionResult), or with ``stream=True`` a TextStream of deltas."""
        d, r = self._drafts, self._requests
        return r.call(d.caption(image, length, settings, adapter, cache_salt), stream)

    def point(
        self,
        image: object,
        object: str,
        *,
        settings: dict | None = None,
        adapter: str | None = None,
        cache_salt: str | None = None,
    ):
        """Centers of every ``object`` in the image (PointResult, coordinates in [0, 1])."""
        d, r = self._drafts, self._requests
        return r.call(d.point(image, object, settings, adapter, cache_salt), False)

    def detect(
        self,
        image: object,
        object: str,
        *,
        settings: dict | None = None,
        adapter: str | None = None,
        cache_salt: str | None = None,
    ):
        """Boxes of every ``object`` in the image (DetectResult, coordinates in [0, 1])."""
        d, r = self._drafts, self._requests
        return r.call(d.detect(image, object, settings, adapter, cache_salt), False)

    def segment(
        self,
        image: object,
        object: str,
        *,
        settings: dict | None = None,
        adapter: str | None = None,
        cache_salt: str | None = None,
        spatial_refs: Sequence[Sequence[float]] | None = None,
        stream: bool = False,
    ):
        """The box and outline of ``object`` (SegmentResult: SVG path data relative to the
        box), or with ``stream=True`` a TextStream: the box (a dict), then the path's text.
        ``settings["max_tokens"]`` bounds the path. A model without the segment skill raises
        UnsupportedError; a checkpoint without segmentation weights stops after the box, and
        the call raises NoPathError (docs/models.md)."""
        d, r = self._drafts, self._requests
        draft = d.segment(image, object, settings, adapter, cache_salt, spatial_refs)
        return r.call(draft, stream)

    def chat(
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
        """The assistant's reply to ``messages`` (ChatResult), or with ``stream=True`` a
        TextStream of the answer's deltas. Message shapes and limits: docs/chat.md;
        ``stop``, ``response_format`` and ``logprobs`` as for :meth:`query`."""
        d, r = self._drafts, self._requests
        answer = {"stop": stop, "response_format": response_format, "logprobs": logprobs}
        return r.call(d.chat(messages, settings, adapter, cache_salt, reasoning, **answer), stream)
