"""Skills as pure state machines, over a scripted fake of the model operations."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kestrel.errors import InvalidInputError
from kestrel.skills import (
    CaptionSkill,
    DetectSkill,
    PointSkill,
    QuerySkill,
    Settings,
    parse_settings,
)
from kestrel.tokens import CoordToken, SizeToken, TextToken

EOS, ANSWER, THINKING, COORD, SIZE = 0, 3, 4, 5, 6


@dataclass(frozen=True)
class Tok:
    bos_id: int = 0
    eos_id: int = EOS
    answer_id: int = ANSWER
    thinking_id: int = THINKING
    coord_id: int = COORD
    size_id: int = SIZE
    start_ground_points_id: int = 7
    end_ground_id: int = 9
    query_doubled_answer: bool = True
    continue_on_coord: bool = False
    templates: dict = field(
        default_factory=lambda: {
            "query": {"prefix": (1, 10, 2), "suffix": (ANSWER,)},
            "caption": {"short": (1, 11, 2, 12, ANSWER), "normal": (1, 11, 2, 13, ANSWER)},
            "point": {"prefix": (1, 14, 2), "suffix": (ANSWER,)},
            "detect": {"prefix": (1, 15, 2), "suffix": (ANSWER,)},
        }
    )


class Script:
    """Fake SkillOps: ``sample`` pops the next scripted id and records what was banned."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = list(ids)
        self.banned: list[tuple[int, ...]] = []
        self.tokens = Tok()
        self.coords = iter([0.25, 0.5, 0.75, 0.125, 0.625, 0.375, 0.875])

    def encode(self, text: str) -> list[int]:
        return [100 + len(w) for w in text.split()]

    def decode(self, ids) -> str:
        return "".join(f"<{i}>" for i in ids if i >= 10)

    def stream_decoder(self):
        ops = self

        class S:
            def push(self, i):
                return ops.decode([i])

            def flush(self):
                return ""

        return S()

    def rng(self, seed):
        return None

    def sample(self, logits_V, temperature, top_p, banned, rng, u=None):
        self.banned.append(tuple(banned))
        return self.ids.pop(0)

    def coord_token(self, hidden_C):
        v = next(self.coords)
        return CoordToken(v, int(v * 1024)), "coord-logits"

    def size_token(self, hidden_C):
        return SizeToken(0.25, 0.5, 800, 900), "size-logits"

    def spatial_tokens(self, refs):
        return [CoordToken(float(v), int(v * 1024)) for r in refs for v in r]


def drive(skill, budget: int = 100) -> list:
    fed = []
    while (tok := skill.advance("logits", "hidden", budget - len(fed))) is not None:
        fed.append(tok)
    return fed


GREEDY = Settings(temperature=0.0, max_tokens=5)


def test_query_stops_on_eos_and_masks_from_the_first_decode_step() -> None:
    ops = Script([20, 21, 22, EOS])
    skill = QuerySkill(ops, "what is it", GREEDY)
    assert skill.prompt[-2:] == [TextToken(ANSWER), TextToken(ANSWER)]  # doubled marker
    fed = drive(skill)
    assert fed == [TextToken(20), TextToken(21), TextToken(22)]
    assert skill.finish_reason == "stop" and skill.output_tokens() == (20, 21, 22)
    assert ops.banned == [(), (ANSWER,), (ANSWER,), (ANSWER,)]


@pytest.mark.parametrize(("budget", "fed", "out"), [(100, 4, 5), (3, 3, 3), (0, 0, 0)])
def test_query_length_by_max_tokens_or_budget(budget: int, fed: int, out: int) -> None:
    """max_tokens (5) ends the answer with its 5th token, unfed (nothing attends to it); a
    budget of 3 feeds 3 and the 4th token is never taken."""
    skill = QuerySkill(Script([20] * 10), "q", GREEDY)
    assert len(drive(skill, budget)) == fed
    assert len(skill.output_tokens()) == out
    assert skill.finish_reason == "length"


