"""No CUDA graph is captured, and no host memory pinned, while requests are served.

On CUDA the decode graphs are captured at start-up, and pinned host memory (crop staging,
uploads, read-backs) is taken then too; serving only replays and reuses. Proved here on the CPU
with recording stand-ins: ``GraphCapture`` (a "graph" that replays by recomputing into its
captured outputs), ``pinned_empty`` and ``Tensor.pin_memory`` record the thread and whether
the engine had started. 200 mixed requests from 8 threads then find every decode, prefill and
vision graph captured at start-up (and replayed), nothing captured or pinned after it, and the
same greedy answers as an engine without graphs (which runs the eager prefill and encoder).
The CUDA half (thread_local capture mode; a failed capture leaves its bucket eager) runs
against stand-ins of ``torch.cuda``'s capture calls.
"""

from __future__ import annotations

import contextlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import kestrel.runtime.build as build_mod
from kestrel import Engine
from kestrel.runtime import cuda_graphs, graph_set
from kestrel_kernels import pinned
from kestrel_kernels.backends import TORCH
from tests.integration.conftest import FIXTURE_MODEL, assert_idle


class Record:
    """What the stand-ins saw: (kind, thread name, engine started?)."""

    def __init__(self) -> None:
        self.started = False
        self.events: list[tuple[str, str, bool]] = []
        self.lock = threading.Lock()

    def add(self, kind: str) -> None:
        with self.lock:
            self.events.append((kind, threading.current_thread().name, self.started))

    def of(self, kind: str, *, after_start: bool) -> list[tuple[str, str, bool]]:
        return [e for e in self.events if e[0] == kind and e[2] == after_start]


class ReplayGraph:
    """Stands in for a captured CUDA graph: a replay recomputes into the captured outputs."""

    def __init__(self, fn, out) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        for old, new in zip(self.out, self.fn(), strict=True):
            old.copy_(new)


def recording_capture(record: Record):
    class RecordingCapture:
        def __init__(self, device) -> None:
            self.captures = 0

        def capture(self, fn):
            record.add("capture")
            self.captures += 1
            out = fn()
            return ReplayGraph(fn, out), out

    return RecordingCapture


@pytest.fixture
def record(monkeypatch) -> Record:
    rec = Record()

    def pinned_empty(nbytes: int) -> torch.Tensor:
        rec.add("pin")
        return torch.empty(nbytes, dtype=torch.uint8)

    def pin_memory(self, *args, **kwargs):
        rec.add("pin")
        return self

    monkeypatch.setattr(cuda_graphs, "GraphCapture", recording_capture(rec))
    monkeypatch.setattr(graph_set, "graphs_supported", lambda model, backend: True)
    monkeypatch.setattr(build_mod, "_pins_host", lambda device: True)  # staged as on CUDA
    monkeypatch.setattr(pinned, "pinned_empty", pinned_empty)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    return rec


def _requests(images) -> list[tuple]:
    """200 requests: queries (greedy and sampled), captions, points, detects over 6 images, so
    both prefix-cache hits and misses."""
    pics = list(images.values())[:6]
    greedy = {"temperature": 0.0, "max_tokens": 5}
    sampled = {"temperature": 0.5, "top_p": 0.3, "max_tokens": 7}
    kinds = []
    for i in range(200):
        image = pics[i % len(pics)]
        match i % 5:
            case 0 | 1:
                kinds.append(("query", image, f"What is shown {i % 7}?", greedy))
            case 2:
                kinds.append(("query", image, "Describe it.", sampled))
            case 3:
                kinds.append(("caption", image, "short", {"max_tokens": 6}))
            case _:
                kinds.append(("point" if i % 2 else "detect", image, "a thing", {}))
    return kinds


def _submit(engine: Engine, req: tuple):
    kind, image, text, settings = req
    if kind == "query":
        return engine.submit_query(image, text, settings=settings)
    if kind == "caption":
        return engine.submit_caption(image, length=text, settings=settings)
    if kind == "point":
        return engine.submit_point(image, text, settings=settings)
    return engine.submit_detect(image, text, settings=settings)


def _serve(engine: Engine, requests: list[tuple]) -> list:
    with ThreadPoolExecutor(8, thread_name_prefix="client") as pool:
        futures = list(pool.map(lambda r: _submit(engine, r), requests))
    return [f.result(timeout=300) for f in futures]


