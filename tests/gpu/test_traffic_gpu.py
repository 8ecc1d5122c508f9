"""Traffic from the first moment: 16 threads pin host memory, upload and submit while the
engine starts (its decode graphs captured then) and serves. Every request succeeds, every
decode bucket was captured at start-up and none failed, and the pinned memory the runtime
uses was taken before it served (the process's ring and the crop staging).

A capture in CUDA's global mode is invalidated by another thread's ``pin_memory`` or upload;
the engine captures in thread_local mode and never while serving, so this holds whatever the
other threads do. Skips without sm90/flash-attn-4 (the graphs need the fa backend).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from kestrel import Engine
from kestrel.engine.setup import DEFAULT_MODEL_DIR
from kestrel_kernels import fa_backend, pinned

pytestmark = pytest.mark.gpu

THREADS, PER_THREAD = 16, 8


def test_requests_during_start_up_never_fail() -> None:
    found = fa_backend.probe("cuda")
    if not found.ok:
        pytest.skip(f"fa backend unavailable: {found.reason}")
    holder: list[Engine] = []
    ready, stop = threading.Event(), threading.Event()
    failures: list[Exception] = []
    answers: list[str] = []
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        images = [rng.integers(0, 256, (480 + 40 * i, 640, 3), np.uint8) for i in range(3)]
        while not ready.is_set() and not stop.is_set():  # what broke global-mode captures
            host = torch.ones(1 << 16).pin_memory()
            host.to("cuda", non_blocking=True)
            time.sleep(0.001)
        engine = holder[0]
        futures = [engine.submit_query(images[i % 3], f"What is this {i}?",
                                       settings={"temperature": 0.5 * (i % 2), "max_tokens": 6})
                   for i in range(PER_THREAD)]  # fmt: skip
        for f in futures:
            try:
                result = f.result(timeout=300)
                with lock:
                    answers.append(result.answer)
            except Exception as exc:  # every failure is reported below
                with lock:
                    failures.append(exc)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(THREADS)]
    for t in threads:
        t.start()
    try:
        engine = Engine(
            DEFAULT_MODEL_DIR, device="cuda", dtype="bfloat16", attention_backend="fa",
            max_batch_size=16, kv_cache_pages=40_000,
        )  # fmt: skip
    except BaseException:
        stop.set()
        raise
    holder.append(engine)
    ready.set()
    try:
        for t in threads:
            t.join(timeout=600)
        graphs = engine.runtime.decode_graphs
        assert graphs is not None
        assert graphs.failures == {} and graphs.captured == graphs.sizes == (1, 2, 4, 8, 16)
        assert failures == [] and len(answers) == THREADS * PER_THREAD
        assert pinned.ring(torch.device("cuda")) is not None
        staging = engine.runtime.crops._cropper.staging
        assert staging is not None and staging.takes > 0
    finally:
        engine.close()
