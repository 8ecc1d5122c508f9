"""libvips decodes PNG images, to the pixels PIL would give, in a fraction of PIL's time.

Charts, screenshots and documents -- much of what a vision-language model is asked about --
come as PNG, and PIL spends most of a request's image preparation unpacking them: ~4.3 ms for a
862 x 582 chart here, against ~2.6 ms through libvips (already the crop pipeline's resampler),
SHA-256 included (``scripts/bench_images.py``). That time is on the caller's thread of every
request that brings an image, so at batch 1 it adds to every answer. PNG is lossless: both
decoders give the same pixels (the tests compare them). JPEG stays with PIL, which decodes it
faster than libvips does here.

PIL still opens every input: the header gives the format, mode, size (checked against the pixel
limit before anything is decoded) and the EXIF orientation. libvips decodes only RGB, RGBA, L
and LA PNGs of at most 8 bits, without a transparent colour, not animated, and none whose
orientation PIL would find only by decoding it (an EXIF block after the pixels, or XMP). It
fails on any warning (``fail_on="warning"``), so a damaged file is always left to PIL, whose
errors the callers already report. Everything else returns None: PIL decodes it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyvips
from PIL import Image

__all__ = ["BANDS", "decode_pixels", "tagged", "takes"]

# PIL mode -> the bands libvips gives for it, per format libvips decodes here.
BANDS = {"PNG": {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2}}
_TAGS = (b"eXIf", b"XML:com.adobe.xmp")  # PNG chunks that may carry an orientation


def takes(image: Image.Image, data: bytes) -> bool:
    bands = BANDS.get(image.format or "", {})
    if image.mode not in bands or "transparency" in image.info:
        return False
    if getattr(image, "is_animated", False):
        return False
    # PIL reads a PNG's orientation only after decoding it when no EXIF block came before the
    # pixels (one may come after them, or XMP may carry it): such a PNG is left to PIL. The
    # search may also match compressed bytes; that only costs the faster decode.
    return not (
        image.format == "PNG" and "exif" not in image.info and any(m in data for m in _TAGS)
    )


def tagged(image: Image.Image) -> bool:
    """Whether ``image`` (one ``decode_pixels`` took) may carry an orientation: PIL reads it
    from the header without decoding. False: it is upright."""
    return image.format != "PNG" or "exif" in image.info


def decode_pixels(image: Image.Image, source: bytes | Path) -> np.ndarray | None:
    """The pixels of the encoded ``source`` whose header PIL opened as ``image``: uint8
    H x W x C with C the bands of its mode (RGB 3, RGBA 4, L 1, LA 2), as PIL would decode
    them; None when libvips does not take it (module doc), PIL then decodes it."""
    if image.format not in BANDS or image.mode not in BANDS[image.format]:
        return None  # before reading a file's bytes
    data = source if isinstance(source, bytes) else source.read_bytes()
    if not takes(image, data):
        return None
    try:
        source = pyvips.Source.new_from_memory(data)  # new_from_buffer would copy the bytes
        vips = pyvips.Image.new_from_source(source, "", access="sequential", fail_on="warning")
        if vips.format != "uchar" or vips.bands != BANDS[image.format][image.mode]:
            return None  # e.g. a 16-bit PNG, which PIL narrows its own way
        if (vips.width, vips.height) != image.size:
            return None
        array = vips.numpy()  # squeezed: H x W for one band, a scalar for one pixel
    except pyvips.Error:
        return None  # damaged, or a variant libvips reads otherwise: PIL decides
    return array.reshape(vips.height, vips.width, vips.bands)
