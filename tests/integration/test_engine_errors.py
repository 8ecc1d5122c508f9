"""Every error path of the public API, each followed by a request that succeeds; injected
model faults fail only the requests they touch."""

from __future__ import annotations

import numpy as np
import pytest

import kestrel_kernels
from kestrel import (
    CapacityError,
    Engine,
    EngineClosedError,
    InvalidInputError,
    KestrelError,
    ModelError,
    ModelLoadError,
    PromptTooLongError,
    UnknownAdapterError,
)
from tests.conftest import fixture_dir
from tests.integration.conftest import FIXTURE_MODEL, GREEDY, assert_idle, scheduler_paused


def _ok(engine) -> None:
    r = engine.query(None, "still there?", settings=GREEDY)
    assert r.finish_reason == "length" and len(r.tokens) == GREEDY["max_tokens"]


BAD_IMAGES = [
    b"this is not an image",
    b"",
    "/no/such/image.png",
    np.full((4, 4, 3), 255.0, dtype=np.float32),  # float images are read as 0..1
    np.zeros((4, 4, 3), dtype=np.int32),
    np.zeros((0, 10, 3), dtype=np.uint8),
    object(),
]


@pytest.mark.parametrize("image", BAD_IMAGES, ids=lambda v: type(v).__name__)
def test_bad_image(make_engine, image) -> None:
    engine = make_engine()
    with pytest.raises(InvalidInputError, match="image"):
        engine.query(image, "What is it?")
    with pytest.raises(InvalidInputError):
        engine.submit_point(image, "cat")
    _ok(engine)


