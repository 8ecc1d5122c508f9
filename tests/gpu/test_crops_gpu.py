"""The crop pool's uint8 crops (channels last) in pinned memory, what a CUDA runtime takes,
upload and normalize on the GPU to exactly what ``normalize_pixels`` gives there; skips
without CUDA (tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kestrel.crops import device as device_crops
from kestrel.crops.overlap import overlap_crops
from kestrel.crops.pool import CropPool
from kestrel.images import prepare_image
from kestrel.moondream.config import MoondreamConfig
from kestrel.moondream.vision import normalize_pixels

pytestmark = pytest.mark.gpu


def test_uint8_crops_normalize_on_the_device() -> None:
    vision = MoondreamConfig().vision
    pool = CropPool(vision, normalize=False, pin_memory=True)
    image = prepare_image(np.random.default_rng(0).integers(0, 256, (960, 1280, 3), np.uint8))
    crops = pool.pixels(image)
    assert crops.pixels.is_pinned() and crops.pixels.dtype == torch.uint8
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        got = crops.encoder_input(dtype, "cuda")
        want = normalize_pixels(overlap_crops(image.pixels, vision).crops, dtype, "cuda")
        assert got.device.type == "cuda" and got.is_contiguous() and torch.equal(got, want)
    pool.close()


@pytest.mark.parametrize("size", [(480, 640), (600, 800), (640, 900), (960, 1280), (700, 500)])
def test_crops_made_on_the_gpu_are_libvips_bytes(size) -> None:
    """``device_crops.encoder_crops`` on CUDA: the host's libvips crops, byte for byte, from the
    image staged in pinned memory (the default of a CUDA runtime)."""
    vision = MoondreamConfig().vision
    pool = CropPool(vision, normalize=False, pin_memory=True, on_device=True)
    image = prepare_image(np.random.default_rng(size[0]).integers(0, 256, (*size, 3), np.uint8))
    crops = pool.pixels(image)
    assert crops.plan is not None and crops.pixels.is_pinned()
    got = crops.encoder_input(torch.bfloat16, "cuda")
    want = normalize_pixels(overlap_crops(image.pixels, vision).crops, torch.bfloat16, "cuda")
    assert torch.equal(got, want)
    assert device_crops.device_disagrees(vision, "cuda") is None
    pool.close()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("size", [(1, 1), (378, 378), (300, 1000), (1513, 757), (1600, 2000)])
def test_both_device_paths_cut_libvips_bytes(backend, size) -> None:
    """The Triton resample kernel (CUDA's default where Triton imports) and the matrix
    products (without it) each give libvips' uint8 crops and normalized input on the GPU."""
    from kestrel_kernels import fused

    if backend == "triton" and not fused.triton_available():
        pytest.skip("no triton package")
    vision = MoondreamConfig().vision
    pixels = np.random.default_rng(size[1]).integers(0, 256, (*size, 3), np.uint8)
    plan = device_crops.crop_plan(*size, vision)
    want = overlap_crops(pixels, vision).crops
    before = fused.get_fused_backend()
    fused.set_fused_backend(backend)
    try:
        image = torch.from_numpy(pixels).cuda()
        made = device_crops.make_crops(image, plan).cpu().numpy()
        got = device_crops.encoder_crops(image, plan, torch.bfloat16)
    finally:
        fused.set_fused_backend(before)
    assert np.array_equal(made, want), int((made != want).sum())
    assert torch.equal(got, normalize_pixels(want, torch.bfloat16, "cuda"))
