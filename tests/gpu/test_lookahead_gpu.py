"""Decode look-ahead on a CUDA GPU (``runtime/lookahead.py``; on by default there).

- float32 + the torch backend: the same answers with look-ahead on and off, for the mixed batch
  the CPU test uses (queries greedy and sampled, captions, points, detects).
- bfloat16 + FlashAttention + graph-captured decode: a steady decode call with a look-ahead step
  queued makes no stream synchronisation (``torch.cuda.set_sync_debug_mode("error")`` raises on
  one; the read waits on an event only).
Everything skips without CUDA (tests/conftest.py); the fa test skips without sm90/flash-attn-4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from kestrel import Engine
from kestrel_kernels import fa_backend
from tests.conftest import fixture_dir
from tests.integration.conftest import FIXTURE_MODEL, assert_idle
from tests.integration.test_lookahead import _answers

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pictures() -> dict[str, np.ndarray]:
    d = fixture_dir() / "images"
    return {p.stem: np.asarray(Image.open(p).convert("RGB")) for p in sorted(d.glob("*.png"))}


def test_lookahead_answers_like_without_on_cuda(pictures) -> None:
    got = {}
    for lookahead in (False, True):
        with Engine(FIXTURE_MODEL, device="cuda", dtype="float32", attention_backend="torch",
                    kv_cache_pages=6000, max_batch_size=8) as engine:  # fmt: skip
            assert engine._executor.lookahead is True  # the CUDA default
            engine._executor.lookahead = lookahead
            got[lookahead] = _answers(engine, pictures)
            if lookahead:
                assert engine._executor.lookahead_counters.steps > 0
            assert_idle(engine)
    assert got[True] == got[False]


def test_steady_lookahead_step_does_not_sync(pictures) -> None:
    found = fa_backend.probe("cuda")
    if not found.ok:
        pytest.skip(f"fa backend unavailable: {found.reason}")
    with Engine(FIXTURE_MODEL, device="cuda", kv_cache_pages=6000, max_batch_size=8) as engine:
        sched, executor = engine._scheduler, engine._executor
        image = next(iter(pictures.values()))
        futures = [
            engine.submit_query(image, f"Question {i}?", settings={"max_tokens": 40})
            for i in range(4)
        ]
        checked = []

        def steady_steps() -> None:
            for _ in range(1000):  # bounded: requests that fail never all run
                if not sched.waiting and len(sched.running) >= 4:
                    break
                sched.step()
            else:
                return
            for _ in range(3):  # the look-ahead step is queued from the second on
                sched.step()
            if executor._ahead is None:
                return
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(5):
                    sched._decode()
                    checked.append(executor._ahead is not None)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        engine._loop.call(steady_steps)
        for f in futures:
            f.result(timeout=300)
        assert checked and all(checked), checked
        assert_idle(engine)
