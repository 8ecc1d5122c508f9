"""Engine.segment on the fixture models: a model that cannot segment refuses every form of the
call before the scheduler sees it, naming why; a Moondream 3 checkpoint that names the segment
prompt runs it through the scheduler, blocking, streamed and awaited alike (the random fixture
weights spell no SVG path, so all three fail the same way), and leaves the engine idle."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from kestrel.errors import KestrelError, UnsupportedError
from tests.conftest import FIXTURES
from tests.integration.conftest import assert_idle

SCENE = FIXTURES / "md2-tiny-a" / "images" / "shapes_378.png"
SETTINGS = {"max_tokens": 8}


def _refusals(engine) -> list[str]:
    image = SCENE.read_bytes()
    calls = [
        lambda: engine.segment(image, "circle"),
        lambda: engine.segment(image, "circle", stream=True),
        lambda: engine.submit_segment(image, "circle"),
        lambda: asyncio.run(engine.asegment(image, "circle", stream=True)),
    ]
    messages = []
    for call in calls:
        with pytest.raises(UnsupportedError) as caught:
            call()
        messages.append(str(caught.value))
    return messages


def test_moondream_2_refuses_segment_before_the_scheduler(make_engine) -> None:
    engine = make_engine()
    assert engine.supports_segment is False
    messages = _refusals(engine)
    assert len(set(messages)) == 1 and "Moondream 2 has no segmentation skill" in messages[0]
    s = engine.stats()
    assert (s.requests_served, s.requests_failed) == (0, 0)


def test_moondream_3_without_a_segment_prompt_names_the_missing_weights(make_engine) -> None:
    engine = make_engine(model=str(FIXTURES / "md3-tiny-a"))
    assert engine.supports_segment is False
    assert "segmentation weights" in _refusals(engine)[0]
    assert engine.stats().requests_failed == 0


def _outcome(run) -> tuple[str, str]:
    try:
        result = run()
    except KestrelError as exc:
        return type(exc).__name__, str(exc)
    return "result", repr((result.bbox, result.path, result.finish_reason))


def test_a_checkpoint_that_names_the_prompt_runs_segment(make_engine, tmp_path) -> None:
    model = tmp_path / "md3-segment"
    shutil.copytree(FIXTURES / "md3-tiny-a", model)
    config = json.loads((model / "config.json").read_text())
    config["config"]["tokenizer"]["templates"]["segment"] = {"prefix": [1, 463, 2], "suffix": [3]}
    (model / "config.json").write_text(json.dumps(config))
    engine = make_engine(model=str(model))
    assert engine.supports_segment is True
    image = engine.prepare_image(SCENE.read_bytes())

    def streamed():
        stream = engine.segment(image, "circle", settings=SETTINGS, stream=True)
        deltas = list(stream)
        result = stream.result()
        assert deltas[0] == result.bbox and "".join(deltas[1:]) == result.path
        return result

    async def awaited():
        return await engine.asegment(image, "circle", settings=SETTINGS)

    blocking = _outcome(lambda: engine.segment(image, "circle", settings=SETTINGS))
    assert _outcome(streamed) == blocking
    assert _outcome(lambda: asyncio.run(awaited())) == blocking
    s = engine.stats()
    assert s.requests_served + s.requests_failed == 3
    assert_idle(engine)
