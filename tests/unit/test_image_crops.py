from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import pyvips
import torch
from PIL import Image
from safetensors import safe_open

from kestrel.crops.overlap import CropError, OverlapCrops, overlap_crops, select_tiling
from kestrel.images import load_image
from kestrel.moondream.config import VisionConfig
from kestrel.moondream.vision import VisionInputError, normalize_pixels
from kestrel.moondream.weights import load_config


def fixture_dir() -> Path:
    default = Path(__file__).resolve().parents[1] / "fixtures" / "md2-tiny-a"
    return Path(os.environ.get("KESTREL_FIXTURE_DIR", default))


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads((fixture_dir() / "golden.json").read_text())


@pytest.fixture(scope="module")
def vision() -> VisionConfig:
    return load_config(fixture_dir()).vision


def test_select_tiling_all_fixture_cases(golden: dict) -> None:
    cases = golden["tiling_cases"]
    assert len(cases) >= 20
    for case in cases:
        assert select_tiling(*case["select_tiling_args"]) == tuple(case["tiling"]), case


def test_select_tiling_doc_examples() -> None:
    # architecture doc 2.1, called with (H - 112, W - 112, 266, 12)
    for (h, w), tiling in {
        (378, 378): (1, 1),
        (500, 500): (3, 3),
        (1024, 1024): (3, 3),
        (720, 1280): (2, 4),
        (2000, 500): (6, 1),
        (4000, 3000): (4, 2),
        (379, 1000): (2, 6),
    }.items():
        assert select_tiling(h - 112, w - 112, 266, 12) == tiling
    with pytest.raises(ValueError, match="max_crops"):
        select_tiling(500, 500, 266, 0)


def test_overlap_crops_geometry(golden: dict, vision: VisionConfig) -> None:
    rng = np.random.default_rng(0)
    checked = 0
    for case in golden["tiling_cases"]:
        h, w = case["height"], case["width"]
        if h * w > 3_000_000:  # keep the test fast; select_tiling covers the big ones
            continue
        image = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        out = overlap_crops(image, vision, max_crops=case["max_crops"])
        assert out.tiling == tuple(case["tiling"])
        assert out.n_crops == case["n_crops"]
        assert out.crops.shape == (case["n_crops"], vision.crop_size, vision.crop_size, 3)
        assert out.crops.dtype == np.uint8
        checked += 1
    assert checked >= 15


def _fixture_images(golden: dict) -> list[dict]:
    assert len(golden["images"]) == 4
    return golden["images"]


def test_crops_byte_equal_to_reference(golden: dict, vision: VisionConfig) -> None:
    for entry in _fixture_images(golden):
        # The reference's decoding: PIL's convert("RGB") drops alpha (the RGBA fixture).
        image = load_image(fixture_dir() / entry["file"], background=None)
        assert image.shape == (entry["height"], entry["width"], 3)
        out = overlap_crops(image, vision)
        assert out.tiling == tuple(entry["tiling"]), entry["name"]
        assert out.n_crops == entry["n_crops"] == len(entry["crops"])
        for k, crop_file in enumerate(entry["crops"]):
            expected = np.asarray(Image.open(fixture_dir() / crop_file).convert("RGB"))
            assert np.array_equal(out.crops[k], expected), f"{entry['name']} crop {k}"
        sums = [int(c.astype(np.int64).sum()) for c in out.crops]
        assert sums == entry["crop_u8_sums"]


def test_pyvips_input_gives_same_crops(golden: dict, vision: VisionConfig) -> None:
    entry = next(e for e in golden["images"] if e["name"].startswith("scene"))
    array = load_image(fixture_dir() / entry["file"])
    from_vips = overlap_crops(pyvips.Image.new_from_array(array), vision)
    from_numpy = overlap_crops(array, vision)
    assert from_vips.tiling == from_numpy.tiling
    assert np.array_equal(from_vips.crops, from_numpy.crops)


def test_crops_are_read_only(vision: VisionConfig) -> None:
    out = overlap_crops(np.zeros((400, 500, 3), np.uint8), vision)
    assert isinstance(out, OverlapCrops)
    with pytest.raises(ValueError):
        out.crops[0, 0, 0, 0] = 1


def test_overlap_crops_validates_input(vision: VisionConfig) -> None:
    for bad in (
        np.zeros((10, 10, 3), np.float32),
        np.zeros((10, 10), np.uint8),
        np.zeros((10, 10, 4), np.uint8),
        np.zeros((0, 10, 3), np.uint8),
    ):
        with pytest.raises(CropError, match="load_image"):
            overlap_crops(bad, vision)
    with pytest.raises(CropError, match="3-band"):
        overlap_crops(pyvips.Image.black(8, 8, bands=1), vision)


def test_other_crop_geometry(vision: VisionConfig) -> None:
    # A different config geometry (patch 16, crop 256, margin 2) is derived, not hard-coded.
    small = replace(vision, enc_patch_size=16, crop_size=256, overlap_margin=2)
    window = (256 // 16 - 4) * 16
    out = overlap_crops(np.full((600, 900, 3), 7, np.uint8), small)
    rows, cols = select_tiling(600 - 64, 900 - 64, window, small.max_crops)
    assert out.tiling == (rows, cols) and out.crops.shape == (1 + rows * cols, 256, 256, 3)
    assert (out.crops == 7).all()


def test_pixel_lut_exact() -> None:
    with safe_open(str(fixture_dir() / "golden.safetensors"), "pt") as f:
        lut = f.get_tensor("pixel_lut")
    assert lut.shape == (256,)
    levels = np.arange(256, dtype=np.uint8)
    crops = np.broadcast_to(levels.reshape(1, 16, 16, 1), (2, 16, 16, 3)).copy()
    crops[1] = 255 - crops[1]
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        x = normalize_pixels(crops, dtype, "cpu")
        assert x.shape == (2, 3, 16, 16) and x.dtype == dtype and x.is_contiguous()
        expected = lut[torch.from_numpy(crops.astype(np.int64))].permute(0, 3, 1, 2)
        assert torch.equal(x.float(), expected.to(dtype).float())
    # The bf16 arithmetic matters: plain float32 arithmetic differs from the reference.
    f32 = (torch.arange(256, dtype=torch.float32) / 255.0 - 0.5) / 0.5
    assert not torch.equal(f32, lut)


def test_normalize_channel_order_and_input_kinds(vision: VisionConfig) -> None:
    crops = np.zeros((1, 4, 4, 3), np.uint8)
    crops[..., 0] = 255  # red
    x = normalize_pixels(crops, torch.float32)
    assert torch.equal(x[0, 0], torch.ones(4, 4)) and torch.equal(x[0, 1], -torch.ones(4, 4))
    readonly = overlap_crops(np.zeros((50, 50, 3), np.uint8), vision).crops
    assert torch.equal(normalize_pixels(readonly, torch.float32), -torch.ones(2, 3, 378, 378))
    assert torch.equal(normalize_pixels(torch.from_numpy(crops), torch.float32), x)
    with pytest.raises(VisionInputError, match="uint8 crops"):  # the model's own input error
        normalize_pixels(crops.astype(np.float32), torch.float32)
