"""Large images are decoded only as far as their crops use them (kestrel/images/shrink.py):
the encoder's input from a reduced decode stays within a few levels of the full decode's, the
crops keep the grid of the picture as sent, and the same bytes always give the same pixels."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from kestrel.crops.overlap import crop_geometry, overlap_crops
from kestrel.engine.intake import CropFit
from kestrel.images import load_image, prepare_image
from kestrel.images.known import KnownImages
from kestrel.images.shrink import JPEG_FACTORS, shrink_factor
from kestrel.moondream.config import VisionConfig

VISION = VisionConfig()  # Moondream's own crop geometry: 378-pixel crops, up to 12 of them
FIT = CropFit(VISION)


def photo(height: int, width: int, seed: int = 0) -> np.ndarray:
    """Smooth, photo-like colour fields with fine grain (a flat image would hide every
    difference between the two decodes)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (height // 40 + 1, width // 40 + 1, 3), np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC))
    grain = np.tile(
        rng.integers(-10, 11, (61, 67, 1), np.int16), (height // 61 + 1, width // 67 + 1, 1)
    )
    return np.clip(smooth + grain[:height, :width], 0, 255).astype(np.uint8)


def encoded(pixels: np.ndarray, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt, **options)
    return out.getvalue()


@pytest.mark.parametrize(
    ("size", "fmt", "options", "reduced"),
    [
        ((3000, 4000), "JPEG", {"quality": 90}, (1500, 2000)),  # a 12 MP phone photo: 1/2
        ((7000, 7000), "PNG", {"compress_level": 0}, (1000, 1000)),  # 49 MP: shrunk by 7
    ],
    ids=["12MP-jpeg", "49MP-png"],
)
def test_the_encoder_input_stays_close_to_the_full_decode(size, fmt, options, reduced) -> None:
    data = encoded(photo(*size), fmt, **options)
    full = load_image(data)
    image = prepare_image(data, fit=FIT)
    assert full.shape[:2] == size and image.pixels.shape[:2] == reduced
    assert image.sent_size == size and image.plan_size == size
    want = overlap_crops(full, VISION)
    got = overlap_crops(image.pixels, VISION, plan_size=image.plan_size)
    assert got.tiling == want.tiling == (crop_geometry(*size, VISION).rows,
                                         crop_geometry(*size, VISION).cols)  # fmt: skip
    diff = np.abs(got.crops.astype(np.int16) - want.crops.astype(np.int16))
    worst, mean, tail = diff.max(), diff.mean(), np.percentile(diff, 99.9)
    print(f"{fmt} {size[1]}x{size[0]} -> {reduced[1]}x{reduced[0]}: encoder input worst "
          f"{worst} levels, mean {mean:.3f}, 99.9th percentile {tail}")  # fmt: skip
    assert diff.max() <= 8 and diff.mean() <= 1.5
    # planned on its own (reduced) size, the grid would change: the sent size matters
    assert overlap_crops(image.pixels, VISION).tiling != want.tiling or fmt == "PNG"


def test_a_reduced_side_never_falls_below_what_the_crops_sample() -> None:
    for height, width in [(3000, 4000), (4000, 3000), (7000, 7000), (300, 5000), (1200, 1300),
                          (12000, 900), (2000, 8000)]:  # fmt: skip
        target = FIT(height, width)
        for factors in (JPEG_FACTORS, range(2, 64)):
            f = shrink_factor(height, width, FIT, factors)
            if f > 1:
                assert height // f >= target[0] and width // f >= target[1], (height, width, f)
            if f < max(factors):  # the next factor up would undercut a side (or is not offered)
                nxt = min(g for g in factors if g > f)
                assert height // nxt < target[0] or width // nxt < target[1] or f == 1
    assert shrink_factor(300, 5000, FIT, range(2, 64)) == 1  # the short side is upscaled


def test_images_the_crops_need_whole_decode_exactly_as_before() -> None:
    pixels = photo(900, 1400)
    for fmt in ("PNG", "JPEG", "WEBP"):
        data = encoded(pixels, fmt)
        image = prepare_image(data, fit=FIT)
        assert image.sent_size is None
        assert np.array_equal(image.pixels, load_image(data)), fmt


def test_the_same_bytes_give_the_same_pixels_and_identity() -> None:
    data = encoded(photo(3000, 4000, seed=1), "JPEG", quality=85)
    first, again = prepare_image(data, fit=FIT), prepare_image(data, fit=FIT)
    assert first.digest == again.digest and np.array_equal(first.pixels, again.pixels)
    assert first.digest != prepare_image(data).digest  # another decode is another picture
    known = KnownImages(fit=FIT)
    prepared = known.prepare(data)
    deferred = known.prepare(data)  # sent again: no decode, the same identity and grid
    assert type(deferred).__name__ == "DeferredImage"
    assert deferred.digest == prepared.digest and deferred.plan_size == (3000, 4000)
    assert np.array_equal(deferred.pixels, prepared.pixels)


def test_an_orientation_tag_plans_the_upright_picture() -> None:
    stored = photo(3000, 4000, seed=2)
    image = Image.fromarray(stored)
    exif = image.getexif()
    exif[0x0112] = 6  # stored sideways: shown turned 90 degrees clockwise
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90, exif=exif.tobytes())
    prepared = prepare_image(out.getvalue(), fit=FIT)
    assert prepared.sent_size == (4000, 3000)  # upright: taller than wide
    assert prepared.pixels.shape[:2] == (2000, 1500)


@pytest.mark.parametrize("fmt", ["WEBP", "PNG"])
def test_webp_and_png_with_alpha_shrink_and_composite(fmt) -> None:
    pixels = photo(2000, 2000, seed=3)
    alpha = np.full((2000, 2000, 1), 255, np.uint8)
    alpha[:1000] = 0  # the top half transparent: white once composited
    data = encoded(np.concatenate([pixels, alpha], axis=2), fmt, lossless=True)
    image = prepare_image(data, fit=FIT)
    assert image.sent_size == (2000, 2000) and image.pixels.shape[:2] == (1000, 1000)
    top = image.pixels[: image.pixels.shape[0] // 2 - 2]
    assert top.min() == 255  # composited on white, as the full decode is
