"""Turning public calls into scheduler work, and finished skills into results.

Runs on the caller's thread: validation, tokenization (the skill builds its prompt) and the
budget arithmetic all happen before a request reaches the scheduler, so bad input fails only
its own call and never costs the scheduler anything.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kestrel.errors import InvalidInputError, PromptTooLongError, UnsupportedError
from kestrel.grammar import Grammars, GrammarSpec, parse_response_format
from kestrel.images import PreparedImage
from kestrel.moondream.config import MoondreamConfig
from kestrel.moondream.region import SpatialRefError
from kestrel.results import (
    CaptionResult,
    ChatResult,
    DetectResult,
    PointResult,
    QueryResult,
    Reasoning,
    RequestMetrics,
    SegmentResult,
    TextDelta,
    TokenLogprob,
)
from kestrel.skills import (
    CaptionSkill,
    ChatSkill,
    ChatTurn,
    DetectSkill,
    PointSkill,
    QuerySkill,
    RegionSkill,
    Skill,
    SkillOps,
    family_settings,
    parse_settings,
)
from kestrel.skills.segment import SegmentSkill, unsupported_reason
from kestrel.skills.stops import parse_stop
from kestrel.tokens import kv_length

__all__ = ["Draft", "RequestFactory", "salted"]

BuildResult = Callable[[Any, RequestMetrics], Any]
# How a stream's text deltas reach the caller: given the caller's push, the scheduler's on_text.
Deltas = Callable[[Callable[[Any], None]], Callable[[str], None]]


@dataclass(frozen=True, slots=True, eq=False)
class Draft:
    """A validated request, not yet submitted."""

    skill: Skill
    image: PreparedImage | None
    adapter: Any
    prompt_positions: int
    max_new_tokens: int
    build_result: BuildResult
    cache_salt: str | None = None
    deltas: Deltas | None = None  # None: the text deltas go to the caller as they are


MAX_SALT_CHARS = 256


def salted(draft: Draft, cache_salt: object) -> Draft:
    """The draft in the tenant namespace of ``cache_salt`` (None: the shared one)."""
    if cache_salt is None:
        return draft
    if not isinstance(cache_salt, str) or not cache_salt or len(cache_salt) > MAX_SALT_CHARS:
        raise InvalidInputError(
            f"cache_salt must be a non-empty string of at most {MAX_SALT_CHARS} characters"
        )
    return replace(draft, cache_salt=cache_salt)


def _reasoning(skill: QuerySkill) -> Reasoning | None:
    out = skill.reasoning_output()
    if out is None:
        return None
    text, chunks = out
    grounding = tuple(
        {
            "start_idx": c.start_idx,
            "end_idx": c.end_idx,
            "points": [{"x": x, "y": y} for x, y in c.points],
        }
        for c in chunks
    )
    return Reasoning(text, grounding)


MAX_TOP_LOGPROBS = 20


def _logprobs(value: object) -> int:
    """A call's ``logprobs``: None (off, -1), or how many alternatives each token lists."""
    if value is None:
        return -1
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"logprobs must be an integer or None, got {value!r}")
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidInputError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
    return value


def _token(ops: Any, token_id: int, logprob: float) -> TokenLogprob:
    raw = ops.token_bytes(token_id)
    return TokenLogprob(token_id, raw.decode("utf-8", errors="replace"), raw, logprob)


def _logprob_values(ops: Any, found: Sequence) -> tuple[TokenLogprob, ...]:
    return tuple(
        replace(_token(ops, i, lp), top=tuple(_token(ops, j, lq) for j, lq in top))
        for i, lp, top in found
    )


def _token_logprobs(skill: QuerySkill) -> tuple[TokenLogprob, ...] | None:
    found = skill.answer_logprobs()
    return None if found is None else _logprob_values(skill.ops, found)


def _logprob_deltas(skill: QuerySkill) -> Deltas:
    """A stream's deltas as ``TextDelta``s, each with the logprobs of the tokens it shows."""

    def shape(push: Callable[[Any], None]) -> Callable[[str], None]:
        def on_text(delta: str) -> None:
            push(TextDelta(delta, _logprob_values(skill.ops, skill.take_logprobs())))

        return on_text

    return shape


