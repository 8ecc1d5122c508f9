"""Segment: one object's box, then its outline as an SVG path (Moondream 3's segment prompt).

The prompt is the detect prompt's shape under its own template: ``[BOS] + segment.prefix +
encode(" " + object) + segment.suffix`` (Moondream 3 uses ``[1, 17374, 2]`` ... ``[3]``). The
answer starts like detect's first object: a continue decision (the full argmax: eos means the
object is not there), x, y and the size, decoded from hidden states and fed back. Then come
ordinary text tokens that spell an SVG path, one token per path word: a command letter
(``M``, ``L``, ``C``, ``Z``...), a non-negative integer on the path grid, or ``-`` (the next
integer is negative). The grid is :data:`PATH_GRID` units across the box, so the path is
relative to the box: each coordinate is reported as a fraction of the box's width or height
(``grid value / PATH_GRID``), and a point of the path lies in the image at
``x_min + x * (x_max - x_min)``, ``y_min + y * (y_max - y_min)``. The path ends at eos.

Which models may run it is :func:`unsupported_reason`'s answer: Moondream 3 checkpoints whose
config names the segment prompt. A checkpoint that names it without segmentation training ends
the answer after the box: :meth:`SegmentSkill.result` then raises :class:`NoPathError` naming
why, rather than answering an empty path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kestrel.errors import ModelError
from kestrel.skills.base import PromptToken, Skill, SkillOps
from kestrel.skills.prompts import PromptError
from kestrel.skills.region import box_dict
from kestrel.tokens import CoordToken, SizeToken, TextToken

if TYPE_CHECKING:
    from kestrel.moondream.config import TokenizerConfig

__all__ = [
    "PATH_COMMANDS",
    "PATH_GRID",
    "SEGMENT_FAMILIES",
    "SEGMENT_TEMPLATE",
    "NoPathError",
    "PathParser",
    "SegmentResultParts",
    "SegmentSkill",
    "segment_prompt",
    "unsupported_reason",
]

PATH_GRID = 960  # path grid units across the box
PATH_COMMANDS = frozenset("MmLlHhVvCcSsQqTtAaZz")
SEGMENT_TEMPLATE = {"prefix": (1, 17374, 2), "suffix": (3,)}  # Moondream 3's
_SPECIAL_BELOW = 21  # ids under this are control tokens, never path words
SEGMENT_FAMILIES = frozenset({"moondream3"})  # the families trained with the segment prompt
_FAMILY_NAMES = {"moondream2": "Moondream 2", "moondream3": "Moondream 3"}


class NoPathError(ModelError):
    """The model gave a box but no path: the checkpoint has no segmentation training."""


def unsupported_reason(family: str, tok: TokenizerConfig, vocab_size: int) -> str | None:
    """Why a model cannot run the segment skill, None when it can. A checkpoint trained to
    segment names the segment prompt in its config; one that does not (the published Moondream 3
    checkpoints) would stop after the box, so it is refused before any work."""
    if family not in SEGMENT_FAMILIES:
        name = _FAMILY_NAMES.get(family, family)
        why = f"segment is not supported by this model: {name} has no segmentation skill"
    elif "segment" not in tok.templates:
        why = (
            "segment needs a checkpoint with segmentation weights, and this one has none (its "
            "config names no segment prompt): the published Moondream 3 checkpoints stop after "
            "the box (their segmentation weights are not public)"
        )
    elif any(i >= vocab_size for part in _template(tok).values() for i in part):
        why = "segment is not supported by this model: its vocabulary lacks the segment prompt"
    else:
        return None
    return f"{why}; detect gives the object's box"


def _template(tok: TokenizerConfig) -> Mapping[str, Sequence[int]]:
    return tok.templates.get("segment", SEGMENT_TEMPLATE)


def segment_prompt(
    tok: TokenizerConfig, encode: Any, obj: str, spatial: Sequence[PromptToken] = ()
) -> list[PromptToken]:
    """[BOS] + segment.prefix + spatial + encode(" " + obj) + segment.suffix; the template is
    the config's ``segment`` entry, else Moondream 3's."""
    t = _template(tok)
    if not obj.strip():
        raise PromptError("segment needs a non-empty object name")
    return [
        TextToken(tok.bos_id),
        *(TextToken(int(i)) for i in t["prefix"]),
        *spatial,
        *(TextToken(int(i)) for i in encode(" " + obj)),
        *(TextToken(int(i)) for i in t["suffix"]),
    ]


def _fraction(value: int) -> str:
    text = f"{value / PATH_GRID:.3f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


class PathParser:
    """Path words in, path text out, as it becomes final: a command as soon as it is read, a
    coordinate pair once both numbers are in (an unpaired number at the end is dropped).

    ``push`` raises ValueError for a word that is not a command, an integer or ``-``, and for
    numbers before the first command."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self._numbers: list[int] = []
        self._negative = False

    def push(self, word: str) -> str:
        word = word.strip()
        if not word:
            return ""
        if word in PATH_COMMANDS:
            self._numbers.clear()
            self._negative = False
            return self._emit(word)
        if word == "-":
            self._negative = True
            return ""
        if not word.isdigit() or not word.isascii():
            raise ValueError(f"unexpected SVG path word {word!r}")
        if not self.parts:
            raise ValueError(f"the path starts with a number ({word}), not a command")
        value = -int(word) if self._negative else int(word)
        self._negative = False
        self._numbers.append(value)
        if len(self._numbers) < 2:
            return ""
        x, y = self._numbers
        self._numbers.clear()
        return self._emit(f"{_fraction(x)} {_fraction(y)}")

    def _emit(self, part: str) -> str:
        delta = part if not self.parts else " " + part
        self.parts.append(part)
        return delta

    @property
    def path(self) -> str:
        return " ".join(self.parts)


