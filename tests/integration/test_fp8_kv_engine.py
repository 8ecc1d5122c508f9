"""FP8 KV pages end to end (opt-in ``kv_dtype="fp8"``): md3-tiny-a-fp8 with per-layer
``kv_quantizer`` scales (calibrated here: each layer's largest |K| and |V| over an image query,
over 448, with headroom) stores e4m3 pages at a quarter of float32's bytes, holding exactly
the e4m3-rounded K/V; the Engine (``kv_dtype="fp8"``) answers the same with the cache on and
off;
a checkpoint without scales, or an unknown kv_dtype, is refused with a clear message."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from kestrel.errors import InvalidInputError, ModelLoadError
from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.weights import load_kv_scales
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.tokens import TextToken
from kestrel_kernels.contract import KV_FP8_DTYPE, quantize_kv
from tests.conftest import FIXTURES
from tests.integration.conftest import assert_idle  # noqa: F401
from tests.integration.test_engine_md3 import _submit
from tests.integration.test_fp8_fixture import CASES, _result_key

FP8 = FIXTURES / "md3-tiny-a-fp8"
IMAGE = FIXTURES / "md3-tiny-a" / "images" / "shapes_378.png"
STEPS = 6


PROMPT = [TextToken(i) for i in (0, 439, 2, 302, 333, 272, 271, 3)]  # BOS + a query


def _decode(rt: MoondreamRuntime, image) -> list[torch.Tensor]:
    state, logits = rt.start_sequence(PROMPT, image, max_new_tokens=STEPS)
    out = [logits.float()]
    for t in range(STEPS):
        out.append(rt.decode_step([state], [TextToken(100 + 7 * t)])[0].float())
    rt.release_sequence(state)
    return out


@pytest.fixture(scope="module")
def image() -> np.ndarray:
    return np.asarray(Image.open(IMAGE).convert("RGB"))


@pytest.fixture(scope="module")
def scaled(tmp_path_factory, image) -> Path:
    return write_kv_scaled(tmp_path_factory.mktemp("kv-scaled"), image)


def write_kv_scaled(out: Path, image: np.ndarray) -> Path:
    """md3-tiny-a-fp8 plus kv_quantizer scales calibrated on one image query (on the CPU),
    written to ``out`` (also used by tests/gpu/test_decode_tune_gpu.py)."""
    model = MoondreamModel.from_pretrained(FP8)
    rt = MoondreamRuntime(model, kv_cache_pages=1000, max_batch_size=1, enable_prefix_cache=False)
    _decode(rt, image)
    sd = load_file(str(FP8 / "model.safetensors"))
    for i in range(model.config.text.n_layers):
        for w, cache in (("k", rt.kv.k[i]), ("v", rt.kv.v[i])):
            headroom = 1.25  # other prompts may reach a little further
            sd[f"text_model.transformer.h.{i}.kv_quantizer.{w}_scale"] = (
                cache.abs().max().float() * headroom / 448
            ).reshape(())
    save_file(sd, str(out / "model.safetensors"))
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(FP8 / name, out / name)
    return out


def test_fp8_pages_hold_the_rounded_kv(scaled: Path, image) -> None:
    """Layer 0's K/V (its input is the embedding, the same in both runs) are stored exactly as
    e4m3 of K / scale; the logits then move by e4m3's error, which this tiny random model
    amplifies (attention scores of ~100 on 64-wide heads: measured 0.3-9.5 on logits of
    34-54), and the same run twice gives the same logits."""
    model = MoondreamModel.from_pretrained(scaled)
    kv_scales = load_kv_scales(scaled, model.config)
    assert kv_scales is not None
    fp8 = MoondreamRuntime(model, kv_cache_pages=1000, max_batch_size=1, kv_scales=kv_scales)
    exact = MoondreamRuntime(model, kv_cache_pages=1000, max_batch_size=1)
    assert fp8.kv.k[0].dtype == KV_FP8_DTYPE and fp8.kv.bytes * 4 == exact.kv.bytes
    got, want = _decode(fp8, image), _decode(exact, image)
    fp8.check_integrity()
    s = kv_scales[0]
    layer0 = ((fp8.kv.k[0], exact.kv.k[0], s.k), (fp8.kv.v[0], exact.kv.v[0], s.v))
    for pages, exact_pages, scale in layer0:
        rounded = quantize_kv(exact_pages, scale)
        assert torch.equal(pages.view(torch.uint8), rounded.view(torch.uint8))
        assert float(pages.float().abs().max()) > 100  # the scale puts K/V high in e4m3's range
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert 0 < float((g - w).abs().max()) < 0.25 * float(w.abs().max()), step
    again = MoondreamRuntime(model, kv_cache_pages=1000, max_batch_size=1, kv_scales=kv_scales)
    assert all(torch.equal(a, b) for a, b in zip(_decode(again, image), got, strict=True))


def test_engine_fp8_kv_answers_cache_on_and_off(make_engine, scaled: Path) -> None:
    answers = {}
    for cache in (False, True):
        engine = make_engine(model=str(scaled), kv_dtype="fp8", enable_prefix_cache=cache,
                             kv_cache_pages=8000)  # fmt: skip
        assert engine.runtime.kv.k[0].dtype == KV_FP8_DTYPE
        assert engine.runtime.decode_graphs is None
        for _round in range(2 if cache else 1):  # with the cache, the second round hits it
            for case in CASES:
                got = _result_key(case, _submit(engine, case).result())
                assert answers.setdefault(case["id"], got) == got, case["id"]
        if cache:
            assert engine.stats().vision_encodes_skipped > 0


def test_fp8_kv_refusals(tmp_path: Path) -> None:
    from kestrel import Engine

    with pytest.raises(ModelLoadError, match=r"kv_dtype='fp8' needs FP8 KV scales"):
        Engine(str(FP8), device="cpu", kv_dtype="fp8")
    with pytest.raises(InvalidInputError, match="kv_dtype must be 'fp8'"):
        Engine(str(FP8), device="cpu", kv_dtype="int8")