def _answer(skill: QuerySkill, spec: GrammarSpec | None) -> dict[str, Any]:
    """The answer fields of a query or chat result: text, parsed value, log-probabilities."""
    text = skill.answer_text()
    return {
        "parsed": None if spec is None else spec.parse(text),
        "logprobs": _token_logprobs(skill),
        "text": text,
    }


def _answer_result(
    kind: type[QueryResult] | type[ChatResult],
    skill: QuerySkill,
    metrics: RequestMetrics,
    spec: GrammarSpec | None = None,
) -> Any:
    """A query's or chat's result (``kind``): the answer, its reasoning and its fields."""
    a = _answer(skill, spec)
    return kind(
        a.pop("text"), _reasoning(skill), skill.finish_reason, skill.output_tokens(), metrics, **a
    )


def _caption_result(skill: CaptionSkill, metrics: RequestMetrics) -> CaptionResult:
    return CaptionResult(skill.answer_text(), skill.finish_reason, skill.output_tokens(), metrics)


def _point_result(skill: RegionSkill, metrics: RequestMetrics) -> PointResult:
    return PointResult(skill.results(), skill.finish_reason, skill.output_tokens(), metrics)


def _detect_result(skill: RegionSkill, metrics: RequestMetrics) -> DetectResult:
    return DetectResult(skill.results(), skill.finish_reason, skill.output_tokens(), metrics)


def _segment_result(skill: SegmentSkill, metrics: RequestMetrics) -> SegmentResult:
    parts = skill.result()  # NoPathError when the model stopped after the box
    return SegmentResult(
        parts.path, parts.bbox, skill.finish_reason, skill.output_tokens(), metrics
    )


