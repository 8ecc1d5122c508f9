"""The Engine's segment requests without a model: which checkpoints may segment (and the words of
each refusal), and a segment draft driven as the scheduler drives it over a scripted path: the
stream gives the box first, then the path's text, and the result agrees with both."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kestrel.engine.requests import RequestFactory
from kestrel.errors import InvalidInputError, UnsupportedError
from kestrel.images import prepare_image
from kestrel.moondream.config import MoondreamConfig
from kestrel.results import RequestMetrics, SegmentResult
from kestrel.skills import NoPathError
from kestrel.skills.segment import unsupported_reason
from tests.conftest import FIXTURES
from tests.unit.test_segment_skill import COORD_ID, EOS, PathScript, words

IMAGE = prepare_image(np.full((16, 16, 3), 90, dtype=np.uint8))
METRICS = RequestMetrics(10, 0, 5, 1.0, 1.0, 1.0, 0.0)
BOX = {"x_min": 0.25, "y_min": 0.125, "x_max": 0.75, "y_max": 0.375}
SEGMENT = {"prefix": [1, 463, 2], "suffix": [3]}


def _config(family_dir: str, segment: dict | None = None) -> MoondreamConfig:
    config = MoondreamConfig.from_json_file(FIXTURES / family_dir / "config.json")
    if segment is None:
        return config
    templates = {**config.tokenizer.templates, "segment": segment}
    return replace(config, tokenizer=replace(config.tokenizer, templates=templates))


class _Ops(PathScript):
    def spatial_tokens(self, refs):
        if any(len(r) not in (2, 4) for r in refs):
            from kestrel.moondream.region import SpatialRefError

            raise SpatialRefError("a point or a box")
        return []


def test_which_checkpoints_may_segment() -> None:
    md2, md3 = _config("md2-tiny-a"), _config("md3-tiny-a")
    why = unsupported_reason(md2.family, md2.tokenizer, md2.text.vocab_size)
    assert why.startswith("segment is not supported by this model: Moondream 2 has no")
    why = unsupported_reason(md3.family, md3.tokenizer, md3.text.vocab_size)
    assert "segmentation weights" in why and "stop after the box" in why
    named = _config("md3-tiny-a", SEGMENT)
    assert unsupported_reason(named.family, named.tokenizer, named.text.vocab_size) is None
    big = _config("md3-tiny-a", {"prefix": [1, 17374, 2], "suffix": [3]})  # vocab of 768
    why = unsupported_reason(big.family, big.tokenizer, big.text.vocab_size)
    assert "vocabulary lacks the segment prompt" in why


def test_a_model_that_cannot_segment_is_refused_before_a_draft() -> None:
    factory = RequestFactory(_Ops([]), _config("md2-tiny-a"))
    assert factory.segment_refusal is not None
    with pytest.raises(UnsupportedError, match="Moondream 2 has no segmentation skill"):
        factory.segment(IMAGE, "car", None, None, spatial_refs=None)


def _drive(draft) -> list:
    """The scheduler's loop over one sequence: advance, then hand the text to ``on_text``."""
    pushed: list = []
    on_text = draft.deltas(pushed.append)
    fed = 0
    while draft.skill.advance("logits", "hidden", draft.max_new_tokens - fed) is not None:
        fed += 1
        if delta := draft.skill.take_text():
            on_text(delta)
    if delta := draft.skill.take_text():
        on_text(delta)
    return pushed


def test_a_segment_draft_streams_the_box_then_the_path() -> None:
    path = [COORD_ID, *words("M", "0", "0", "L", "960", "480", "Z"), EOS]
    factory = RequestFactory(_Ops(path), _config("md3-tiny-a", SEGMENT))
    draft = factory.segment(IMAGE, "red car", {"max_tokens": 32}, None, spatial_refs=None)
    pushed = _drive(draft)
    result = draft.build_result(draft.skill, METRICS)
    assert isinstance(result, SegmentResult)
    assert pushed[0] == BOX == result.bbox
    assert all(isinstance(p, str) for p in pushed[1:]) and len(pushed) > 2
    assert "".join(pushed[1:]) == result.path == "M 0 0 L 1 0.5 Z"
    assert (result.finish_reason, result.metrics) == ("stop", METRICS)
    assert result.tokens == draft.skill.output_tokens()


def test_a_box_without_a_path_fails_with_no_path_error() -> None:
    factory = RequestFactory(_Ops([COORD_ID, EOS]), _config("md3-tiny-a", SEGMENT))
    draft = factory.segment(IMAGE, "car", None, None, spatial_refs=None)
    assert _drive(draft) == []  # no path text: nothing streamed, not even the box
    with pytest.raises(NoPathError, match="no segmentation weights"):
        draft.build_result(draft.skill, METRICS)


def test_segment_input_is_checked() -> None:
    factory = RequestFactory(_Ops([]), _config("md3-tiny-a", SEGMENT))
    with pytest.raises(InvalidInputError, match="segment needs an image"):
        factory.segment(None, "car", None, None, spatial_refs=None)
    with pytest.raises(InvalidInputError, match="must not be empty"):
        factory.segment(IMAGE, "  ", None, None, spatial_refs=None)
    with pytest.raises(InvalidInputError, match="a point or a box"):
        factory.segment(IMAGE, "car", None, None, spatial_refs=[[0.1, 0.2, 0.3]])
