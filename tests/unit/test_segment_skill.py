"""The segment skill and its SVG path parser on synthetic token streams (no model: the path
words come from a scripted fake of the model operations)."""

from __future__ import annotations

import pytest

from kestrel.errors import InvalidInputError, ModelError
from kestrel.skills import NoPathError, PathParser, SegmentSkill, segment_prompt
from kestrel.skills.segment import PATH_GRID, SEGMENT_TEMPLATE
from kestrel.tokens import CoordToken, SizeToken, TextToken
from tests.unit.test_skills import EOS, Tok

# Path words by token id (ids above the control range, as in a real vocabulary).
WORDS = {30: "M", 31: "L", 32: "Z", 33: "-", 34: "C", 40: "0", 41: "480", 42: "960", 43: "96",
         44: "240", 45: "x1"}  # fmt: skip
ID = {w: i for i, w in WORDS.items()}
COORD_ID = 5


class PathScript:
    """Fake SkillOps: ``sample`` pops the next scripted id; words decode through WORDS."""

    def __init__(self, ids: list[int], center=(0.5, 0.25), size=(0.5, 0.25)) -> None:
        self.ids = list(ids)
        self.tokens = Tok()
        self.banned: list[tuple[int, ...]] = []
        self.coords = iter(center)
        self.size = size

    def encode(self, text: str) -> list[int]:
        return [100 + len(w) for w in text.split()]

    def decode(self, ids) -> str:
        return "".join(" " + WORDS[i] for i in ids)  # a leading space, as BPE words have

    def sample(self, logits_V, temperature, top_p, banned, rng, u=None):
        self.banned.append(tuple(banned))
        return self.ids.pop(0)

    def coord_token(self, hidden_C):
        v = next(self.coords)
        return CoordToken(v, int(v * 1024)), None

    def size_token(self, hidden_C):
        w, h = self.size
        return SizeToken(w, h, int(w * 1023), int(h * 1023)), None


def words(*ws: str) -> list[int]:
    return [ID[w] for w in ws]


def run(skill: SegmentSkill, budget: int = 100) -> tuple[list, list[str]]:
    fed, chunks = [], []
    while (tok := skill.advance("logits", "hidden", budget - len(fed))) is not None:
        fed.append(tok)
        if chunk := skill.take_text():
            chunks.append(chunk)
    if chunk := skill.take_text():
        chunks.append(chunk)
    return fed, chunks


def test_prompt_is_the_segment_template_with_the_object() -> None:
    ops = PathScript([])
    prompt = segment_prompt(ops.tokens, ops.encode, "red car")
    prefix = [TextToken(i) for i in SEGMENT_TEMPLATE["prefix"]]
    assert prompt == [TextToken(0), *prefix, TextToken(103), TextToken(103), TextToken(3)]
    with pytest.raises(InvalidInputError, match="non-empty object"):
        segment_prompt(ops.tokens, ops.encode, "  ")


def test_box_then_path_relative_to_the_box_streamed_in_pieces() -> None:
    stream = [COORD_ID, *words("M", "0", "0", "L", "960", "480", "-", "96", "240", "Z"), EOS]
    ops = PathScript(stream)
    skill = SegmentSkill(ops, "car", max_path_tokens=64)
    fed, chunks = run(skill)
    assert isinstance(fed[0], CoordToken) and isinstance(fed[1], CoordToken)
    assert isinstance(fed[2], SizeToken) and len(fed) == 3 + 10
    assert skill.finish_reason == "stop"
    # grid units / 960 = fractions of the box; "-" negates the next number
    assert chunks == ["M", " 0 0", " L", " 1 0.5", " -0.1 0.25", " Z"]
    result = skill.result()
    assert result.path == "".join(chunks) == "M 0 0 L 1 0.5 -0.1 0.25 Z"
    assert result.bbox == {"x_min": 0.25, "y_min": 0.125, "x_max": 0.75, "y_max": 0.375}
    # control ids (but eos) are never sampled as path words; the first decision is free
    assert ops.banned[0] == () and EOS not in ops.banned[1] and 1 in ops.banned[1]
    assert skill.output_tokens()[:3] == (COORD_ID, COORD_ID, 6)


def test_an_absent_object_has_no_box_and_no_path() -> None:
    skill = SegmentSkill(PathScript([EOS]), "unicorn", max_path_tokens=8)
    fed, chunks = run(skill)
    assert fed == [] and chunks == [] and skill.finish_reason == "stop"
    result = skill.result()
    assert result.bbox is None and result.path == ""


def test_a_checkpoint_that_stops_after_the_box_is_a_clear_error() -> None:
    skill = SegmentSkill(PathScript([COORD_ID, EOS]), "car", max_path_tokens=8)
    fed, _ = run(skill)
    assert len(fed) == 3 and skill.bbox is not None
    with pytest.raises(NoPathError, match="no segmentation weights") as caught:
        skill.result()
    assert isinstance(caught.value, ModelError)


def test_path_length_is_bounded_by_max_path_tokens_and_budget() -> None:
    many = [COORD_ID, *words("M", *["480"] * 40)]
    skill = SegmentSkill(PathScript(many), "car", max_path_tokens=5)
    run(skill)
    assert skill.finish_reason == "length" and len(skill.path_ids) == 5
    assert skill.result().path == "M 0.5 0.5 0.5 0.5"  # the unpaired last number is dropped
    short = SegmentSkill(PathScript(many), "car", max_path_tokens=50)
    fed, _ = run(short, budget=6)  # the box, three words fed, a fourth decided but not fed
    assert short.finish_reason == "length" and len(fed) == 6 and len(short.path_ids) == 4


def test_a_word_that_is_not_path_data_fails_the_request() -> None:
    skill = SegmentSkill(PathScript([COORD_ID, *words("M", "x1")]), "car", max_path_tokens=8)
    with pytest.raises(ModelError, match="not SVG path data"):
        run(skill)


@pytest.mark.parametrize(
    ("stream", "path"),
    [
        (["M", "960", "0", "C", "0", "0", "480", "480", "960", "960", "Z"],
         "M 1 0 C 0 0 0.5 0.5 1 1 Z"),
        (["M", "-", "96", "-", "96"], "M -0.1 -0.1"),
        (["M", "480", "L", "0", "0"], "M L 0 0"),  # a command drops an unpaired number
        (["", "M", " ", "0", "0"], "M 0 0"),  # blank words are skipped
    ],
)  # fmt: skip
def test_parser_on_word_streams(stream: list[str], path: str) -> None:
    parser = PathParser()
    pieces = [parser.push(w) for w in stream]
    assert parser.path == "".join(pieces) == path


def test_parser_refuses_numbers_before_a_command_and_stray_words() -> None:
    with pytest.raises(ValueError, match="starts with a number"):
        PathParser().push("12")
    parser = PathParser()
    parser.push("M")
    with pytest.raises(ValueError, match="unexpected"):
        parser.push("1.5")
    assert PATH_GRID == 960
