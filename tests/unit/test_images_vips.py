"""libvips decodes PNGs to exactly PIL's pixels (``kestrel/images/vips.py``), leaves every
other kind (JPEG among them) to PIL, and never turns a file PIL refuses into pixels."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from kestrel import images
from kestrel.images import ImageError, load_image
from kestrel.images.vips import decode_pixels

RNG = np.random.default_rng(0)


def _pil_pixels(data: bytes, **kw) -> np.ndarray:
    """What load_image gave before libvips: PIL decodes (the same options)."""
    opts = images._options(kw.get("exif_orientation", True), kw.get("background", images.WHITE))
    with Image.open(io.BytesIO(data)) as image:
        return images._from_pil(image, images.DEFAULT_MAX_PIXELS, opts)


def _encode(array: np.ndarray, fmt: str, mode: str | None = None, **save) -> bytes:
    """``array`` (its mode from its shape and dtype) saved as ``fmt``, converted to ``mode``."""
    buf = io.BytesIO()
    image = Image.fromarray(array)
    (image.convert(mode) if mode else image).save(buf, fmt, **save)
    return buf.getvalue()


def _taken(data: bytes) -> bool:
    with Image.open(io.BytesIO(data)) as image:
        return decode_pixels(image, data) is not None


def _picture(h: int, w: int, smooth: bool) -> np.ndarray:
    noise = RNG.integers(0, 256, (h, w, 4), np.uint8)
    return (np.cumsum(noise, axis=1) % 256).astype(np.uint8) if smooth else noise


def _orientation_exif(value: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = value
    return exif.tobytes()


def _cases() -> list[tuple[str, bytes, bool]]:
    """(name, file, whether libvips should take it)."""
    cases = []
    for i, (h, w) in enumerate([(17, 33), (480, 640), (641, 899), (1, 1), (300, 7)]):
        a = _picture(h, w, smooth=i % 2 == 0)
        cases.append((f"jpeg {h}x{w}", _encode(a[..., :3], "JPEG", quality=90), False))
        cases.append((f"jpeg gray {h}x{w}", _encode(a[..., 0], "JPEG", "L"), False))
        progressive = _encode(a[..., :3], "JPEG", progressive=True)
        cases.append((f"jpeg progressive {h}x{w}", progressive, False))
        cases += [
            (f"png rgb {h}x{w}", _encode(a[..., :3], "PNG"), True),
            (f"png rgba {h}x{w}", _encode(a, "PNG"), True),
            (f"png gray {h}x{w}", _encode(a[..., 0], "PNG", "L"), True),
            (f"png gray+alpha {h}x{w}", _encode(a[..., :2], "PNG", "LA"), True),
            (f"png 4-bit gray {h}x{w}", _encode(a[..., 0], "PNG", bits=4), True),
        ]
    a = _picture(40, 60, smooth=True)
    rgb16 = (a[..., :3].astype(np.uint16) * 257 + 1).astype(">u2")
    rotated_png = _encode(a[..., :3], "PNG", exif=_orientation_exif(6))
    cases += [
        ("png 16-bit gray", _encode(rgb16[..., 0].astype(np.uint16), "PNG"), False),
        ("png 16-bit rgb", _png16(rgb16), False),
        ("png palette", _palette_png(a[..., :3]), False),
        ("png transparent colour", _encode(a[..., :3], "PNG", transparency=(0, 0, 0)), False),
        ("png exif 6", rotated_png, True),
        ("png exif 6 after the pixels", _late_exif(rotated_png), False),
        ("jpeg exif 8", _encode(a[..., :3], "JPEG", exif=_orientation_exif(8)), False),
        ("jpeg cmyk", _encode(a, "JPEG", "CMYK"), False),
        ("gif", _encode(a[..., 0], "GIF", "L"), False),
    ]
    return cases


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png16(rgb: np.ndarray) -> bytes:
    """A 16-bit RGB PNG (PIL writes none), written by hand."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\0" + rgb[y].tobytes() for y in range(h))
    head = struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", head)
            + _png_chunk(b"IDAT", zlib.compress(raw)) + _png_chunk(b"IEND", b""))  # fmt: skip


def _palette_png(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE).save(buf, "PNG")
    return buf.getvalue()


def _late_exif(png: bytes) -> bytes:
    """``png`` with its eXIf chunk moved after the pixels (PIL finds it only by decoding)."""
    at, chunks = 8, []
    while at < len(png):
        (n,) = struct.unpack(">I", png[at : at + 4])
        chunks.append(png[at : at + 12 + n])
        at += 12 + n
    exif = [c for c in chunks if c[4:8] == b"eXIf"]
    rest = [c for c in chunks if c[4:8] != b"eXIf"]
    assert len(exif) == 1
    return png[:8] + b"".join(rest[:-1]) + exif[0] + rest[-1]


CASES = _cases()


@pytest.mark.parametrize(("name", "data", "taken"), CASES, ids=[c[0] for c in CASES])
def test_the_same_pixels_as_pil(name: str, data: bytes, taken: bool) -> None:
    assert _taken(data) == taken, name
    for kw in ({}, {"background": None}, {"exif_orientation": False}):
        got = load_image(data, **kw)
        want = _pil_pixels(data, **kw)
        assert got.dtype == np.uint8 and got.flags.c_contiguous and got.flags.writeable
        assert got.shape == want.shape and np.array_equal(got, want), (name, kw)


def test_orientation_is_applied_on_the_fast_path() -> None:
    a = _picture(20, 30, smooth=False)[..., :3]
    png = _encode(a, "PNG", exif=_orientation_exif(6))
    assert _taken(png)
    assert np.array_equal(load_image(png), np.rot90(a, -1))
    assert np.array_equal(load_image(png, exif_orientation=False), a)


def test_a_path_takes_the_fast_path_too(tmp_path) -> None:
    a = _picture(50, 70, smooth=True)[..., :3]
    path = tmp_path / "chart.png"
    path.write_bytes(_encode(a, "PNG"))
    with Image.open(path) as image:
        assert decode_pixels(image, path) is not None
    assert np.array_equal(load_image(path), a) and np.array_equal(load_image(str(path)), a)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_damaged_files_are_refused_as_before(fmt: str) -> None:
    data = _encode(_picture(200, 300, smooth=True)[..., :3], fmt)
    cut = data[: len(data) // 2]
    with Image.open(io.BytesIO(cut)) as image:  # the header still reads
        assert decode_pixels(image, cut) is None  # libvips leaves it to PIL
    with pytest.raises(ImageError, match="cannot decode"):
        load_image(cut)
    if fmt == "PNG":  # a flipped byte in the pixels: PIL's checksum error, not libvips' pixels
        at = data.index(b"IDAT") + 40
        bad = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]
        with pytest.raises(ImageError):
            load_image(bad)
