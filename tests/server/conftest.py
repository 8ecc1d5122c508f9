"""Shared by the server tests: the fixture model's engine (the app's engine in-process, the
reference for the subprocess server), images as data URLs, and hostile image bytes."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest
from PIL import Image

from tests.conftest import fixture_dir

MODEL = fixture_dir()
ADAPTER_DIR = MODEL / "adapter"
ADAPTER = "fr"
SHAPES = (MODEL / "images" / "shapes_378.png").read_bytes()
GREEDY = {"temperature": 0, "max_tokens": 4}
ENGINE_OPTIONS = {"device": "cpu", "dtype": "float32", "kv_cache_pages": 6000, "max_batch_size": 8}


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def png(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims ``width`` x ``height`` pixels in a few dozen bytes (a decompression
    bomb's header: decoding it would need width * height * 3 bytes)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 1024)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.fixture(scope="session")
def engine():
    """One engine on the fixture model, with the fixture's adapter loaded as ``fr``."""
    from kestrel import Engine

    with Engine(MODEL, **ENGINE_OPTIONS) as e:
        e.load_adapter(ADAPTER, ADAPTER_DIR)
        yield e
