"""``scripts/bench_moe.py``'s FP8 tables on a tiny checkpoint: the resident-bytes accounting
(FP8 expert stacks with their scales at most 0.55x the 16-bit ones, float32 twice the 16-bit)
and one FP8 decode measurement reading top-k experts per layer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kestrel.moondream.model import MoondreamModel
from kestrel.moondream.tokenizer import MoondreamTokenizer
from kestrel.runtime.runtime import MoondreamRuntime
from kestrel.testing.fp8_checkpoint import write_fp8_checkpoint
from tests.integration.test_bench_moe import TINY, bench  # noqa: F401


@pytest.fixture(scope="module")
def fp8_path(bench, tmp_path_factory) -> Path:  # noqa: F811
    md3, _ = bench.configs(TINY)
    tmp = tmp_path_factory.mktemp("fp8-bench")
    src = bench.write_model(tmp / "moe", md3, torch.float32)
    return write_fp8_checkpoint(src, tmp / "moe-fp8").parent


def test_resident_bytes(bench, fp8_path: Path) -> None:  # noqa: F811
    def size(mode: str, dtype: torch.dtype) -> dict[str, float]:
        return bench.resident_bytes(
            MoondreamModel.from_pretrained(fp8_path, dtype=dtype, moe_weights=mode)
        )

    fp8, bf16, fp32 = (
        size("fp8", torch.bfloat16),
        size("dequantize", torch.bfloat16),
        size("dequantize", torch.float32),
    )
    layers, e = TINY.layers - TINY.moe_start, TINY.experts
    stacks = layers * e * 3 * TINY.dim * TINY.expert_inner  # up (2 inner) + down, per expert
    scales = layers * e * (2 * TINY.expert_inner + TINY.dim)
    assert bf16["experts"] == pytest.approx(2 * stacks / 1e6)
    assert fp8["experts"] == pytest.approx((stacks + 4 * scales) / 1e6)
    assert fp8["experts"] <= 0.55 * bf16["experts"]
    assert fp32["total"] == pytest.approx(2 * bf16["total"])
    assert fp8["total"] - fp8["experts"] == pytest.approx(bf16["total"] - bf16["experts"])


def test_fp8_decode_measurement(bench, fp8_path: Path) -> None:  # noqa: F811
    model = MoondreamModel.from_pretrained(fp8_path, moe_weights="fp8")
    assert model.text.blocks[TINY.moe_start].moe.fp8
    rt = MoondreamRuntime(
        model, MoondreamTokenizer.for_checkpoint(fp8_path), max_batch_size=2, kv_cache_pages=2000
    )
    log = bench.ExpertLog()
    try:
        images = [np.full((378, 378, 3), 40 * i, dtype=np.uint8) for i in range(2)]
        one = bench.decode_variant(rt, log, images, 1, TINY)
    finally:
        log.restore()
    assert one["experts"] == TINY.top_k and one["floor"] == pytest.approx(1.0) and one["tps"] > 0