@pytest.fixture(scope="module")
def few_crops(tmp_path_factory) -> str:
    """The fixture model with at most 2 local crops an image: 3 vision graphs to capture on a
    CPU instead of 13 (each a full encoder run here)."""
    src, dst = Path(FIXTURE_MODEL), tmp_path_factory.mktemp("few-crops")
    for name in ("model.safetensors", "tokenizer.json"):
        (dst / name).symlink_to(src / name)
    config = json.loads((src / "config.json").read_text())
    config["config"]["vision"]["max_crops"] = 2
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_nothing_captured_or_pinned_while_serving(record, images, few_crops) -> None:
    requests = _requests(images)
    engine = Engine(few_crops, device="cpu", dtype="float32", kv_cache_pages=6000,
                    max_batch_size=8)  # fmt: skip
    record.started = True
    try:
        rt = engine.runtime
        graphs, prefill, vision = rt.decode_graphs, rt.prefill_graphs, rt.vision_graphs
        assert graphs is not None and prefill is not None and vision is not None
        n_vision = 1 + rt.config.vision.max_crops
        results = _serve(engine, requests)
        assert_idle(engine)
        assert graphs.captured == graphs.sizes == (1, 2, 4, 8) and graphs.failures == {}
        assert prefill.captured == prefill.shapes and prefill.failures == {}
        assert vision.captured == tuple(range(1, 1 + n_vision)) and vision.failures == {}
        assert graphs.replays > 0 and prefill.replays > 0 and vision.replays > 0
        staging = engine.runtime.crops._cropper.staging
        assert staging is not None and staging.takes > 0  # the crops went through it
    finally:
        engine.close()
    captures = record.of("capture", after_start=False)
    n_graphs = len(graphs.sizes) + len(prefill.shapes) + n_vision
    assert len(captures) == n_graphs and {t for _, t, _ in captures} == {"MainThread"}
    assert record.of("capture", after_start=True) == []
    assert record.of("pin", after_start=False)  # the staging, taken at start-up
    assert record.of("pin", after_start=True) == []
    assert len(results) == 200

    plain = Engine(few_crops, device="cpu", dtype="float32", kv_cache_pages=6000,
                   max_batch_size=8, attention_backend="torch")  # fmt: skip
    try:
        greedy = [i for i, r in enumerate(requests) if r[0] == "query" and not r[3].get("top_p")]
        want = _serve(plain, [requests[i] for i in greedy])
    finally:
        plain.close()
    assert [results[i].answer for i in greedy] == [w.answer for w in want]


class FakeCuda:
    """Stands in for the ``torch.cuda`` calls ``GraphCapture`` makes; records the capture
    mode and can fail a capture."""

    def __init__(self, fail: bool) -> None:
        self.fail, self.modes, self.synced = fail, [], 0

    def install(self, monkeypatch) -> None:
        stream = type("Stream", (), {"wait_stream": lambda self, other: None})
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: stream())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
        monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
        monkeypatch.setattr(torch.cuda, "graph", self.graph)
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)

    @contextlib.contextmanager
    def graph(self, graph, pool=None, capture_error_mode="global"):
        self.modes.append((graph, pool, capture_error_mode))
        yield
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")

    def synchronize(self, device=None) -> None:
        self.synced += 1


@pytest.mark.parametrize("fail", [False, True], ids=["captured", "capture-fails"])
def test_capture_is_thread_local_and_a_failure_leaves_the_bucket_eager(
    monkeypatch, model, fail: bool
) -> None:
    from kestrel.runtime.runtime import MoondreamRuntime

    rt = MoondreamRuntime(model, kv_cache_pages=2000, max_batch_size=2, attention_backend="torch")
    graphs = cuda_graphs.DecodeGraphs(model, rt.kv, rt.page_table.page_table, max_batch_size=2,
                                      backend=TORCH, capture=True)  # fmt: skip
    fake = FakeCuda(fail)
    fake.install(monkeypatch)
    graphs.capture_all()
    assert fake.modes == [("graph", "pool", "thread_local")] * 2
    if fail:
        assert graphs.captured == () and set(graphs.failures) == {1, 2} and fake.synced == 2
        assert "not permitted" in graphs.failures[1]
        hidden, logits = graphs.run([0], [0], None)  # eager: still answers
        assert hidden.shape[0] == 1 and torch.isfinite(logits).all()
    else:
        assert graphs.captured == (1, 2) and graphs.failures == {}
    graphs.capture_all()  # already done: nothing captured again
    assert len(fake.modes) == 2
