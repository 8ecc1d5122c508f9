"""kestrel-tiny as an end-to-end oracle: on unseen scenes its accuracy must hold on every
path through the engine. A cache, batching or adapter bug that corrupts KV shows up here as
lost accuracy or answers that differ from the plain path."""

from __future__ import annotations

import random

import pytest

from kestrel import Engine
from kestrel.engine.setup import DEFAULT_MODEL_DIR
from kestrel.tiny import synthetic
from kestrel.tiny.eval import evaluate, report, score, submit_case
from tests.integration.conftest import assert_idle

SEED, N = 11, 24  # never the training stream
FLOORS = {"query_acc": 0.75, "point_acc": 0.7, "detect_acc": 0.6}
TOLERANCE = 2 / N  # "within a few points": at most two cases of 24 may differ per metric


@pytest.fixture(scope="module")
def cases() -> list[synthetic.EvalCase]:
    return synthetic.eval_cases(SEED, N)


def _engine(**kw) -> Engine:
    kw.setdefault("max_batch_size", 16)
    return Engine(None, device="cpu", dtype="float32", **kw)


@pytest.fixture(scope="module")
def plain(cases):
    """The plain path: one request at a time, no prefix cache."""
    with _engine(max_batch_size=1, enable_prefix_cache=False) as engine:
        return evaluate(engine, cases)


def _close_to(rep, ref) -> None:
    for key in FLOORS:
        assert abs(getattr(rep, key) - getattr(ref, key)) <= TOLERANCE + 1e-9, (key, rep, ref)
    same = sum(a.answer == b.answer for a, b in zip(rep.outcomes, ref.outcomes, strict=True))
    assert same >= N - 2, f"only {same}/{N} answers equal the plain path's"


def test_plain_path_meets_the_floors(plain) -> None:
    for key, floor in FLOORS.items():
        assert getattr(plain, key) >= floor, (key, plain.to_dict())


@pytest.mark.parametrize("cache", [True, False], ids=["cache_on", "cache_off"])
def test_concurrent_batches(plain, cases, cache: bool) -> None:
    with _engine(enable_prefix_cache=cache) as engine:
        rep = evaluate(engine, cases)
        assert_idle(engine)
    _close_to(rep, plain)


def test_repeated_questions_hit_the_cache(plain, cases) -> None:
    with _engine() as engine:
        evaluate(engine, cases)  # warms the cache with every image and prompt
        again = evaluate(engine, cases)
        prefix = engine.config.prefix_len
        assert all(o.cached_tokens >= prefix for o in again.outcomes)
        assert_idle(engine)
    _close_to(again, plain)


def test_eviction_pressure(plain, cases) -> None:
    # room for about four requests at a time: every image prefix is evicted and recomputed
    with _engine(kv_cache_pages=450, max_batch_size=4) as engine:
        rep = evaluate(engine, cases)
        stats = engine.stats()
        assert stats.evictions > 0
        assert_idle(engine)
    _close_to(rep, plain)


def test_adapter_answers_only_where_named(cases) -> None:
    color = [c for c in synthetic.eval_cases(SEED + 1, 160) if c.query.kind == "color"][:24]
    french = set(synthetic.FRENCH_COLORS.values())
    english = set(synthetic.FRENCH_COLORS)
    with _engine() as engine:
        engine.load_adapter("fr", DEFAULT_MODEL_DIR / "lora-french")
        order = [(c, name) for c in color for name in (None, "fr")]
        random.Random(0).shuffle(order)  # base and adapter requests interleave in batches
        futures = [submit_case(engine, c, adapter=name) for c, name in order]
        outcomes = {}
        for (case, name), (fq, fp, fd) in zip(order, futures, strict=True):
            expect = None if name is None else synthetic.FRENCH_COLORS.get
            outcomes[id(case), name] = score(
                case, fq.result(), fp.result(), fd.result(), expect=expect
            )
        assert_idle(engine)
    base = [outcomes[id(c), None] for c in color]
    tuned = [outcomes[id(c), "fr"] for c in color]
    assert not any(o.answer in french for o in base), [o.answer for o in base]
    assert not any(o.answer in english for o in tuned), [o.answer for o in tuned]
    assert report(color, base).query_acc >= 0.8
    assert report(color, tuned).query_acc >= 0.8
