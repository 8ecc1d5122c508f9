"""libvips' resize copied as integer weights (``crops/resample.py``) run as tensor
arithmetic (``crops/device.py``): the bytes
of the installed pyvips for every kind of pass (grown, reduced, box-shrunk, mixed), the crops
of ``overlap_crops``, the kernels a GPU launches for them, and the start-up probe that decides
whether a device makes the crops."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import pyvips
import torch

from kestrel.crops import device as device_crops
from kestrel.crops import resample
from kestrel.crops.device import encoder_crops, make_crops, resize
from kestrel.crops.maker import crops_on_device
from kestrel.crops.overlap import overlap_crops
from kestrel.crops.resample import crop_plan, resize_plan
from kestrel.moondream.config import MoondreamConfig
from kestrel.moondream.vision import normalize_pixels
from kestrel_kernels.counting import LaunchCounter

VISION = MoondreamConfig().vision


def _vips(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    image = pyvips.Image.new_from_array(pixels)
    out = image.resize(width / image.width, vscale=height / image.height)
    return np.frombuffer(out.write_to_memory(), np.uint8).reshape(out.height, out.width, 3)


# (source height, width) -> (height, width): both grown (the local crops' copy of a chart),
# both shrunk (a global crop; a large photo's copy), one of each, one axis kept, tiny, a
# single row, and sizes that do not divide.
SIZES = [
    ((240, 320), (322, 588)),
    ((300, 400), (322, 588)),
    ((120, 100), (378, 378)),
    ((600, 800), (378, 378)),
    ((480, 640), (455, 455)),
    ((350, 250), (322, 189)),
    ((250, 350), (189, 322)),
    ((300, 400), (300, 588)),
    ((150, 150), (189, 150)),
    ((1, 5), (37, 37)),
    ((7, 3), (5, 2)),
    ((377, 379), (378, 378)),
    ((378, 378), (378, 378)),
]


@pytest.mark.parametrize(("source", "size"), SIZES, ids=lambda v: "x".join(map(str, v)))
def test_resize_is_libvips_byte_for_byte(source, size) -> None:
    rng = np.random.default_rng(sum(source) + sum(size))
    pixels = rng.integers(0, 256, (*source, 3), dtype=np.uint8)  # full range: clips, negatives
    plan = resize_plan(*source, *size)
    assert plan is not None
    made = resize(torch.from_numpy(pixels), plan)
    assert made.dtype == torch.uint8 and tuple(made.shape) == (*size, 3)
    expected = _vips(pixels, *size)
    assert np.array_equal(made.numpy(), expected), (
        f"{int((made.numpy() != expected).sum())} values differ from libvips"
    )


def test_a_smooth_image_is_libvips_byte_for_byte_too() -> None:
    y, x = np.mgrid[0:333, 0:517]
    pixels = np.stack([x * 255 // 516, y * 255 // 332, (x + y) % 256], -1).astype(np.uint8)
    for size in [(910, 1176), (378, 378), (200, 700)]:
        plan = resize_plan(333, 517, *size)
        assert np.array_equal(resize(torch.from_numpy(pixels), plan).numpy(), _vips(pixels, *size))


CHARTS = [(480, 640), (600, 800), (640, 900)]  # the GPU bench's charts: grown both ways
OTHERS = [(960, 1280), (300, 200), (1400, 300), (378, 378), (1000, 1500), (1600, 2000)]


@pytest.mark.parametrize("source", CHARTS + OTHERS)
def test_crops_are_overlap_crops(source) -> None:
    pixels = np.random.default_rng(source[0]).integers(0, 256, (*source, 3), dtype=np.uint8)
    plan = crop_plan(*source, VISION)
    made = make_crops(torch.from_numpy(pixels), plan)
    expected = overlap_crops(pixels, VISION)
    assert plan.tiling == expected.tiling
    assert made.is_contiguous() and np.array_equal(made.numpy(), expected.crops)


@pytest.mark.parametrize(("source", "size", "boxes"), [
    ((1600, 300), (378, 378), [2, 0, 0, 0]),  # rows box-shrunk by 2, then reduced; columns grown
    ((40, 1900), (378, 378), [2, 0, 0, 0]),  # columns box-shrunk by 2, rows grown
    ((2300, 1700), (378, 378), [3, 0, 2, 0]),  # both, rows by 3
    ((1500, 1500), (378, 378), [0, 0]),  # a 3.97x shrink: the reduce alone
])  # fmt: skip
def test_a_large_shrink_box_averages_first_as_libvips(source, size, boxes) -> None:
    """Past twice the reduce gap libvips averages boxes of pixels before its reduce; the box
    pass rounds as libvips' uchar path does (32-bit fixed point), so the bytes stay exact."""
    pixels = np.random.default_rng(source[1]).integers(0, 256, (*source, 3), dtype=np.uint8)
    plan = resize_plan(*source, *size)
    assert [p.box for p in plan.passes] == boxes
    assert np.array_equal(resize(torch.from_numpy(pixels), plan).numpy(), _vips(pixels, *size))