def _box_first(skill: SegmentSkill) -> Deltas:
    """A segment stream's deltas: the box (a dict) once decoded, then the path's text."""

    def shape(push: Callable[[Any], None]) -> Callable[[str], None]:
        sent = False

        def on_text(delta: str) -> None:
            nonlocal sent
            if not sent and skill.bbox is not None:
                sent = True
                push(dict(skill.bbox))
            push(delta)

        return on_text

    return shape


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise InvalidInputError(f"{what} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise InvalidInputError(f"{what} must not be empty")
    return value


class RequestFactory:
    """Builds drafts for one model: ``ops`` runs the skills, ``config`` gives the sizes."""

    def __init__(self, ops: SkillOps, config: MoondreamConfig) -> None:
        self.ops = ops
        self.config = config
        self.defaults = family_settings(config.family)  # the family's sampling defaults
        self._grammars: Grammars | None = None

    @property
    def grammars(self) -> Grammars:
        """The model's compiled grammars (made on the first constrained call)."""
        if self._grammars is None:
            tokenizer = self.ops.tokenizer  # type: ignore[attr-defined]
            self._grammars = Grammars(
                tokenizer.to_json, self.config.text.vocab_size, self.config.tokenizer.eos_id
            )
        return self._grammars

    def answer_options(
        self, stop: object, response_format: object, logprobs: object
    ) -> tuple[dict[str, Any], GrammarSpec | None]:
        """A query's or chat's answer options, checked (a grammar compiled) on the caller's
        thread: the skill's ``stop``, ``constraint`` and ``logprobs``, and the spec."""
        spec = parse_response_format(response_format)
        options = {
            "stop": parse_stop(stop),
            "logprobs": _logprobs(logprobs),
            "constraint": None if spec is None else self.grammars.row(spec),
        }
        return options, spec

    def query(
        self,
        image: PreparedImage | None,
        question: object,
        settings: object,
        adapter: Any,
        *,
        reasoning: bool,
        spatial_refs: Sequence[Sequence[float]] | None,
        stop: object = None,
        response_format: object = None,
        logprobs: object = None,
    ) -> Draft:
        question = _text(question, "question")
        s = parse_settings(settings, self.defaults)
        answer, spec = self.answer_options(stop, response_format, logprobs)
        try:
            skill = QuerySkill(
                self.ops, question, s, reasoning=bool(reasoning), spatial_refs=spatial_refs,
                **answer,
            )  # fmt: skip
        except SpatialRefError as exc:
            raise InvalidInputError(str(exc)) from exc
        build = functools.partial(_answer_result, QueryResult, spec=spec)
        return self._answer_draft(skill, image, adapter, build)

    def chat(
        self,
        turns: Sequence[ChatTurn],
        images: tuple[PreparedImage, ...] | None,
        settings: object,
        adapter: Any,
        *,
        reasoning: bool,
        stop: object = None,
        response_format: object = None,
        logprobs: object = None,
    ) -> Draft:
        """A conversation (validated turns, see :mod:`kestrel.engine.chat`) awaiting a reply."""
        s = parse_settings(settings, self.defaults)
        answer, spec = self.answer_options(stop, response_format, logprobs)
        skill = ChatSkill(self.ops, turns, s, reasoning=bool(reasoning), **answer)
        build = functools.partial(_answer_result, ChatResult, spec=spec)
        return self._answer_draft(skill, images, adapter, build)

    def _answer_draft(self, skill: QuerySkill, image: Any, adapter: Any, build) -> Draft:
        draft = self._draft(skill, image, adapter, build)
        if skill.answer.logprobs < 0:
            return draft
        return replace(draft, deltas=_logprob_deltas(skill))

    def caption(self, image: PreparedImage | None, length: object, settings, adapter) -> Draft:
        if image is None:
            raise InvalidInputError("caption needs an image")
        if not isinstance(length, str):
            raise InvalidInputError(f"caption length must be a string, got {length!r}")
        skill = CaptionSkill(self.ops, length, parse_settings(settings, self.defaults))
        return self._draft(skill, image, adapter, _caption_result)

    def point(self, image: PreparedImage | None, obj: object, settings, adapter) -> Draft:
        obj, max_objects = self._region_input("point", image, obj, settings)
        return self._draft(PointSkill(self.ops, obj, max_objects), image, adapter, _point_result)

    def detect(self, image: PreparedImage | None, obj: object, settings, adapter) -> Draft:
        obj, max_objects = self._region_input("detect", image, obj, settings)
        skill = DetectSkill(self.ops, obj, max_objects)
        return self._draft(skill, image, adapter, _detect_result)

    @property
    def segment_refusal(self) -> str | None:
        """Why this model cannot segment (None: it can)."""
        c = self.config
        return unsupported_reason(c.family, c.tokenizer, c.text.vocab_size)

    def segment(
        self,
        image: PreparedImage | None,
        obj: object,
        settings: object,
        adapter: Any,
        *,
        spatial_refs: Sequence[Sequence[float]] | None,
    ) -> Draft:
        """One object's box and outline; ``max_tokens`` bounds the path's tokens."""
        refusal = self.segment_refusal
        if refusal is not None:
            raise UnsupportedError(refusal)
        obj, _ = self._region_input("segment", image, obj, settings)
        s = parse_settings(settings, self.defaults)
        try:
            spatial = self.ops.spatial_tokens(spatial_refs or ())
        except SpatialRefError as exc:
            raise InvalidInputError(str(exc)) from exc
        skill = SegmentSkill(self.ops, obj, s.max_tokens, spatial=spatial)
        draft = self._draft(skill, image, adapter, _segment_result)
        return replace(draft, deltas=_box_first(skill))

    def _region_input(
        self, kind: str, image: PreparedImage | None, obj: object, settings: object
    ) -> tuple[str, int]:
        """(the object's name, max_objects) of a point or detect call, validated."""
        if image is None:
            raise InvalidInputError(f"{kind} needs an image")
        obj = _text(obj, f"the object to {kind}")
        return obj, parse_settings(settings, self.defaults).max_objects

    def _draft(self, skill: Skill, image: Any, adapter: Any, build: BuildResult) -> Draft:
        """``image``: None, one image (placed after BOS), or a tuple of the images the prompt
        places itself (``ImageToken``s)."""
        positions = kv_length(skill.prompt)
        if isinstance(image, PreparedImage):
            positions += self.config.image_tokens
        room = self.config.text.max_context - positions
        if room < 1:
            raise PromptTooLongError(
                f"the prompt takes {positions} of the model's {self.config.text.max_context} "
                "context positions and leaves no room for an answer; shorten the question"
            )
        return Draft(skill, image, adapter, positions, min(skill.max_feeds, room), build)
