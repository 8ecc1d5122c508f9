"""Images as people have them (docs/images.md): EXIF orientation 1-8, 16-bit, float, alpha and
animations, on generated files and arrays. The oracles are Pillow's own ``ImageOps.exif_transpose``
and ``Image.alpha_composite`` and hand-computed values."""

from __future__ import annotations

import io

import numpy as np
import pytest
import pyvips
from PIL import Image, ImageOps

from kestrel.errors import InvalidInputError
from kestrel.images import ImageError, image_digest, load_image, prepare_image
from tests.generated_images import STORED, UPRIGHT, animation, encode, stored_png

RNG = np.random.default_rng(24)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_orientation_is_shown_upright(orientation: int) -> None:
    data = stored_png(orientation)
    with Image.open(io.BytesIO(data)) as im:
        assert np.array_equal(np.asarray(ImageOps.exif_transpose(im)), UPRIGHT)  # the oracle
        assert np.array_equal(load_image(im), UPRIGHT)  # a PIL image carrying EXIF
    assert np.array_equal(load_image(data), UPRIGHT)
    assert np.array_equal(load_image(pyvips.Image.new_from_buffer(data, "")), UPRIGHT)
    kept = load_image(data, exif_orientation=False)
    assert np.array_equal(kept, STORED[orientation])
    # The hash is taken after the orientation: same picture, same cache entry.
    assert prepare_image(data).digest == prepare_image(UPRIGHT).digest
    if orientation != 1:
        assert prepare_image(data, exif_orientation=False).digest != prepare_image(data).digest


def test_phone_jpeg_orientation_6(tmp_path) -> None:
    """A portrait photo as phones store it: landscape pixels, orientation 6."""
    portrait = np.zeros((64, 32, 3), np.uint8)  # 32 wide, 64 tall as seen
    portrait[:16] = (255, 0, 0)  # red band at the top of the picture
    stored = np.ascontiguousarray(np.rot90(portrait, 1))
    path = tmp_path / "phone.jpg"
    path.write_bytes(encode(Image.fromarray(stored), "JPEG", 6, quality=95))
    with Image.open(path) as im:
        expected = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
    for value in (path, str(path), path.read_bytes()):
        out = load_image(value)
        assert out.shape == (64, 32, 3) and np.array_equal(out, expected)
    assert out[:12, :, 0].min() > 200 and out[20:, :, 0].max() < 60  # red stays on top
    assert load_image(path, exif_orientation=False).shape == (32, 64, 3)


def test_broken_exif_counts_as_upright() -> None:
    data = encode(Image.fromarray(UPRIGHT), "PNG", exif=b"Exif\x00\x00garbage")
    assert np.array_equal(load_image(data), UPRIGHT)
    assert np.array_equal(load_image(encode(Image.fromarray(UPRIGHT), "PNG", 9)), UPRIGHT)


def test_16_bit_is_scaled_not_clipped() -> None:
    levels = np.array([[0, 257, 32768, 65535]], dtype=np.uint16)  # 257 * k -> k exactly
    expected = np.repeat(np.array([[0, 1, 128, 255]], np.uint8)[:, :, None], 3, axis=2)
    as_png = encode(Image.fromarray(levels))  # a 16-bit grayscale PNG
    with Image.open(io.BytesIO(as_png)) as im:
        assert im.mode.startswith("I")  # I;16 or I, as this Pillow holds it
        assert np.array_equal(load_image(im), expected)
    assert np.array_equal(load_image(as_png), expected)
    assert np.array_equal(load_image(Image.fromarray(levels.astype(np.int32), "I")), expected)
    assert np.array_equal(load_image(levels), expected)
    assert np.array_equal(load_image(levels.astype(">u2")), expected)  # big-endian uint16
    rgb16 = np.stack([levels, levels[:, ::-1], levels], axis=2)
    assert np.array_equal(load_image(rgb16)[..., 1], np.array([[255, 128, 1, 0]], np.uint8))
    vips16 = pyvips.Image.new_from_array(levels).cast("ushort")
    assert np.array_equal(load_image(vips16), expected)
    ramp = np.arange(0, 65536, 1, dtype=np.uint16).reshape(256, 256)
    out = load_image(ramp)[..., 0].astype(int)
    assert np.abs(out - np.rint(ramp / 257.0)).max() == 0  # rounded, over the whole range
    with pytest.raises(ImageError, match=r"outside 0\.\.65535"):
        load_image(Image.fromarray(np.array([[70000]], np.int32), "I"))


