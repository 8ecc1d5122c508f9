"""Encoded images are decoded by an allow-list of formats (``kestrel/images/formats.py``):
each accepted format decodes; PostScript, which PIL would hand to Ghostscript, is refused by
name with Ghostscript present (simulated), and no process is started; a format PIL reads but
Kestrel does not accept, and bytes no reader knows, are refused with the accepted list; the
server answers an EPS upload with a 400 naming the format, starting no process on the way
(not even the C library's lookup, which asks ldconfig: the server does it when it is built)."""

from __future__ import annotations

import base64
import io
import subprocess

import numpy as np
import pytest
from PIL import EpsImagePlugin, Image

from kestrel.errors import InvalidInputError
from kestrel.images import ACCEPTED_FORMATS, prepare_image

PIXELS = (np.arange(20 * 30 * 3) % 251).astype(np.uint8).reshape(20, 30, 3)


def encoded(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(PIXELS).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "MPO"])
def test_accepted_formats_decode(fmt: str) -> None:
    assert fmt in ACCEPTED_FORMATS
    image = prepare_image(encoded(fmt))
    assert (image.width, image.height) == (30, 20)
    if fmt in ("PNG", "BMP", "TIFF"):  # lossless: the very pixels
        assert np.array_equal(image.pixels, PIXELS)


def watch_processes(monkeypatch) -> list:
    """Ghostscript reported present, and from now on every way of starting a process
    recorded (and refused)."""
    started: list = []

    def record(*args, **kwargs):
        started.append(args)
        raise AssertionError("a process was started")

    monkeypatch.setattr(EpsImagePlugin, "has_ghostscript", lambda: True)
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", "gs", raising=False)
    for name in ("Popen", "run", "call", "check_call", "check_output"):
        monkeypatch.setattr(subprocess, name, record)
    return started


@pytest.fixture
def ghostscript(monkeypatch) -> list:
    return watch_processes(monkeypatch)


def test_postscript_is_refused_by_name_and_starts_nothing(ghostscript) -> None:
    with pytest.raises(InvalidInputError, match="EPS, which Kestrel does not decode"):
        prepare_image(encoded("EPS"))
    assert ghostscript == []


def test_a_format_pil_reads_but_kestrel_does_not_is_named() -> None:
    with pytest.raises(InvalidInputError, match=r"is PPM, .* send one of PNG, JPEG"):
        prepare_image(encoded("PPM"))


def test_bytes_no_reader_knows_list_the_accepted_formats() -> None:
    with pytest.raises(InvalidInputError, match=r"not a format Kestrel reads \(PNG, JPEG"):
        prepare_image(b"hello, not an image at all")


def test_the_server_answers_an_eps_upload_400_naming_it(monkeypatch) -> None:
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from kestrel import Engine
    from kestrel.server.app import create_app

    url = "data:image/eps;base64," + base64.b64encode(encoded("EPS")).decode()
    with (
        Engine(device="cpu", max_batch_size=1) as engine,
        TestClient(create_app(engine)) as client,
    ):
        started = watch_processes(monkeypatch)  # the server is up: now nothing may start one
        got = client.post("/v1/caption", json={"image_url": url, "length": "short"})
        monkeypatch.undo()
    assert got.status_code == 400, got.text
    assert got.json()["error"]["type"] == "invalid_image"
    assert "EPS" in got.json()["error"]["message"]
    assert started == []
