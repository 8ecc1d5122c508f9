"""Result values of the public API (frozen, slotted) and the engine's statistics.

Coordinates are normalized to [0, 1] of the image's width and height. ``finish_reason`` is
``"stop"`` (the model ended the answer, or point/detect ended its list) or ``"length"`` (the
``max_tokens`` / ``max_objects`` budget or the model context ran out first).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "CaptionResult",
    "ChatResult",
    "DetectResult",
    "EngineStats",
    "PointResult",
    "QueryResult",
    "Reasoning",
    "RequestMetrics",
    "SegmentResult",
    "TextDelta",
    "TokenLogprob",
]


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """What one request cost. ``input_tokens`` counts KV positions of the prompt (the image
    block included); ``cached_tokens`` of them were reused from the prefix cache.
    ``cache_tier`` says which tier served the prompt: ``"kv"`` (its image KV, or any prefix of
    a text prompt, was in the prefix cache), ``"host"`` (the same, partly copied back from
    host memory), ``"embedding"`` (the image's KV was computed from a cached embedding,
    without the vision encoder) or ``"none"``. ``reasoning_tokens``: tokens generated while
    reasoning (``reasoning=True``), before the ``output_tokens`` of the answer."""

    input_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_ms: float  # submit -> first generated token decided
    prefill_ms: float  # the prefill's own compute
    decode_ms: float  # first token -> finished
    queue_ms: float  # submit -> admitted by the scheduler
    cache_tier: str = "none"
    reasoning_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Reasoning:
    """Reasoning-mode thoughts: the text and, per grounded span of it, the points it cites
    (``{"start_idx", "end_idx", "points": [{"x", "y"}, ...]}``, character offsets)."""

    text: str
    grounding: tuple[dict[str, Any], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "grounding": [dict(g) for g in self.grounding]}


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One answer token's log-probability under the model (its raw logits: before
    temperature, grammar or suppression), with its id, its bytes (a piece of a multi-byte
    character stays a piece) and text, and ``top``: the most likely tokens at its place."""

    id: int
    token: str
    bytes: bytes
    logprob: float
    top: tuple[TokenLogprob, ...] = ()


class TextDelta(str):
    """A streamed text delta of a call made with ``logprobs=``: the text itself (a ``str``),
    and ``logprobs``, the :class:`TokenLogprob` of the answer tokens whose text it completes
    (tokens whose text is still held back come with a later delta; those of the last one with
    the result)."""

    logprobs: tuple[TokenLogprob, ...]

    def __new__(cls, text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> TextDelta:
        out = super().__new__(cls, text)
        out.logprobs = logprobs
        return out


@dataclass(frozen=True, slots=True)
class QueryResult:
    """``parsed``: with ``response_format``, the answer's value (the JSON value; the text for
    a regex or a choice; None for an answer cut short). ``logprobs``: with ``logprobs=``,
    one :class:`TokenLogprob` per answer token."""

    answer: str
    reasoning: Reasoning | None
    finish_reason: str
    tokens: tuple[int, ...]  # generated ids of the answer
    metrics: RequestMetrics
    parsed: Any = None
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True, slots=True)
class ChatResult:
    """The assistant's reply to a conversation: ``content`` (the answer), ``reasoning`` (with
    ``reasoning=True``), and :attr:`message`, the reply in the OpenAI message shape;
    ``parsed`` and ``logprobs`` as :class:`QueryResult`'s."""

    content: str
    reasoning: Reasoning | None
    finish_reason: str
    tokens: tuple[int, ...]  # generated ids of the answer
    metrics: RequestMetrics
    parsed: Any = None  # as QueryResult's
    logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def message(self) -> dict[str, Any]:
        """``{"role": "assistant", "content", "reasoning"?}`` (a new dict on every call)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            out["reasoning"] = self.reasoning.to_dict()
        return out


@dataclass(frozen=True, slots=True)
class CaptionResult:
    caption: str
    finish_reason: str
    tokens: tuple[int, ...]
    metrics: RequestMetrics


@dataclass(frozen=True, slots=True)
class PointResult:
    points: tuple[dict[str, float], ...]  # {"x", "y"}
    finish_reason: str
    tokens: tuple[int, ...]  # the id view of what was generated (coord ids)
    metrics: RequestMetrics


@dataclass(frozen=True, slots=True)
class DetectResult:
    objects: tuple[dict[str, float], ...]  # {"x_min", "y_min", "x_max", "y_max"}
    finish_reason: str
    tokens: tuple[int, ...]  # the id view of what was generated (coord / size ids)
    metrics: RequestMetrics


@dataclass(frozen=True, slots=True)
class SegmentResult:
    """One object's outline: ``path`` is SVG path data relative to ``bbox`` (None: the object
    is not in the image), see :mod:`kestrel.skills.segment`."""

    path: str
    bbox: dict[str, float] | None  # {"x_min", "y_min", "x_max", "y_max"}
    finish_reason: str
    tokens: tuple[int, ...]  # the id view: coord / size ids, then the path's text ids
    metrics: RequestMetrics


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine. Pages: ``pages_total`` usable KV pages (page 0 is reserved) =
    free + cached (owned by the prefix cache) + private (held by running requests only);
    ``pages_locked`` of the cached ones are in use by running requests, ``pages_evictable``
    can be freed right now. ``hit_rate`` is token-weighted: cached / input positions."""

    requests_served: int
    requests_failed: int
    requests_cancelled: int
    running: int
    queue_depth: int
    hit_rate: float
    prefill_tokens_saved: int
    vision_encodes_skipped: int
    pages_total: int
    pages_free: int
    pages_cached: int
    pages_private: int
    pages_locked: int
    pages_evictable: int
    evictions: int  # pages evicted from the cache since start
    namespaces: int
    # the image-embedding tier (0 everywhere when it is off) and the vision encoder's runs
    vision_encodes: int = 0
    embedding_hits: int = 0
    embedding_misses: int = 0
    embedding_bytes: int = 0
    embedding_budget_bytes: int = 0
    embedding_entries: int = 0
    embedding_evictions: int = 0
    # the host KV tier (CUDA only; 0 when off): evicted nodes copied back on a match, bytes held
    host_kv_hits: int = 0
    host_kv_bytes: int = 0
    host_kv_budget_bytes: int = 0
    # encoded images handed in again and prepared without a decode (images/known.py)
    image_decodes_skipped: int = 0
    # decoded image bytes held by requests in flight, under their budget (images/budget.py):
    # now, the most at once, the budget; decodes that waited for room, and that were refused
    image_memory_bytes: int = 0
    image_memory_peak_bytes: int = 0
    image_memory_budget_bytes: int = 0
    image_decodes_waited: int = 0
    image_decodes_refused: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
