"""Moondream 3 through the Engine: greedy answers on md3-tiny-a equal the fixture's (the
first-party reference's), with the prefix cache on (cold and warm) and off, one request at a
time and all at once (batched prefill waves and mixed decode batches)."""

from __future__ import annotations

import pytest
from PIL import Image

from tests.conformance.golden import load_golden
from tests.conftest import FIXTURES
from tests.integration.conftest import assert_idle  # noqa: F401

MD3 = FIXTURES / "md3-tiny-a"
GOLDEN = load_golden(MD3)
CASES = GOLDEN.meta["cases"]


def _image(case: dict):
    """The case's image decoded as the reference decodes it: convert("RGB") drops the alpha of
    the RGBA image (the Engine would composite a file's alpha over white)."""
    if not case.get("image"):
        return None
    return Image.open(MD3 / GOLDEN.image(case["image"])["file"]).convert("RGB")


def _settings(case: dict) -> dict:
    s = case["settings"]
    return {"temperature": 0.0, "max_tokens": s.get("max_tokens", 8),
            "max_objects": s.get("max_objects", 3)}  # fmt: skip


def _submit(engine, case: dict):
    image, settings, kind = _image(case), _settings(case), case["kind"]
    if kind in ("query", "query_reasoning"):
        return engine.submit_query(image, case["question"], settings=settings,
                                   reasoning=kind == "query_reasoning",
                                   spatial_refs=case.get("spatial_refs"))  # fmt: skip
    if kind == "caption":
        return engine.submit_caption(image, length=case["length"], settings=settings)
    submit = engine.submit_point if kind == "point" else engine.submit_detect
    return submit(image, case["object"], settings=settings)


def _clamp(v: float) -> float:
    return min(max(v, 0.0), 1.0)


def _check(case: dict, result) -> None:
    kind, cid = case["kind"], case["id"]
    if kind == "query_reasoning":
        assert result.reasoning.text == case["reasoning_text"], cid
        assert list(result.tokens) == case["answer"]["emitted"], cid
    elif kind in ("query", "caption"):
        assert list(result.tokens) == case["greedy_ids"], cid
    elif kind == "point":
        want = [{"x": _clamp(o["x"]), "y": _clamp(o["y"])} for o in case["reference_output"]]
        assert list(result.points) == [pytest.approx(w, abs=1e-7) for w in want], cid
    else:
        keys = ("x_min", "y_min", "x_max", "y_max")
        want = [{k: _clamp(o[k]) for k in keys} for o in case["reference_output"]]
        assert list(result.objects) == [pytest.approx(w, abs=1e-7) for w in want], cid


@pytest.mark.parametrize("cache", [True, False], ids=["cache_on", "cache_off"])
def test_md3_engine_matches_reference(make_engine, cache: bool) -> None:
    engine = make_engine(model=str(MD3), enable_prefix_cache=cache, kv_cache_pages=8000)
    assert engine.runtime.model.config.family == "moondream3"
    # With the cache on, the second round hits it. With it off a second round would repeat the
    # first: the cases already run one after another on reused (freed) pages, and already ask
    # about the same images again (4 cases each on two images), which must be encoded again.
    rounds = 2 if cache else 1
    for _round in range(rounds):
        for case in CASES:
            _check(case, _submit(engine, case).result())
    stats = engine.stats()
    assert stats.requests_served == rounds * len(CASES) and stats.requests_failed == 0
    if cache:
        assert stats.vision_encodes_skipped >= len([c for c in CASES if c.get("image")])
    else:
        assert stats.vision_encodes_skipped == 0


def test_md3_engine_batched(make_engine) -> None:
    """Every case submitted at once: batched prefill waves, shared image prefixes, MoE decode
    steps over rows that route to different experts."""
    engine = make_engine(model=str(MD3), kv_cache_pages=8000, max_batch_size=16)
    futures = [(case, _submit(engine, case)) for case in CASES]
    for case, future in futures:
        _check(case, future.result())
