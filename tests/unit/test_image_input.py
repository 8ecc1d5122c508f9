from __future__ import annotations

import hashlib
import io
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import pyvips
from PIL import Image

from kestrel.images import (
    DEFAULT_MAX_PIXELS,
    ImageError,
    image_digest,
    image_hash_int,
    load_image,
)


def fixture_dir() -> Path:
    default = Path(__file__).resolve().parents[1] / "fixtures" / "md2-tiny-a"
    return Path(os.environ.get("KESTREL_FIXTURE_DIR", default))


SCENE = fixture_dir() / "images" / "scene_800x600.png"
RGBA = fixture_dir() / "images" / "rgba_500x500.png"


def pil_rgb(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def on_white(image: Image.Image) -> np.ndarray:
    """PIL's own compositing over opaque white: the oracle for the default alpha handling."""
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _chunk(kind: bytes, payload: bytes) -> bytes:
    body = kind + payload
    return struct.pack(">I", len(payload)) + body + struct.pack(">I", zlib.crc32(body))


def png_header_only(width: int, height: int) -> bytes:
    """A valid PNG header claiming width x height whose pixel data is empty."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"IDAT", zlib.compress(b""))
        + _chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("path", [SCENE, RGBA], ids=["rgb", "rgba"])
def test_all_input_kinds_agree(path: Path) -> None:
    data = path.read_bytes()
    with Image.open(path) as im:
        expected = on_white(im)  # the RGB scene: unchanged; the RGBA one: over white
        as_pil = load_image(im)
        raw = np.asarray(im)  # RGBA stays 4-channel here
    inputs = {
        "str": str(path),
        "path": path,
        "bytes": data,
        "bytearray": bytearray(data),
        "memoryview": memoryview(data),
        "numpy": raw,
        "vips_file": pyvips.Image.new_from_file(str(path)),
        "vips_buffer": pyvips.Image.new_from_buffer(data, ""),
    }
    assert np.array_equal(as_pil, expected)
    for kind, value in inputs.items():
        out = load_image(value)
        assert out.dtype == np.uint8 and out.flags.c_contiguous, kind
        assert np.array_equal(out, expected), kind


def test_gray_and_palette_follow_pil_convert() -> None:
    rng = np.random.default_rng(1)
    gray = rng.integers(0, 256, size=(31, 47), dtype=np.uint8)
    alpha = rng.integers(0, 256, size=(31, 47), dtype=np.uint8)
    pil_l = Image.fromarray(gray, "L")
    expected = np.asarray(pil_l.convert("RGB"))
    assert np.array_equal(load_image(pil_l), expected)
    assert np.array_equal(load_image(gray), expected)
    assert np.array_equal(load_image(gray[:, :, None]), expected)
    assert np.array_equal(load_image(pyvips.Image.new_from_array(gray)), expected)
    assert np.array_equal(load_image(png_bytes(pil_l)), expected)
    pil_la = Image.fromarray(np.stack([gray, alpha], axis=2), "LA")
    assert np.array_equal(load_image(pil_la), on_white(pil_la))
    assert np.array_equal(load_image(np.stack([gray, alpha], axis=2)), on_white(pil_la))
    assert np.array_equal(load_image(pil_la, background=None), expected)

    rgb = rng.integers(0, 256, size=(20, 30, 3), dtype=np.uint8)
    pil_p = Image.fromarray(rgb).quantize(colors=16)
    assert pil_p.mode == "P"
    assert np.array_equal(load_image(pil_p), np.asarray(pil_p.convert("RGB")))
    assert np.array_equal(load_image(png_bytes(pil_p)), np.asarray(pil_p.convert("RGB")))


def test_background_none_drops_alpha_as_the_reference_does() -> None:
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[..., 0] = 200
    rgba[..., 3] = 0  # fully transparent: PIL's convert keeps the colour anyway
    assert (load_image(rgba, background=None)[..., 0] == 200).all()
    assert np.array_equal(
        load_image(rgba, background=None),
        np.asarray(Image.fromarray(rgba, "RGBA").convert("RGB")),
    )
    assert (load_image(rgba) == 255).all()  # the default: transparent is white


def test_result_never_aliases_input() -> None:
    array = np.zeros((8, 8, 3), np.uint8)
    out = load_image(array)
    out[0, 0, 0] = 9
    assert array[0, 0, 0] == 0
    strided = np.arange(8 * 16 * 3, dtype=np.uint8).reshape(8, 16, 3)[:, ::2]
    assert np.array_equal(load_image(strided), strided)


def test_pixel_limit() -> None:
    with pytest.raises(ImageError, match="above the limit of 9,999"):
        load_image(np.zeros((100, 100, 3), np.uint8), max_pixels=9_999)
    assert load_image(np.zeros((100, 100, 3), np.uint8), max_pixels=10_000).shape == (100, 100, 3)
    with pytest.raises(ImageError, match="above the limit"):
        load_image(SCENE, max_pixels=800 * 600 - 1)
    with pytest.raises(ImageError, match="above the limit"):
        load_image(Image.new("RGB", (300, 300)), max_pixels=1000)
    # A huge lazily-evaluated vips image is refused before any pixel is computed.
    with pytest.raises(ImageError, match="above the limit"):
        load_image(pyvips.Image.black(100_000, 100_000, bands=3))
    assert DEFAULT_MAX_PIXELS >= 20_000_000


def test_pixel_limit_checked_from_header() -> None:
    # 9000 x 9000 = 81 MP: above our default limit, below PIL's bomb threshold. The file holds
    # no pixel data, so a decode would fail with another message: the header check comes first.
    with pytest.raises(ImageError, match=r"9000 x 9000.*above the limit"):
        load_image(png_header_only(9000, 9000))
    with pytest.raises(ImageError, match=r"above the limit|too large"):
        load_image(png_header_only(30_000, 30_000))  # beyond PIL's own bomb limit too
    with pytest.raises(ImageError, match="cannot decode"):
        load_image(png_header_only(10, 10))  # small header, missing data: a decode error


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (b"definitely not an image", "cannot decode"),
        (SCENE.read_bytes()[:2000], "cannot decode"),
        (b"", "empty"),
        (np.zeros((0, 5, 3), np.uint8), "empty"),
        (np.zeros((4, 4, 3), np.int32), "dtype int32"),
        (np.zeros((4, 4, 3), np.int16), "dtype int16"),
        (np.zeros((4, 4, 3), bool), "dtype bool"),
        (np.zeros((4, 4, 5), np.uint8), "shape"),
        (np.zeros((2, 4, 4, 3), np.uint8), "shape"),
        (np.zeros((4,), np.uint8), "shape"),
        (12, "unsupported image type int"),
        ([[0, 0, 0]], "unsupported image type list"),
    ],
)
def test_bad_inputs(value: object, match: str) -> None:
    with pytest.raises(ImageError, match=match):
        load_image(value)


def test_bad_paths_and_vips(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="no such image file"):
        load_image(tmp_path / "missing.png")
    with pytest.raises(ImageError, match="not a file"):
        load_image(str(tmp_path))
    (tmp_path / "bad.png").write_bytes(b"\x89PNG garbage")
    with pytest.raises(ImageError, match="cannot decode image file"):
        load_image(tmp_path / "bad.png")
    with pytest.raises(ImageError, match="format 'int'"):
        load_image(pyvips.Image.black(4, 4, bands=3).cast("int"))
    with pytest.raises(ImageError, match="zero size"):
        load_image(Image.new("RGB", (0, 5)))


def test_digest_of_encoded_inputs_is_file_hash() -> None:
    data = SCENE.read_bytes()
    expected = hashlib.sha256(data).digest()
    assert len(expected) == 32
    for value in (data, bytearray(data), memoryview(data), SCENE, str(SCENE)):
        assert image_digest(value) == expected
    assert image_digest(RGBA) != expected


def test_digest_of_pixels_includes_shape_and_dtype() -> None:
    pixels = np.arange(36, dtype=np.uint8)
    a = pixels.reshape(2, 6, 3)
    b = pixels.reshape(4, 3, 3)
    assert a.tobytes() == b.tobytes()
    assert image_digest(a) != image_digest(b)
    assert image_digest(a) != image_digest(a.view(np.int8))
    assert image_digest(a) == image_digest(a.copy())
    strided = np.arange(72, dtype=np.uint8).reshape(2, 12, 3)[:, ::2]
    assert image_digest(strided) == image_digest(np.ascontiguousarray(strided))
    assert image_digest(a) != image_digest(a + 1)
    # Decoded images hash as their RGB array, so PIL / pyvips / numpy RGB agree.
    rgb = pil_rgb(SCENE)
    with Image.open(SCENE) as im:
        assert image_digest(im) == image_digest(rgb)
    assert image_digest(pyvips.Image.new_from_file(str(SCENE))) == image_digest(rgb)
    with pytest.raises(ImageError, match="no such image file"):
        image_digest(Path("/nonexistent/image.png"))


def test_image_hash_int() -> None:
    digest = image_digest(SCENE)
    value = image_hash_int(digest)
    assert value == int.from_bytes(digest[:16], "big")
    assert 0 <= value < 2**128
    assert image_hash_int(bytes(range(32))) == int.from_bytes(bytes(range(16)), "big")
    with pytest.raises(ValueError, match="16 bytes"):
        image_hash_int(b"short")