def test_float_is_read_as_0_to_1() -> None:
    values = np.array([[0.0, 0.5, 1.0, 1 / 255]], dtype=np.float32)
    expected = np.array([[0, 128, 255, 1]], np.uint8)
    assert np.array_equal(load_image(values)[..., 0], expected)
    assert np.array_equal(load_image(values.astype(np.float64))[..., 2], expected)
    assert np.array_equal(load_image(values.astype(np.float16))[..., 1], [[0, 128, 255, 1]])
    assert np.array_equal(load_image(Image.fromarray(values, "F"))[..., 0], expected)
    rgb = RNG.integers(0, 256, size=(5, 7, 3)).astype(np.float32) / 255
    assert np.array_equal(load_image(rgb), np.rint(rgb * 255).astype(np.uint8))


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (np.array([[0.2, np.nan]], np.float32), "NaN or infinite"),
        (np.array([[0.2, np.inf]], np.float64), "NaN or infinite"),
        (np.array([[0.0, 255.0]], np.float32), r"values in \[0, 255\].*divide by 255"),
        (np.array([[-0.5, 0.5]], np.float32), r"values in \[-0.5, 0.5\]"),
    ],
)
def test_bad_floats_are_invalid_input(value: np.ndarray, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        prepare_image(value)


def test_alpha_is_composited_on_white_or_a_chosen_colour() -> None:
    rgba = RNG.integers(0, 256, size=(8, 9, 4), dtype=np.uint8)
    rgba[0, :, 3] = 0  # a transparent row: its hidden colour must not show
    rgba[1, :, 3] = 255  # an opaque row: unchanged
    pil = Image.fromarray(rgba, "RGBA")
    for colour in ((255, 255, 255), (0, 0, 0), (12, 200, 77)):
        under = Image.new("RGBA", pil.size, (*colour, 255))
        expected = np.asarray(Image.alpha_composite(under, pil).convert("RGB"))
        for value in (rgba, pil, encode(pil), pyvips.Image.new_from_array(rgba)):
            assert np.array_equal(load_image(value, background=colour), expected)
        assert (expected[0] == colour).all() and np.array_equal(expected[1], rgba[1, :, :3])
    assert np.array_equal(load_image(rgba, background=None), rgba[..., :3])
    with pytest.raises(ValueError, match="background"):
        prepare_image(rgba, background=(300, 0, 0))
    with pytest.raises(ValueError, match="background"):
        load_image(rgba, background=(1, 2))


def test_transparent_palette_and_colour_key() -> None:
    rgb = RNG.integers(0, 256, size=(6, 6, 3), dtype=np.uint8)
    pal = Image.fromarray(rgb).quantize(colors=8)
    pal.info["transparency"] = 0  # palette index 0 is transparent
    index = np.asarray(pal)
    out = load_image(encode(pal))
    assert (out[index == 0] == 255).all()
    assert np.array_equal(out[index != 0], np.asarray(pal.convert("RGB"))[index != 0])
    gray = Image.fromarray(np.array([[10, 20], [10, 30]], np.uint8), "L")
    keyed = load_image(encode(gray, transparency=10))  # a tRNS colour key on a gray PNG
    assert keyed[..., 0].tolist() == [[255, 20], [255, 30]]


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_animations_use_their_first_frame(fmt: str) -> None:
    data = animation(fmt)
    with Image.open(io.BytesIO(data)) as im:
        assert im.is_animated and im.n_frames == 3
        im.seek(2)  # a caller's image left on its last frame
        first = load_image(im)
        assert im.tell() == 2  # and put back where the caller left it
    assert first.shape == (6, 8, 3)
    assert first[..., 0].min() > 200 and first[..., 1:].max() < 40
    assert np.array_equal(load_image(data), first)
    assert image_digest(load_image(data)) == prepare_image(data).digest


def test_cmyk_and_palette_as_before() -> None:
    cmyk = Image.fromarray(RNG.integers(0, 256, size=(5, 5, 4), dtype=np.uint8), "CMYK")
    assert np.array_equal(load_image(cmyk), np.asarray(cmyk.convert("RGB")))
    jpeg = encode(cmyk, "JPEG")
    with Image.open(io.BytesIO(jpeg)) as im:
        assert im.mode == "CMYK"
        assert np.array_equal(load_image(jpeg), np.asarray(im.convert("RGB")))
    pal = Image.fromarray(UPRIGHT).quantize(colors=4)
    assert np.array_equal(load_image(encode(pal)), np.asarray(pal.convert("RGB")))
