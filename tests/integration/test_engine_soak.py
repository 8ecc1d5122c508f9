"""Soak: a thousand random requests (valid and invalid, random settings, cancellations,
injected model faults) from several threads on a page budget small enough that eviction and
capacity waits happen all the time. Afterwards nothing is leaked and every invariant holds."""

from __future__ import annotations

import random
import threading
from collections import Counter
from concurrent.futures import CancelledError

import numpy as np
import pytest

import kestrel_kernels
from kestrel import CapacityError, InvalidInputError, ModelError
from tests.integration.conftest import assert_idle

N_THREADS = 4
# 1,000 requests: each outcome (served, invalid, capacity, cancelled, fault) occurs dozens of times
PER_THREAD = 250
PAGES = 1700  # two image prompts (730 positions each) and some text at a time


class _RandomFaults:
    """Makes ~1% of attention calls (prefill and decode) raise from inside the model."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.real = kestrel_kernels.attend
        self.injected = 0

    def __call__(self, *args, **kw):
        if self.rng.random() < 0.01:
            self.injected += 1
            raise RuntimeError("injected soak fault")
        return self.real(*args, **kw)


def _random_request(engine, rng: random.Random, images: list[np.ndarray]):
    """Submit one random request; returns (future or None, expected kind)."""
    r = rng.random()
    settings = {"max_tokens": rng.randint(1, 8)}
    if rng.random() < 0.5:
        settings |= {"temperature": rng.choice([0.0, 0.5, 1.0]), "top_p": rng.uniform(0.1, 1)}
    if rng.random() < 0.3:
        settings["seed"] = rng.randrange(1 << 30)
    img = rng.choice(images)
    if r < 0.55:
        return engine.submit_query(None, f"question {rng.randrange(40)}", settings=settings)
    if r < 0.70:
        return engine.submit_query(img, rng.choice(["What?", "Why?", "Who?"]), settings=settings)
    if r < 0.75:
        return engine.submit_caption(img, length="short", settings=settings)
    if r < 0.80:
        return engine.submit_point(img, "dot", settings={"max_objects": rng.randint(1, 3)})
    if r < 0.85:
        return engine.submit_detect(img, "box", settings={"max_objects": rng.randint(1, 2)})
    if r < 0.88:  # can never fit the pool: fails alone with CapacityError
        return engine.submit_query(img, "long", settings={"max_tokens": 1200})
    bad = rng.choice(
        [
            lambda: engine.submit_query(None, "", settings=settings),
            lambda: engine.submit_query(None, "q", settings={"max_tokens": -1}),
            lambda: engine.submit_query(b"garbage", "q"),
            lambda: engine.submit_caption(img, length="nope"),
        ]
    )
    return bad()


def _worker(engine, seed: int, images, tally: Counter, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    local: Counter = Counter()
    inflight = []
    for _ in range(PER_THREAD):
        try:
            fut = _random_request(engine, rng, images)
        except InvalidInputError:
            local["invalid"] += 1
            continue
        if rng.random() < 0.08:
            fut.cancel()  # queued or running: both must release everything
        inflight.append(fut)
        if len(inflight) >= 8:
            _settle(inflight.pop(0), local)
    for fut in inflight:
        _settle(fut, local)
    with lock:
        tally.update(local)


def _settle(fut, tally: Counter) -> None:
    try:
        fut.result(timeout=300)
        tally["served"] += 1
    except CancelledError:
        tally["cancelled"] += 1
    except CapacityError:
        tally["capacity"] += 1
    except ModelError as exc:
        assert "injected soak fault" in str(exc), exc
        tally["model_error"] += 1


@pytest.mark.slow
def test_soak(make_engine, monkeypatch) -> None:
    faults = _RandomFaults(seed=7)
    monkeypatch.setattr(kestrel_kernels, "attend", faults)
    engine = make_engine(kv_cache_pages=PAGES, max_batch_size=6)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (40 + 8 * i, 48, 3), dtype=np.uint8) for i in range(3)]
    tally: Counter = Counter()
    lock = threading.Lock()
    threads = [
        threading.Thread(target=_worker, args=(engine, seed, images, tally, lock))
        for seed in range(N_THREADS)
    ]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        engine.check_integrity()  # between scheduler steps, mid-soak
        threads[0].join(timeout=0.5)
    for t in threads:
        t.join()

    stats = engine.stats()
    total = N_THREADS * PER_THREAD
    print(
        f"\nsoak: {total} requests: {dict(tally)}; faults injected {faults.injected}; "
        f"evicted pages {stats.evictions}; vision encodes skipped "
        f"{stats.vision_encodes_skipped}; hit rate {stats.hit_rate:.2f}; pages leaked "
        f"{stats.pages_total - stats.pages_free - stats.pages_cached}"
    )
    assert sum(tally.values()) == total
    assert tally["served"] > total // 2 and tally["invalid"] > 0 and tally["capacity"] > 0
    assert tally["cancelled"] > 0 and faults.injected > 0 and tally["model_error"] > 0
    assert stats.evictions > 0  # the budget really was tight
    assert stats.requests_served == tally["served"]
    assert stats.requests_failed == tally["capacity"] + tally["model_error"]
    monkeypatch.setattr(kestrel_kernels, "attend", faults.real)
    assert_idle(engine)
