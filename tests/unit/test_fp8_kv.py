"""FP8 KV pages, the kernel contract's scaled-KV case, through the torch backend on CPU: writes
quantise by the layer's scales (negative slots write nothing), attention over scaled pages
equals the reference over the widened pages and stays within e4m3 error of 16-bit pages, the
case's validation, the page store's bytes, and Moondream 3's ``kv_quantizer`` scales read from
a checkpoint (all layers or none; a bad value named)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kestrel.kv.storage import PagedKVCache
from kestrel.moondream.weights import CheckpointError, load_config, load_kv_scales, load_state_dict
from kestrel_kernels.contract import (
    KV_FP8_DTYPE,
    KernelInputError,
    KvScales,
    dequantize_kv,
    quantize_kv,
    validate_attention_inputs,
    validate_scaled_kv,
)
from kestrel_kernels.plan import AttentionMeta
from kestrel_kernels.torch_backend import (
    paged_attention_scaled_torch,
    paged_attention_torch,
    write_kv_indexed,
    write_kv_scaled,
)
from tests.conftest import FIXTURES
from tests.tolerance import assert_close

H, D, PAGES = 2, 16, 40
SCALES = KvScales(torch.tensor([0.02]), torch.tensor([0.015]))


def _setup(seed: int = 0):
    """Two rows (12 and 7 keys) with a bidirectional block, decode-style queries."""
    gen = torch.Generator().manual_seed(seed)
    k_new = torch.randn(19, H, D, generator=gen) * 2
    v_new = torch.randn(19, H, D, generator=gen) * 2
    slots = torch.randperm(PAGES - 1, generator=gen)[:19] + 1
    page_table = torch.zeros(2, 16, dtype=torch.int32)
    page_table[0, :12], page_table[1, :7] = slots[:12], slots[12:]
    q = torch.randn(2, 3, H, D, generator=gen)
    return q, k_new, v_new, slots, page_table


def _attend(q, k, v, page_table, scales=None):
    seqused_k = torch.tensor([12, 7], dtype=torch.int32)
    bidir = torch.tensor([[0, 5], [0, 0]], dtype=torch.int32)
    like = torch.empty(k.shape, dtype=q.dtype)
    meta = AttentionMeta(page_table, seqused_k, bidir_regions=bidir)
    shape = validate_attention_inputs(q, like, like, meta)
    if scales is None:
        return paged_attention_torch(q, k, v, meta, shape, D**-0.5)
    validate_scaled_kv(q.dtype, k, v, scales)
    return paged_attention_scaled_torch(q, k, v, meta, shape, scales, D**-0.5)


def test_round_trip_within_e4m3_error() -> None:
    x = torch.randn(50, H, D, generator=torch.Generator().manual_seed(1))
    stored = quantize_kv(x, SCALES.k)
    assert stored.dtype == KV_FP8_DTYPE
    back = dequantize_kv(stored, SCALES.k, torch.float32)
    small = x.abs() < 0.02 * 2.0**-6  # e4m3 subnormals (below 2^-6): a fixed step of 2^-9
    err = (back - x).abs()
    assert bool((err[~small] <= x.abs()[~small] * 2.0**-4).all())
    assert bool((err[small] <= 0.02 * 2.0**-10).all()) and float(err.max()) > 0


def test_scaled_attention_equals_reference_on_widened_pages() -> None:
    q, k_new, v_new, slots, page_table = _setup()
    k8 = torch.zeros(PAGES, H, D, dtype=KV_FP8_DTYPE)
    v8 = torch.zeros(PAGES, H, D, dtype=KV_FP8_DTYPE)
    write_kv_scaled(k8, v8, slots, k_new, v_new, SCALES)
    got = _attend(q, k8, v8, page_table, SCALES)
    widened = (dequantize_kv(k8, SCALES.k, q.dtype), dequantize_kv(v8, SCALES.v, q.dtype))
    assert_close(got, _attend(q, *widened, page_table), rel=1e-06)
    # and within e4m3's error of 16-bit (here float32) pages holding the exact values
    k32, v32 = torch.zeros(PAGES, H, D), torch.zeros(PAGES, H, D)
    write_kv_indexed(k32, v32, slots, k_new, v_new)
    exact = _attend(q, k32, v32, page_table)
    rel = float((got - exact).norm() / exact.norm())
    assert 0 < rel < 0.05


def test_negative_slots_write_nothing() -> None:
    k8 = quantize_kv(torch.ones(6, H, D), torch.tensor([1.0]))
    v8 = k8.clone()
    before = k8.view(torch.uint8).clone()
    new, unit = torch.full((2, H, D), 5.0), KvScales(torch.tensor([1.0]), torch.tensor([1.0]))
    write_kv_scaled(k8, v8, torch.tensor([-1, 3]), new, new, unit)
    changed = (k8.view(torch.uint8) != before).any(-1).any(-1)
    assert changed.tolist() == [False, False, False, True, False, False]
    assert float(k8[3].float().max()) == 5.0


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"cache": torch.bfloat16}, "must be float8_e4m3fn"),
        ({"k": torch.tensor([0.0])}, "finite and > 0"),
        ({"v": torch.tensor([float("nan")])}, "finite and > 0"),
        ({"k": torch.tensor([1.0, 2.0])}, "one-element"),
        ({"v": torch.tensor([1.0], dtype=torch.float64)}, "must be float32"),
        ({"q": torch.int8}, "must be float32/float16/bfloat16"),
    ],
)
def test_scaled_kv_validation(change: dict, match: str) -> None:
    cache = torch.zeros(4, H, D, dtype=change.get("cache", KV_FP8_DTYPE))
    scales = KvScales(change.get("k", torch.tensor([1.0])), change.get("v", torch.tensor([1.0])))
    with pytest.raises(KernelInputError, match=match):
        validate_scaled_kv(change.get("q", torch.float32), cache, cache, scales)


def test_page_store_fp8_bytes_and_scales() -> None:
    scales = [SCALES] * 3
    fp8 = PagedKVCache(10, 3, H, D, dtype=KV_FP8_DTYPE, kv_scales=scales)
    bf16 = PagedKVCache(10, 3, H, D, dtype=torch.bfloat16)
    assert fp8.bytes * 2 == bf16.bytes and float(fp8.k[0].float().abs().sum()) == 0
    assert fp8.kv_scales is not None and len(fp8.kv_scales) == 3
    with pytest.raises(ValueError, match="need kv_scales"):
        PagedKVCache(10, 3, H, D, dtype=KV_FP8_DTYPE)
    with pytest.raises(ValueError, match="scales go with FP8 pages only"):
        PagedKVCache(10, 3, H, D, dtype=torch.bfloat16, kv_scales=scales)
    with pytest.raises(ValueError, match="2 entries for 3 layers"):
        PagedKVCache(10, 3, H, D, dtype=KV_FP8_DTYPE, kv_scales=scales[:2])


MD3_FP8 = FIXTURES / "md3-tiny-a-fp8"


def _with_kv_scales(tmp_path: Path, layers: range, value: float = 0.05) -> Path:
    from safetensors.torch import load_file

    sd = load_file(str(MD3_FP8 / "model.safetensors"))
    tmp_path.mkdir(parents=True)
    for i in layers:
        for w in ("k", "v"):
            sd[f"text_model.transformer.h.{i}.kv_quantizer.{w}_scale"] = torch.tensor(value)
    save_file(sd, str(tmp_path / "model.safetensors"))
    shutil.copy(MD3_FP8 / "config.json", tmp_path / "config.json")
    return tmp_path


def test_kv_scales_from_the_checkpoint(tmp_path: Path) -> None:
    config = load_config(MD3_FP8)
    assert load_kv_scales(MD3_FP8, config) is None
    path = _with_kv_scales(tmp_path / "all", range(3), 0.05)
    scales = load_kv_scales(path, config)
    assert scales is not None and len(scales) == 3
    assert all(float(s.k) == pytest.approx(0.05) and s.v.dtype == torch.float32 for s in scales)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # known tensors: no "Kestrel does not use" warning
        load_state_dict(path, config)
    assert load_kv_scales(_with_kv_scales(tmp_path / "some", range(2)), config) is None
    bad = _with_kv_scales(tmp_path / "bad", range(3), -1.0)
    with pytest.raises(CheckpointError, match=r"h\.0\.kv_quantizer\.k_scale"):
        load_kv_scales(bad, config)