def test_a_size_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot resize"):
        resize_plan(0, 10, 5, 5)


def test_a_charts_encoder_input_is_a_bounded_number_of_launches() -> None:
    """What a GPU launches per new image (``LaunchCounter``: views and allocations launch
    nothing): the image made planar once, per pass a matrix product with libvips' rounding as
    its bias, a floor and a clip (not after the bicubic's first pass), the crops copied out
    channel-major and normalized (3). An image size never seen before first builds its
    passes' matrices on the device: one upload of their positions and one of their weights,
    then a fill and a scatter each."""
    pixels = torch.zeros((611, 803, 3), dtype=torch.uint8)  # a size no other test uses
    plan = crop_plan(611, 803, VISION)
    passes = [p for r in (plan.whole, plan.local) for p in r.passes]
    assert len(passes) == 4  # lanczos3 down and across (global), bicubic across and down
    steady = 1 + 3 * len(passes) - 1 + 2 + 3
    with LaunchCounter() as first:
        got = encoder_crops(pixels, plan, torch.bfloat16)
    with LaunchCounter() as again:
        encoder_crops(pixels, plan, torch.bfloat16)
    assert torch.equal(got, normalize_pixels(make_crops(pixels, plan), torch.bfloat16))
    print(f"launches for an 800 x 600 image's encoder input ({plan.geometry.n_crops} crops): "
          f"{first.launches} for a new size, {again.launches} again")  # fmt: skip
    assert again.launches <= steady
    assert first.launches <= steady + 2 + 2 * len(passes)


def test_allowed_tf32_or_bf16_products_make_it_float64_and_still_exact() -> None:
    pixels = np.random.default_rng(9).integers(0, 256, (300, 400, 3), dtype=np.uint8)
    before = torch.get_float32_matmul_precision()
    try:
        for precision in ("high", "medium"):
            torch.set_float32_matmul_precision(precision)
            assert device_crops._exact() is torch.float64
            made = resize(torch.from_numpy(pixels), resize_plan(300, 400, 322, 588))
            assert np.array_equal(made.numpy(), _vips(pixels, 322, 588))
    finally:
        torch.set_float32_matmul_precision(before)
    assert device_crops._exact() is torch.float32


def test_the_probe_trusts_equal_bytes_and_refuses_others(monkeypatch, caplog) -> None:
    assert device_crops.device_disagrees(VISION, "cpu") is None
    assert crops_on_device(VISION, torch.device("cpu"), pins=False, wanted=True)
    assert not crops_on_device(VISION, torch.device("cpu"), pins=False, wanted=None)
    real = device_crops.make_crops

    def off_by_one(pixels, plan):
        out = real(pixels, plan)
        out[0, 0, 0, 0] ^= 1
        return out

    monkeypatch.setattr(device_crops, "make_crops", off_by_one)
    why = device_crops.device_disagrees(VISION, "cpu")
    assert why is not None and "1 of" in why
    with caplog.at_level(logging.WARNING, logger="kestrel.runtime"):
        assert not crops_on_device(VISION, torch.device("cpu"), pins=True, wanted=None)
    assert "crops are made on the host" in caplog.text


class _BuildError(Exception):  # as Triton's CompilationError: not a RuntimeError
    pass


@pytest.mark.parametrize("error", [RuntimeError, _BuildError])
def test_a_device_that_cannot_make_the_crops_is_refused(monkeypatch, error) -> None:
    def unsupported(*args, **kwargs):
        raise error("addmm: float64 is not supported here")

    monkeypatch.setattr(device_crops, "make_crops", unsupported)
    why = device_crops.device_disagrees(VISION, "cpu")
    assert why is not None and "cannot make" in why and "float64" in why
    assert not crops_on_device(VISION, torch.device("cpu"), pins=True, wanted=None)


def test_the_vectorized_masks_are_the_scalar_ones() -> None:
    """``_masks`` (numpy's sine) equals ``_mask`` (libm's, as libvips calls it) for every
    offset of 300 shrinks, and for the shrinks of common sizes."""
    rng = np.random.default_rng(0)
    shrinks = [*rng.uniform(1.0001, 4.0, 300), 1.5, 2.0, 3.0, 600 / 378, 1512 / 378 / 2]
    for shrink in shrinks:
        taps = int(2 * np.rint(3 * shrink) + 1)
        scalar = [resample._mask(taps, shrink, t / 64) for t in range(65)]
        assert np.array_equal(resample._masks(taps, shrink), np.array(scalar)), shrink
