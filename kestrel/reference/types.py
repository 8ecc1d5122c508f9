"""Result values of the eager generation path (frozen, slotted)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kestrel.skills.grounding import GroundingChunk
from kestrel.tokens import CoordToken, SizeToken

__all__ = [
    "Box",
    "ContextOverflowError",
    "EncodedImage",
    "GroundingChunk",
    "Phase",
    "Point",
    "QueryTrace",
    "ReasoningResult",
    "RegionResult",
    "RegionStep",
]


class ContextOverflowError(ValueError):
    """A prompt plus generation that does not fit in text.max_context."""


def _clamp01(v: float) -> float:
    return min(max(v, 0.0), 1.0)


@dataclass(frozen=True, slots=True)
class EncodedImage:
    """An image after the vision tower and the BOS + image prefill (adapter-specific KV)."""

    img_emb: Tensor  # [n_patches, dim]
    tiling: tuple[int, int]
    k: tuple[Tensor, ...]  # per layer [prefix_len, n_kv_heads, head_dim], positions 0..prefix-1
    v: tuple[Tensor, ...]
    lora_id: str | None


@dataclass(frozen=True, slots=True)
class Phase:
    """One generation phase. step_logits (when recorded) holds the raw logits, before any
    masking, of every decision: row 0 the prefill logits, row k the step fed token k - 1."""

    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (stop id sampled), "max_tokens", "length" (context full)
    prefill_logits: Tensor  # [V]
    prefill_hidden: Tensor  # [dim], pre post_ln
    step_logits: Tensor | None  # [n_decisions, V]


@dataclass(frozen=True, slots=True)
class ReasoningResult:
    text: str
    token_ids: tuple[int, ...]
    grounding: tuple[GroundingChunk, ...]
    phase: Phase


@dataclass(frozen=True, slots=True)
class QueryTrace:
    """What the eager path generated for a query or caption, with the logits of every decision
    (the oracle the cached runtime is compared against; the Engine returns
    :class:`kestrel.results.QueryResult`)."""

    answer: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "eos", "max_tokens" or "length"
    prompt_ids: tuple[int, ...]  # ids prefilled after any image prefix (coord_id/size_id rows)
    phase: Phase  # the answer phase
    reasoning: ReasoningResult | None


@dataclass(frozen=True, slots=True)
class Point:
    x: float  # clamped to [0, 1]
    y: float
    x_bin: int
    y_bin: int
    raw_x: float  # bin / coord_bins, as fed back
    raw_y: float

    @classmethod
    def from_tokens(cls, xt: CoordToken, yt: CoordToken) -> Point:
        return cls(_clamp01(xt.pos), _clamp01(yt.pos), xt.bin, yt.bin, xt.pos, yt.pos)


@dataclass(frozen=True, slots=True)
class Box:
    x_min: float  # clamped to [0, 1]
    y_min: float
    x_max: float
    y_max: float
    x_bin: int
    y_bin: int
    w_bin: int
    h_bin: int
    center: tuple[float, float]  # raw values as fed back
    size: tuple[float, float]

    @classmethod
    def from_center(cls, xt: CoordToken, yt: CoordToken, st: SizeToken) -> Box:
        x, y, w, h = xt.pos, yt.pos, st.width, st.height
        return cls(
            _clamp01(x - w / 2),
            _clamp01(y - h / 2),
            _clamp01(x + w / 2),
            _clamp01(y + h / 2),
            xt.bin,
            yt.bin,
            st.width_bin,
            st.height_bin,
            (x, y),
            (w, h),
        )


@dataclass(frozen=True, slots=True)
class RegionStep:
    x_logits: Tensor  # [coord_bins]
    y_logits: Tensor
    size_logits: Tensor | None  # [2, size_bins] (detect)
    next_logits: Tensor  # [V], the continue decision after the object


@dataclass(frozen=True, slots=True)
class RegionResult:
    objects: tuple[Point | Box, ...]
    decisions: tuple[int, ...]  # argmax token of each continue decision (prefill first)
    prompt_ids: tuple[int, ...]  # ids prefilled after any image prefix
    prefill_logits: Tensor
    prefill_hidden: Tensor
    steps: tuple[RegionStep, ...] | None
