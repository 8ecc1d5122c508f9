"""kestrel/images/known.py: encoded bytes prepared before come back deferred (their digest and
size, no decode), decode to the very pixels and digest they had when something asks for their
pixels (once, whichever thread asks), travel pickled as their bytes, and are
forgotten beyond the capacity; what is not an image is refused every time."""

from __future__ import annotations

import io
import pickle
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kestrel.errors import InvalidInputError
from kestrel.images import PreparedImage, prepare_image
from kestrel.images.known import DeferredImage, KnownImages


def _png(seed: int, size: tuple[int, int] = (30, 40)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_the_same_bytes_come_back_deferred_with_the_same_identity() -> None:
    known, png = KnownImages(), _png(0)
    first = known.prepare(png)
    assert type(first) is PreparedImage and known.repeats == 0
    again = known.prepare(bytearray(png))  # any bytes-like holding the same bytes
    assert isinstance(again, DeferredImage) and isinstance(again, PreparedImage)
    assert again.digest == first.digest and (again.height, again.width) == (30, 40)
    assert not again.decoded and known.repeats == 1
    assert "30x40" in repr(again) and not again.decoded  # repr decodes nothing
    assert np.array_equal(again.pixels, first.pixels) and again.decoded
    assert not again.pixels.flags.writeable
    assert prepare_image(again) is again  # prepared already: taken as it is


def test_the_options_are_the_engines(tmp_path: Path) -> None:
    """A deferred image decodes with the options its KnownImages has (here a black
    background for a transparent PNG), as its first decode did."""
    rgba = np.zeros((4, 4, 4), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, format="PNG")
    known = KnownImages(background=(0, 0, 0))
    first, again = known.prepare(buf.getvalue()), known.prepare(buf.getvalue())
    assert isinstance(again, DeferredImage) and int(again.pixels.max()) == 0
    assert again.digest == first.digest != prepare_image(buf.getvalue()).digest  # white


def test_a_file_is_known_by_its_contents(tmp_path: Path) -> None:
    path = tmp_path / "chart.png"
    path.write_bytes(_png(1))
    known = KnownImages()
    first = known.prepare(path)
    assert isinstance(known.prepare(str(path)), DeferredImage)
    path.write_bytes(_png(2))  # the same name, another picture: decoded, another identity
    changed = known.prepare(path)
    assert type(changed) is PreparedImage and changed.digest != first.digest
    with pytest.raises(InvalidInputError, match="no such image file"):
        known.prepare(tmp_path / "missing.png")


def test_what_is_not_an_image_is_refused_every_time() -> None:
    known = KnownImages()
    for _ in range(2):
        with pytest.raises(InvalidInputError):
            known.prepare(b"not an image")
    assert len(known) == 0 and known.repeats == 0


def test_decoded_arrays_are_prepared_as_always() -> None:
    known = KnownImages()
    pixels = np.zeros((5, 6, 3), np.uint8)
    for _ in range(2):
        got = known.prepare(pixels)
        assert type(got) is PreparedImage and got.digest == prepare_image(pixels).digest
    assert len(known) == 0


def test_beyond_the_capacity_the_oldest_is_forgotten() -> None:
    known = KnownImages(capacity=2)
    a, b, c = _png(3), _png(4), _png(5)
    for png in (a, b, c):
        known.prepare(png)
    assert len(known) == 2
    assert type(known.prepare(a)) is PreparedImage  # forgotten: decoded again (and known)
    assert isinstance(known.prepare(c), DeferredImage)
    with pytest.raises(ValueError, match="capacity"):
        KnownImages(capacity=0)


def test_pixels_are_decoded_once_whichever_threads_ask() -> None:
    known, png = KnownImages(), _png(6)
    known.prepare(png)
    deferred = known.prepare(png)
    calls: list[int] = []
    decode = deferred._decode
    object.__setattr__(deferred, "_decode", lambda data: calls.append(1) or decode(data))
    got: list[np.ndarray] = []
    threads = [threading.Thread(target=lambda: got.append(deferred.pixels)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and all(g is got[0] for g in got)


def test_pickled_it_travels_as_its_bytes_and_decodes_on_the_other_side() -> None:
    """A Ray front door sends prepared images to replicas: a deferred one goes as its encoded
    bytes and its decoder (with the options), not its pixels (a chart's are 1.5 MB)."""
    known, png = KnownImages(background=(0, 0, 0)), _png(7)
    first = known.prepare(png)
    deferred = known.prepare(png)
    blob = pickle.dumps(deferred)
    assert not deferred.decoded and len(blob) < len(png) + 1024
    back = pickle.loads(blob)
    assert isinstance(back, DeferredImage) and not back.decoded
    assert back.digest == first.digest and (back.height, back.width) == (30, 40)
    assert np.array_equal(back.pixels, first.pixels)
    assert back._decode.keywords["background"] == (0, 0, 0)  # the options travel with it
