"""The start-up choice of decode kernel (``kestrel_kernels/decode_tune.py``) on a CUDA GPU:
both kernels timed at Moondream's shapes over a pool's pages, and an engine that starts with
``KESTREL_DECODE_KERNEL=auto`` measures every decode bucket, captures them, and answers as an
engine with FlashAttention forced does (but for bfloat16 near-ties). Skips without CUDA,
Triton or the ``fa`` backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from kestrel import Engine
from kestrel_kernels import decode_route, fa_backend
from kestrel_kernels.backends import FLASH
from kestrel_kernels.decode_tune import TOLERANCE, tune_pool
from tests.conftest import FIXTURES, fixture_dir
from tests.integration.conftest import FIXTURE_MODEL, assert_idle
from tests.integration.test_fp8_kv_engine import write_kv_scaled

pytestmark = pytest.mark.gpu

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def needs_fa():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    found = fa_backend.probe("cuda")
    if not found.ok:
        pytest.skip(f"fa backend unavailable: {found.reason}")
    kernel = decode_route.get_decode_kernel()
    yield
    decode_route.set_decode_kernel(kernel)


def test_both_kernels_are_timed_at_moondream_shapes() -> None:
    pool = 64 * 900
    k = torch.zeros(pool, 32, 64, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    decode_route.set_decode_kernel("auto")
    trials = tune_pool(k, v, (1, 8, 64), width=2048, heads=32)
    for t in trials:
        print(f"batch {t.batch}: {t.choice} ({t.reason}); fa {t.fa_ms} ms, triton "
              f"{t.triton_ms} ms in {t.config}, diff {t.max_diff:.2g}")  # fmt: skip
    assert [t.batch for t in trials] == [1, 8, 64]
    for t in trials:
        assert t.max_diff <= TOLERANCE, t  # the kernels agree at these shapes
        assert t.fa_ms > 0 and t.triton_ms > 0 and t.choice in ("fa", "triton")


def test_an_engine_measures_each_bucket_and_answers_as_with_fa() -> None:
    d = fixture_dir() / "images"
    image = np.asarray(Image.open(next(iter(sorted(d.glob("*.png"))))).convert("RGB"))
    answers = {}
    for kernel in ("fa", "auto"):
        decode_route.set_decode_kernel(kernel)
        with Engine(FIXTURE_MODEL, device="cuda", kv_cache_pages=6000,
                    max_batch_size=8) as engine:  # fmt: skip
            rt = engine.runtime
            if kernel == "auto":
                assert [t.batch for t in rt.decode_trials] == list(rt.decode_graphs.sizes)
                route = rt.attention_backend.decode_route  # served on the measured route
                assert route.table == {t.batch: t.choice for t in rt.decode_trials}
                assert rt.decode_graphs.backend is rt.attention_backend
            else:
                assert rt.decode_trials == [] and rt.attention_backend is FLASH
            assert rt.decode_graphs.captured == rt.decode_graphs.sizes
            futures = [engine.submit_query(image, f"Question {i}?", settings={"max_tokens": 12})
                       for i in range(5)]  # fmt: skip
            answers[kernel] = [f.result(timeout=120).answer for f in futures]
            assert_idle(engine)
    # bfloat16 sums in another order in each kernel: a near-tie may flip one greedy token, so
    # most answers, not all, must match word for word (the kernels' outputs are compared
    # within the shared bound in test_triton_decode_gpu.py)
    same = sum(a == b for a, b in zip(answers["auto"], answers["fa"], strict=True))
    assert same >= 4, answers


def test_fp8_pages_are_checked_then_captured(tmp_path) -> None:
    """The md3-tiny-a-fp8 fixture with KV scales calibrated on the CPU (the fixture itself has
    none, and is refused) and FP8 pages: the Triton kernel is checked against the scaled
    reference at start-up, agrees, serves FP8 decode, and the decode buckets are captured
    through it."""
    image = np.asarray(Image.open(FIXTURES / "md3-tiny-a/images/shapes_378.png").convert("RGB"))
    scaled = write_kv_scaled(tmp_path, image)
    decode_route.set_decode_kernel("auto")
    with Engine(str(scaled), device="cuda", kv_dtype="fp8",
                kv_cache_pages=6000, max_batch_size=4) as engine:  # fmt: skip
        rt = engine.runtime
        assert [(t.batch, t.choice) for t in rt.decode_trials] == [(1, "triton"), (4, "triton")]
        assert rt.attention_backend.decode_route.fp8 and rt.decode_graphs is not None
        assert rt.decode_graphs.captured == rt.decode_graphs.sizes
        result = engine.query(None, "Say something.", settings={"max_tokens": 8})
        assert result.metrics.output_tokens > 0
        assert_idle(engine)
