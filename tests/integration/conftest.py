from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from PIL import Image

from kestrel.moondream.model import MoondreamModel
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.tokens import TextToken
from tests.conftest import fixture_dir


@pytest.fixture(scope="session")
def model() -> MoondreamModel:
    return MoondreamModel.from_pretrained(fixture_dir(), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def images() -> dict[str, np.ndarray]:
    d = fixture_dir() / "images"
    return {p.stem: np.asarray(Image.open(p).convert("RGB")) for p in sorted(d.glob("*.png"))}


@pytest.fixture
def make_runtime(model):
    made = []

    def make(**kw) -> MoondreamRuntime:
        kw.setdefault("kv_cache_pages", 6000)
        kw.setdefault("max_batch_size", 8)
        rt = MoondreamRuntime(model, **kw)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.check_integrity()


def text_tokens(ids) -> list[TextToken]:
    return [TextToken(int(i)) for i in ids]


FIXTURE_MODEL = str(fixture_dir())
GREEDY = {"temperature": 0.0, "max_tokens": 6}


def assert_idle(engine) -> None:
    """The engine is idle, every invariant holds and every page is free or cached."""
    engine.check_integrity()
    s = engine.stats()
    assert (s.running, s.queue_depth) == (0, 0), s
    assert s.pages_locked == 0 and s.pages_private == 0, s
    assert s.pages_free + s.pages_cached == s.pages_total, s


@pytest.fixture
def make_engine():
    """Engines on the fixture model (float32, CPU); each is checked idle and closed after."""
    from kestrel import Engine

    made = []

    def make(**kw):
        kw.setdefault("device", "cpu")
        kw.setdefault("dtype", "float32")
        kw.setdefault("kv_cache_pages", 6000)
        kw.setdefault("max_batch_size", 8)
        engine = Engine(kw.pop("model", FIXTURE_MODEL), **kw)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        if not engine.closed:
            assert_idle(engine)
        engine.close()


@contextlib.contextmanager
def scheduler_paused(engine):
    """Hold the scheduler thread between steps, so requests submitted inside the block are all
    in its inbox when it resumes (deterministic batching in tests)."""
    gate = engine._loop.pause()
    try:
        yield
    finally:
        gate.set()
