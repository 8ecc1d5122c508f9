"""Many callers at once, streaming, and what the cache reuses."""

from __future__ import annotations

import asyncio
import io
import threading

import numpy as np
import pytest
from PIL import Image

from tests.integration.conftest import GREEDY

QUESTIONS = ["What is it?", "How many?", "Which color?", "Where?"]


def _requests(images: dict[str, np.ndarray]):
    """(kind, image, arg) for a mix of skills, images and text-only."""
    out = []
    for i in range(24):
        name = ("shapes_378", "tall_300x1000", None)[i % 3]
        kind = ("query", "query", "caption", "point", "detect", "query")[i % 6]
        if kind != "query" and name is None:
            name = "shapes_378"
        out.append((kind, name, QUESTIONS[i % len(QUESTIONS)]))
    return out


def _call(engine, images, kind: str, name: str | None, text: str):
    image = None if name is None else images[name]
    settings = {**GREEDY, "max_objects": 2}
    if kind == "query":
        r = engine.query(image, text, settings=settings)
        return r.answer, r.tokens
    if kind == "caption":
        r = engine.caption(image, settings=settings)
        return r.caption, r.tokens
    r = getattr(engine, kind)(image, text, settings=settings)
    return (r.points if kind == "point" else r.objects), r.tokens


def test_concurrent_callers_get_what_they_get_alone(make_engine, images) -> None:
    reqs = _requests(images)
    alone_engine = make_engine(max_batch_size=1)
    alone = [_call(alone_engine, images, *r) for r in reqs]

    engine = make_engine(max_batch_size=8)
    got: list = [None] * len(reqs)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(reqs))

    def worker(i: int) -> None:
        try:
            barrier.wait()
            got[i] = _call(engine, images, *reqs[i])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert got == alone
    assert engine.stats().requests_served == len(reqs)


def test_submitted_futures_batch_together(make_engine, images) -> None:
    engine = make_engine(max_batch_size=8)
    counters = engine._scheduler.counters
    futures = [engine.submit_query(None, f"question {i}", settings=GREEDY) for i in range(20)]
    answers = [f.result(timeout=60).answer for f in futures]
    batched_steps = counters.decode_steps
    one = [engine.query(None, f"question {i}", settings=GREEDY).answer for i in range(20)]
    assert answers == one
    # one at a time, each request's answer is max_tokens long and feeds all but its last
    # token (the prefill chose the first); batched, 8 share each step
    assert all(len(f.result().tokens) == GREEDY["max_tokens"] for f in futures)
    assert counters.decode_steps - batched_steps == 20 * (GREEDY["max_tokens"] - 1)
    assert batched_steps <= 4 * GREEDY["max_tokens"]


def test_stream_equals_blocking(make_engine, images) -> None:
    engine = make_engine()
    img = images["shapes_378"]
    blocking = engine.query(img, "What is it?", settings={**GREEDY, "max_tokens": 8})
    stream = engine.query(img, "What is it?", settings={**GREEDY, "max_tokens": 8}, stream=True)
    chunks = list(stream)
    assert len(chunks) > 1
    assert "".join(chunks) == blocking.answer
    assert stream.result().tokens == blocking.tokens
    cap = engine.caption(img, settings=GREEDY)
    assert "".join(engine.caption(img, settings=GREEDY, stream=True)) == cap.caption


def test_async_twins(make_engine, images) -> None:
    engine = make_engine()
    img = images["shapes_378"]
    want = engine.query(img, "Where?", settings=GREEDY)
    want_pt = engine.point(img, "dot", settings={"max_objects": 2})

    async def main():
        r, pt = await asyncio.gather(
            engine.aquery(img, "Where?", settings=GREEDY),
            engine.apoint(img, "dot", settings={"max_objects": 2}),
        )
        stream = await engine.aquery(img, "Where?", settings=GREEDY, stream=True)
        chunks = [c async for c in stream]
        done = await stream.result()
        cap = await engine.acaption(img, settings=GREEDY)
        det = await engine.adetect(img, "dot", settings={"max_objects": 1})
        return r, pt, chunks, done, cap, det

    r, pt, chunks, done, cap, det = asyncio.run(main())
    assert r.answer == want.answer and pt.points == want_pt.points
    assert "".join(chunks) == want.answer and done.tokens == want.tokens
    assert cap.caption == engine.caption(img, settings=GREEDY).caption
    assert len(det.objects) == 1


def test_cached_tokens_cold_then_image_prefix(make_engine, images) -> None:
    engine = make_engine()
    cfg = engine.config
    img = images["shapes_378"]
    cold = engine.query(img, "What is it?", settings=GREEDY)
    assert cold.metrics.cached_tokens == 0
    assert cold.metrics.input_tokens > cfg.prefix_len
    warm = engine.query(img, "How many?", settings=GREEDY)
    assert warm.metrics.cached_tokens >= cfg.prefix_len  # BOS + the whole image block
    assert engine.stats().vision_encodes_skipped == 1


def test_same_pixels_in_other_containers_hit(make_engine, images) -> None:
    engine = make_engine()
    arr = images["tall_300x1000"]
    engine.query(arr, "What is it?", settings=GREEDY)
    pil = Image.fromarray(arr)
    png = io.BytesIO()
    pil.save(png, format="PNG")
    for same in (pil, png.getvalue(), engine.prepare_image(arr)):
        r = engine.query(same, "What is it?", settings=GREEDY)
        assert r.metrics.cached_tokens >= engine.config.prefix_len
    other = arr.copy()
    other[0, 0, 0] ^= 1  # one bit of one pixel
    r = engine.query(other, "What is it?", settings=GREEDY)
    assert r.metrics.cached_tokens == 0


@pytest.mark.parametrize("cancel_after", [0, 2])
def test_cancel_queued_and_running(make_engine, cancel_after: int) -> None:
    engine = make_engine(max_batch_size=1)
    long = {"temperature": 0.0, "max_tokens": 400}
    first = engine.query(None, "Long story", settings=long, stream=True)
    chunks = iter(first)
    for _ in range(cancel_after):
        next(chunks)
    queued = engine.submit_query(None, "queued", settings=GREEDY)
    assert queued.cancel()  # still waiting behind the running one
    assert first.cancel()
    after = engine.query(None, "after", settings=GREEDY)
    assert after.finish_reason == "length"
    s = engine.stats()
    assert s.requests_cancelled == 2 and s.running == 0