@dataclass(frozen=True, slots=True)
class SegmentResultParts:
    """What a finished segment request found: the box (None when the object is absent) and
    the path relative to it."""

    bbox: dict[str, float] | None
    path: str


class SegmentSkill(Skill):
    """Greedy throughout (like point and detect). ``max_path_tokens`` bounds the path."""

    def __init__(
        self,
        ops: SkillOps,
        obj: str,
        max_path_tokens: int,
        *,
        spatial: Sequence[PromptToken] = (),
    ) -> None:
        self.ops = ops
        self.prompt = segment_prompt(ops.tokens, ops.encode, obj, spatial)
        self.max_feeds = 3 + max_path_tokens
        self.parser = PathParser()
        self.path_ids: list[int] = []
        self._x: CoordToken | None = None
        self._y: CoordToken | None = None
        self._size: SizeToken | None = None
        self._stage = "decide"  # decide -> y -> size -> path
        self._pending = ""
        eos = ops.tokens.eos_id
        self._banned = tuple(i for i in range(_SPECIAL_BELOW) if i != eos)

    @property
    def streams_text(self) -> bool:
        return True

    @property
    def bbox(self) -> dict[str, float] | None:
        if self._x is None or self._y is None or self._size is None:
            return None
        return box_dict(self._x, self._y, self._size)

    def advance(self, logits_V: Any, hidden_C: Any, budget: int) -> PromptToken | None:
        if self._stage == "decide":
            decision = self.ops.sample(logits_V, 0.0, 1.0, (), None)
            if decision == self.ops.tokens.eos_id:
                self._finish("stop")
                return None
            if budget < 3:
                self._finish("length")
                return None
            self._x, _ = self.ops.coord_token(hidden_C)
            self._stage = "y"
            return self._x
        if self._stage == "y":
            self._y, _ = self.ops.coord_token(hidden_C)
            self._stage = "size"
            return self._y
        if self._stage == "size":
            self._size, _ = self.ops.size_token(hidden_C)
            self._stage = "path"
            return self._size
        return self._path_word(logits_V, budget)

    def _path_word(self, logits_V: Any, budget: int) -> PromptToken | None:
        token_id = self.ops.sample(logits_V, 0.0, 1.0, self._banned, None)
        if token_id == self.ops.tokens.eos_id:
            self._finish("stop")
            return None
        try:
            self._pending += self.parser.push(self.ops.decode([token_id]))
        except ValueError as exc:
            raise ModelError(f"the model's segment path is not SVG path data: {exc}") from exc
        self.path_ids.append(token_id)
        if budget < 1 or len(self.path_ids) >= self.max_feeds - 3:
            self._finish("length")
            return None
        return TextToken(token_id)

    def take_text(self) -> str:
        out, self._pending = self._pending, ""
        return out

    def output_tokens(self) -> tuple[int, ...]:
        tok = self.ops.tokens
        box = (tok.coord_id, tok.coord_id, tok.size_id) if self._size is not None else ()
        return (*box, *self.path_ids)

    def result(self) -> SegmentResultParts:
        """The box and path; raises :class:`NoPathError` when the model stopped after the box."""
        bbox = self.bbox
        if bbox is not None and not self.parser.parts and self.finish_reason == "stop":
            raise NoPathError(
                "the model ended its answer after the box without an outline: this checkpoint "
                "has no segmentation weights (the published Moondream 3 checkpoints stop after "
                "the box); /v1/detect gives the box"
            )
        return SegmentResultParts(bbox=bbox, path=self.parser.path)
