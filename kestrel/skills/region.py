"""Region skills: point and detect (always greedy, as the reference).

The first continue decision uses the prefill logits. While the argmax is not eos and fewer
than ``max_objects`` objects were found: x is decoded from the hidden state that made the
decision and fed back; y from the hidden state of x; for detect, the size from the hidden state
of y. Each is fed as its bin's value (``bin / coord_bins``; ``2 ** (bin / (size_bins - 1) * 10 -
10)`` for sizes). The logits after the object's last token make the next decision. Reported
coordinates are clamped to [0, 1]. Moondream 3 (``continue_on_coord`` in its tokenizer config)
makes the decisions after an object from the (coord, eos) logits alone: it continues while
coord >= eos, as its reference does; the first decision stays the full argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kestrel.skills.base import PromptToken, Skill, SkillOps
from kestrel.skills.prompts import detect_prompt, point_prompt
from kestrel.tokens import CoordToken, SizeToken

__all__ = ["DetectSkill", "PointSkill", "RegionSkill", "RegionTrace", "box_dict", "point_dict"]


def _clamp01(v: float) -> float:
    return min(max(v, 0.0), 1.0)


def point_dict(xt: CoordToken, yt: CoordToken) -> dict[str, float]:
    return {"x": _clamp01(xt.pos), "y": _clamp01(yt.pos)}


def box_dict(xt: CoordToken, yt: CoordToken, st: SizeToken) -> dict[str, float]:
    x, y, w, h = xt.pos, yt.pos, st.width, st.height
    return {
        "x_min": _clamp01(x - w / 2),
        "y_min": _clamp01(y - h / 2),
        "x_max": _clamp01(x + w / 2),
        "y_max": _clamp01(y + h / 2),
    }


@dataclass(slots=True)
class RegionTrace:
    """Raw logits of one object's decisions (kept with ``record``)."""

    x_logits: Any
    y_logits: Any = None
    size_logits: Any = None
    next_logits: Any = None


class RegionSkill(Skill):
    def __init__(
        self, ops: SkillOps, obj: str, max_objects: int, *, with_size: bool, record: bool = False
    ) -> None:
        self.ops, self.with_size, self.record = ops, with_size, record
        build = detect_prompt if with_size else point_prompt
        self.prompt = build(ops.tokens, ops.encode, obj)
        self.max_objects = max_objects
        self.per_object = 3 if with_size else 2
        self.max_feeds = self.per_object * max_objects
        self.objects: list[tuple[CoordToken, CoordToken, SizeToken | None]] = []
        self.decisions: list[int] = []
        self.traces: list[RegionTrace] = []
        self.first_logits: Any = None
        self.first_hidden: Any = None
        self._stage = "decide"  # decide -> y -> (size) -> decide
        self._x: CoordToken | None = None
        self._y: CoordToken | None = None

    def advance(self, logits_V: Any, hidden_C: Any, budget: int) -> PromptToken | None:
        if self._stage == "y":
            self._y, y_logits = self.ops.coord_token(hidden_C)
            if self.record:
                self.traces[-1].y_logits = y_logits
            self._stage = "size" if self.with_size else "decide"
            if not self.with_size:
                self.objects.append((self._x, self._y, None))
            return self._y
        if self._stage == "size":
            st, size_logits = self.ops.size_token(hidden_C)
            if self.record:
                self.traces[-1].size_logits = size_logits
            self.objects.append((self._x, self._y, st))
            self._stage = "decide"
            return st
        return self._decide(logits_V, hidden_C, budget)

    def _decide(self, logits_V: Any, hidden_C: Any, budget: int) -> PromptToken | None:
        if self.first_logits is None:
            self.first_logits, self.first_hidden = logits_V, hidden_C
        elif self.record:
            self.traces[-1].next_logits = logits_V
        tok = self.ops.tokens
        if self.objects and tok.continue_on_coord:
            decision = self.ops.pick(logits_V, (tok.coord_id, tok.eos_id))  # ties to coord
        else:
            decision = self.ops.sample(logits_V, 0.0, 1.0, (), None)
        self.decisions.append(decision)
        if decision == self.ops.tokens.eos_id:
            self._finish("stop")
        elif len(self.objects) >= self.max_objects or budget < self.per_object:
            self._finish("length")
        if self.finished:
            return None
        self._x, x_logits = self.ops.coord_token(hidden_C)
        if self.record:
            self.traces.append(RegionTrace(x_logits))
        self._stage = "y"
        return self._x

    def output_tokens(self) -> tuple[int, ...]:
        tok = self.ops.tokens
        one = (tok.coord_id, tok.coord_id) + ((tok.size_id,) if self.with_size else ())
        return one * len(self.objects)

    def results(self) -> tuple[dict[str, float], ...]:
        """Points ``{"x", "y"}`` or boxes ``{"x_min", "y_min", "x_max", "y_max"}``."""
        if self.with_size:
            return tuple(box_dict(x, y, s) for x, y, s in self.objects if s is not None)
        return tuple(point_dict(x, y) for x, y, _ in self.objects)


class PointSkill(RegionSkill):
    def __init__(self, ops: SkillOps, obj: str, max_objects: int, *, record: bool = False):
        super().__init__(ops, obj, max_objects, with_size=False, record=record)


class DetectSkill(RegionSkill):
    def __init__(self, ops: SkillOps, obj: str, max_objects: int, *, record: bool = False):
        super().__init__(ops, obj, max_objects, with_size=True, record=record)