BAD_SETTINGS = [
    ({"temprature": 0.1}, "unknown settings"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_objects": 0}, "max_objects"),
    ({"seed": -3}, "seed"),
    ([("temperature", 0)], "dict"),
]


@pytest.mark.parametrize(("settings", "match"), BAD_SETTINGS)
def test_bad_settings(make_engine, settings, match) -> None:
    engine = make_engine()
    with pytest.raises(InvalidInputError, match=match):
        engine.query(None, "hi", settings=settings)
    _ok(engine)


def test_bad_text_inputs(make_engine, images) -> None:
    engine = make_engine()
    img = images["shapes_378"]
    for question in ("", "   ", None, 42):
        with pytest.raises(InvalidInputError, match="question"):
            engine.query(img, question)
    with pytest.raises(InvalidInputError, match="object"):
        engine.detect(img, " ")
    with pytest.raises(InvalidInputError, match="length"):
        engine.caption(img, length="epic")
    with pytest.raises(InvalidInputError, match="needs an image"):
        engine.caption(None)
    with pytest.raises(InvalidInputError, match="spatial"):
        engine.query(img, "here?", spatial_refs=[[0.5, 1.5]])
    with pytest.raises(PromptTooLongError, match="context"):
        engine.query(img, "word " * 1500)
    _ok(engine)


def test_unknown_adapter_then_loaded(make_engine) -> None:
    engine = make_engine()
    with pytest.raises(UnknownAdapterError, match="no adapter named 'x'"):
        engine.query(None, "hi", adapter="x")
    with pytest.raises(ModelLoadError, match="adapter"):
        engine.load_adapter("broken", fixture_dir() / "config.json")
    engine.load_adapter("x", fixture_dir() / "adapter")
    assert engine.adapters() == ["x"]
    base = engine.query(None, "hi", settings=GREEDY)
    tuned = engine.query(None, "hi", settings=GREEDY, adapter="x")
    assert tuned.tokens != base.tokens
    _ok(engine)


def test_capacity_error_fails_alone(make_engine, images) -> None:
    engine = make_engine(kv_cache_pages=800, max_batch_size=4)
    img = images["shapes_378"]
    ok = engine.submit_query(img, "fits", settings={**GREEDY, "max_tokens": 20})
    too_big = engine.submit_query(img, "never fits", settings={"max_tokens": 200})
    with pytest.raises(CapacityError, match="kv_cache_pages"):
        too_big.result(timeout=60)
    assert ok.result(timeout=60).finish_reason == "length"
    assert engine.stats().requests_failed == 1
    _ok(engine)


def test_model_loading_errors(tmp_path, monkeypatch) -> None:
    with pytest.raises(ModelLoadError, match="cannot load model"):
        Engine(tmp_path / "missing")
    # A hub id that cannot be had: offline (the real huggingface_hub asked for its cache) it
    # fails at once; online without network it fails the same way after the hub client's
    # retries (tens of seconds: tests/unit/test_weights.py fakes that path).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="cannot load model"):
        Engine("someone/not-a-local-model", device="cpu")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr("kestrel.engine.setup.DEFAULT_MODEL_DIR", tmp_path / "absent")
    with pytest.raises(ModelLoadError, match="embedded"):
        Engine()
    with pytest.raises(InvalidInputError, match="dtype"):
        Engine(FIXTURE_MODEL, dtype="float8")
    with pytest.raises(InvalidInputError, match="max_batch_size"):
        Engine(FIXTURE_MODEL, max_batch_size=0)
    with pytest.raises(KestrelError):
        Engine(FIXTURE_MODEL, device="cuda:7" if not _cuda() else "nonsense")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_close_fails_pending_and_refuses_new(make_engine) -> None:
    engine = make_engine(max_batch_size=1)
    long = {"temperature": 0.0, "max_tokens": 500}
    futures = [engine.submit_query(None, f"q{i}", settings=long) for i in range(3)]
    engine.close()
    for f in futures:
        with pytest.raises(EngineClosedError):
            f.result(timeout=60)
    with pytest.raises(EngineClosedError):
        engine.query(None, "hi")
    s = engine.stats()  # still answers after close, from the idle state
    assert s.running == 0 and s.pages_private == 0 and s.pages_locked == 0
    engine.check_integrity()
    engine.close()  # idempotent


class _Faults:
    """Raises from inside the model (its attention kernel, after the step's K/V were written to
    their pages) on the prefill of chosen sequences / chosen decode calls of one runtime, so the
    failure paths really run with pages taken and partly written."""

    def __init__(self, monkeypatch, runtime) -> None:
        self.prefill_calls = self.decode_calls = 0
        self.fail_prefill: set[int] = set()
        self.fail_decode: set[int] = set()
        self._armed: str | None = None
        real_attention = kestrel_kernels.attend
        real_prefill, real_decode = runtime.prefill_sequences, runtime.decode_step
        ordinal: dict[int, int] = {}  # id(sequence) -> 1, 2, ... in the order first prefilled

        def paged_attention(*args, **kw):
            if self._armed is not None:
                raise RuntimeError(f"injected {self._armed} fault")
            return real_attention(*args, **kw)

        def prefill_sequences(states):
            # a batched prefill fails when it holds a doomed sequence; the executor then retries
            # each sequence alone, and only the doomed one fails again
            self.prefill_calls += 1
            numbers = [ordinal.setdefault(id(s), len(ordinal) + 1) for s in states]
            fail = any(n in self.fail_prefill for n in numbers)
            return self._run("prefill", fail, real_prefill, (states,), {})

        def decode_step(*args, **kw):
            self.decode_calls += 1
            fail = self.decode_calls in self.fail_decode
            return self._run("decode", fail, real_decode, args, kw)

        monkeypatch.setattr(kestrel_kernels, "attend", paged_attention)
        monkeypatch.setattr(runtime, "prefill_sequences", prefill_sequences)
        monkeypatch.setattr(runtime, "decode_step", decode_step)

    def _run(self, what: str, fail: bool, fn, args, kw):
        self._armed = what if fail else None
        try:
            return fn(*args, **kw)
        finally:
            self._armed = None


def test_fault_in_prefill_fails_only_that_request(make_engine, images, monkeypatch) -> None:
    engine = make_engine()
    faults = _Faults(monkeypatch, engine.runtime)
    faults.fail_prefill = {2}
    img = images["shapes_378"]
    with scheduler_paused(engine):
        futures = [engine.submit_query(img, f"question {i}?", settings=GREEDY) for i in range(3)]
    outcomes = []
    for f in futures:
        try:
            outcomes.append(f.result(timeout=60).finish_reason)
        except ModelError as exc:
            assert "injected prefill fault" in str(exc)
            outcomes.append("failed")
    assert outcomes == ["length", "failed", "length"]
    # request 1 misses and encodes the image; 2 and 3 wait for its insert and are prefilled
    # together as hits; that call fails, then each runs alone: 4 prefill calls
    assert faults.prefill_calls == 4
    assert_idle(engine)
    _ok(engine)


def test_fault_in_decode_fails_only_that_step(make_engine, monkeypatch) -> None:
    engine = make_engine(max_batch_size=2)
    faults = _Faults(monkeypatch, engine.runtime)
    faults.fail_decode = {2}
    with scheduler_paused(engine):
        futures = [engine.submit_query(None, f"q {i}", settings=GREEDY) for i in range(4)]
    results = []
    for f in futures:
        try:
            results.append(f.result(timeout=60).finish_reason)
        except ModelError as exc:
            assert "injected decode fault" in str(exc)
            results.append("failed")
    # the first two share every step of their batch; the next two run after them
    assert results == ["failed", "failed", "length", "length"]
    s = engine.stats()
    assert (s.requests_failed, s.requests_served) == (2, 2)
    assert_idle(engine)
    _ok(engine)