def test_the_last_answer_draw_is_announced_final() -> None:
    """The draw of the answer's max_tokens-th token says so (a driver queues no step for it);
    reasoning's last token is fed (the answer attends to it) and its draws are never final."""
    settings = Settings(temperature=0.0, max_tokens=3)
    skill = QuerySkill(Script([20] * 3), "q", settings)
    finals = []
    while True:
        finals.append(skill.next_draw().final)
        if skill.advance("logits", "hidden", 100) is None:
            break
    assert finals == [False, False, True] and skill.output_tokens() == (20, 20, 20)
    ops = Script([30, 31, 32, 99, 40, 41, 42])  # 99: drawn once reasoning is full, dropped
    skill = QuerySkill(ops, "q", settings, reasoning=True)
    draws, fed = [], []
    while True:
        draws.append(skill.next_draw())
        if (tok := skill.advance("logits", "hidden", 100)) is None:
            break
        fed.append(tok)
    assert [d.final for d in draws] == [False] * 4 + [False, False, True]
    assert fed[:4] == [TextToken(30), TextToken(31), TextToken(32), TextToken(ANSWER)]
    assert skill.reasoning_tokens() == 3 and skill.output_tokens() == (40, 41, 42)


def test_streamed_text_concatenates_to_the_answer() -> None:
    skill = CaptionSkill(Script([20, 21, 22, EOS]), "short", GREEDY)
    pieces = []
    while skill.advance("l", "h", 10) is not None:
        pieces.append(skill.take_text())
    pieces.append(skill.take_text())
    assert "".join(pieces) == skill.answer_text() == "<20><21><22>"


def test_reasoning_then_answer_with_grounded_coordinates() -> None:
    # reasoning: text, a coordinate (fed as decoded), the answer marker ends it (not fed);
    # then one answer marker is fed and the answer starts unmasked
    ops = Script([30, COORD, 31, ANSWER, 40, 41, EOS])
    skill = QuerySkill(ops, "why", GREEDY, reasoning=True)
    assert skill.prompt[-2:] == [TextToken(ANSWER), TextToken(THINKING)]
    fed = drive(skill)
    assert fed == [
        TextToken(30), CoordToken(0.25, 256), TextToken(31), TextToken(ANSWER),
        TextToken(40), TextToken(41),
    ]  # fmt: skip
    assert ops.banned[:4] == [(), (EOS, SIZE), (EOS, SIZE), (EOS, SIZE)]
    assert ops.banned[4:] == [(), (ANSWER,), (ANSWER,)]
    assert skill.output_tokens() == (40, 41) and skill.finish_reason == "stop"
    assert skill.max_feeds == 2 * GREEDY.max_tokens + 1


def test_point_feeds_x_then_y_and_stops_on_eos() -> None:
    skill = PointSkill(Script([COORD, COORD, EOS]), "cat", max_objects=5)
    fed = drive(skill)
    assert [type(t) for t in fed] == [CoordToken] * 4
    assert skill.results() == ({"x": 0.25, "y": 0.5}, {"x": 0.75, "y": 0.125})
    assert skill.decisions == [COORD, COORD, EOS] and skill.finish_reason == "stop"
    assert skill.output_tokens() == (COORD,) * 4


def test_detect_boxes_are_clamped_and_bounded() -> None:
    skill = DetectSkill(Script([COORD] * 5), "cat", max_objects=2)
    fed = drive(skill)
    assert [type(t) for t in fed] == [CoordToken, CoordToken, SizeToken] * 2
    first = skill.results()[0]
    assert first == {"x_min": 0.125, "y_min": 0.25, "x_max": 0.375, "y_max": 0.75}
    assert skill.finish_reason == "length"  # max_objects reached before eos
    short = DetectSkill(Script([COORD] * 5), "cat", max_objects=9)
    assert len(drive(short, budget=7)) == 6  # a third box would not fit the budget
    assert short.finish_reason == "length"


def test_parse_settings() -> None:
    s = parse_settings({"temperature": 0, "max_tokens": 3, "seed": 5, "top_p": None})
    assert (s.temperature, s.max_tokens, s.seed, s.top_p) == (0.0, 3, 5, 0.3)
    assert parse_settings(None) == Settings()
    for bad in ({"x": 1}, {"top_p": 2}, {"max_objects": 1.5}, "temperature=0"):
        with pytest.raises(InvalidInputError):
            parse_settings(bad)
