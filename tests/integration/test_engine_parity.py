"""Greedy answers through the Engine equal the eager reference path's, for every skill, with
the prefix cache on (cold and warm) and off."""

from __future__ import annotations

import pytest

from kestrel.reference.eager import EagerMoondream
from tests.integration.conftest import FIXTURE_MODEL, assert_idle  # noqa: F401

CASES = [
    ("query", "shapes_378", {"question": "What is in the picture?"}),
    ("query", "tall_300x1000", {"question": "Describe it.", "reasoning": True}),
    ("query", "shapes_378", {"question": "What is here?", "spatial_refs": [[0.2, 0.3]]}),
    ("query", "shapes_378", {"question": "And here?", "spatial_refs": [[0.1, 0.2, 0.5, 0.6]]}),
    ("query", None, {"question": "Tell me a story."}),
    ("caption", "shapes_378", {"length": "short"}),
    ("caption", "tall_300x1000", {"length": "normal"}),
    ("point", "shapes_378", {"object": "circle"}),
    ("detect", "tall_300x1000", {"object": "square"}),
]


def _eager_run(eager: EagerMoondream, skill: str, image, kw: dict):
    if skill == "query":
        r = eager.query(
            image,
            kw["question"],
            reasoning=kw.get("reasoning", False),
            spatial_refs=kw.get("spatial_refs"),
            max_tokens=5,
        )
        reasoning = None if r.reasoning is None else r.reasoning.text
        return {"text": r.answer, "tokens": r.token_ids, "reasoning": reasoning}
    if skill == "caption":
        r = eager.caption(image, kw["length"], max_tokens=5)
        return {"text": r.answer, "tokens": r.token_ids}
    r = getattr(eager, skill)(image, kw["object"], max_objects=3)
    if skill == "point":
        return {"objects": tuple({"x": o.x, "y": o.y} for o in r.objects)}
    keys = ("x_min", "y_min", "x_max", "y_max")
    return {"objects": tuple({k: getattr(o, k) for k in keys} for o in r.objects)}


def _engine_run(engine, skill: str, image, kw: dict):
    settings = {"temperature": 0.0, "max_tokens": 5, "max_objects": 3}
    if skill == "query":
        r = engine.query(
            image,
            kw["question"],
            settings=settings,
            reasoning=kw.get("reasoning", False),
            spatial_refs=kw.get("spatial_refs"),
        )
        reasoning = None if r.reasoning is None else r.reasoning.text
        return {"text": r.answer, "tokens": r.tokens, "reasoning": reasoning}, r.metrics
    if skill == "caption":
        r = engine.caption(image, length=kw["length"], settings=settings)
        return {"text": r.caption, "tokens": r.tokens}, r.metrics
    r = getattr(engine, skill)(image, kw["object"], settings=settings)
    objects = r.points if skill == "point" else r.objects
    return {"objects": tuple(objects)}, r.metrics


@pytest.fixture(scope="module")
def expected(images):
    from kestrel import Engine

    with Engine(FIXTURE_MODEL, device="cpu", dtype="float32", kv_cache_pages=3000) as e:
        eager = EagerMoondream(e.runtime.model, e.runtime.tokenizer)
        return [
            _eager_run(eager, skill, None if img is None else images[img], kw)
            for skill, img, kw in CASES
        ]


@pytest.mark.parametrize("cache", [True, False], ids=["cache_on", "cache_off"])
def test_engine_matches_eager(make_engine, images, expected, cache: bool) -> None:
    engine = make_engine(enable_prefix_cache=cache, kv_cache_pages=8000)
    for _round in range(2):  # the second round hits the cache (when it is on)
        for (skill, img, kw), want in zip(CASES, expected, strict=True):
            got, metrics = _engine_run(engine, skill, None if img is None else images[img], kw)
            assert got == want, (skill, img, kw)
            if not cache:
                assert metrics.cached_tokens == 0
    stats = engine.stats()
    assert stats.requests_served == 2 * len(CASES) and stats.requests_failed == 0
    if cache:
        assert stats.vision_encodes_skipped >= len([c for c in CASES if c[1] is not None])
        assert stats.hit_rate > 0.5
    else:
        assert stats.vision_encodes_skipped == 0 and stats.hit_rate == 0.0
