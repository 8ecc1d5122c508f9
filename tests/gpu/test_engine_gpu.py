"""The Engine end to end on a CUDA GPU.

- float32 + the torch attention backend: every skill's greedy answers equal the eager path's
  (cache on and off, one at a time and batched), as on CPU: the device plumbing (sampling
  generators, region heads, streams, page accounting) is right on CUDA.
- bfloat16 + FlashAttention + graph-captured decode (the production path): the bundled
  kestrel-tiny model keeps its accuracy with many requests batched, with cache hits and with
  mixed adapters, and pages are conserved.
Everything skips without CUDA (tests/conftest.py); the fa test skips without sm90/flash-attn-4.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from kestrel import Engine
from kestrel.engine.setup import DEFAULT_MODEL_DIR
from kestrel.reference.eager import EagerMoondream
from kestrel.tiny import synthetic
from kestrel.tiny.eval import evaluate
from kestrel_kernels import fa_backend
from tests.conftest import fixture_dir
from tests.integration.conftest import FIXTURE_MODEL, assert_idle
from tests.integration.test_engine_parity import CASES, _eager_run, _engine_run

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pictures() -> dict[str, np.ndarray]:
    d = fixture_dir() / "images"
    return {p.stem: np.asarray(Image.open(p).convert("RGB")) for p in sorted(d.glob("*.png"))}


@pytest.mark.parametrize("cache", [True, False], ids=["cache_on", "cache_off"])
def test_engine_on_cuda_matches_eager(pictures, cache: bool) -> None:
    with Engine(
        FIXTURE_MODEL,
        device="cuda",
        dtype="float32",
        attention_backend="torch",
        kv_cache_pages=12_000,
        enable_prefix_cache=cache,
    ) as engine:
        assert engine.runtime.crops.on_device  # crops cut on the GPU; the eager ones by libvips
        eager = EagerMoondream(engine.runtime.model, engine.runtime.tokenizer, backend="torch")
        for skill, img, kw in CASES:
            image = None if img is None else pictures[img]
            want = _eager_run(eager, skill, image, kw)
            for _ in range(2):
                got, _metrics = _engine_run(engine, skill, image, kw)
                assert got == want, (skill, img, kw)
        stream = engine.query(
            pictures["shapes_378"],
            "What?",
            settings={"temperature": 0, "max_tokens": 8},
            stream=True,
        )
        assert "".join(stream) == stream.result().answer
        assert_idle(engine)


def test_tiny_model_on_fa_with_graphs_batches_and_adapters() -> None:
    found = fa_backend.probe("cuda")
    if not found.ok:
        pytest.skip(f"fa backend unavailable: {found.reason}")
    cases = synthetic.eval_cases(21, 48)
    with Engine(None, device="cuda", max_batch_size=32, kv_cache_pages=20_000) as engine:
        assert engine.runtime.dtype.is_floating_point and engine.runtime.attention_backend
        cold = evaluate(engine, cases)
        warm = evaluate(engine, cases)  # every image and prompt now hits the cache
        engine.load_adapter("fr", DEFAULT_MODEL_DIR / "lora-french")
        french = evaluate(
            engine, cases, adapter="fr", expect=lambda a: synthetic.FRENCH_COLORS.get(a, a)
        )
        assert_idle(engine)
    print("\ncold", cold.to_dict(), "warm", warm.to_dict(), "french", french.to_dict())
    for rep in (cold, warm):
        assert rep.query_acc >= 0.75 and rep.point_acc >= 0.7 and rep.detect_acc >= 0.6
    assert abs(cold.query_acc - warm.query_acc) <= 3 / len(cases)
    assert french.query_acc >= 0.7
