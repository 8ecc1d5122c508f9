"""Decode a large image only as far as its crops use it: shrink on load.

Moondream never looks at more pixels than its largest crop grid: the crops are the image
resampled to one size (``Fit``: for an upright ``height`` x ``width`` image, the size its
local crops are cut from, rows x cols windows plus the margins) and to the global crop's.
A 12 MP phone photo or a 49 MP scan used to be decoded whole (~150 MB of RGB for 49 MP) and
then resampled down to ~1000 x 1000. Here such an image is reduced while it is decoded, by the
largest integer factor ``f`` that keeps it at least as large as that size on both sides and
gives the same crop grid (so the crops are still a downscale of a picture that holds every
pixel they sample, and their number and layout do not change):

- JPEG (and MPO): libjpeg's DCT scaling through Pillow's ``draft`` (f in 2, 4, 8): the
  pixels of a 1/f-size picture come out of the entropy decoder at that size, never at full
  size. Pillow then converts as for any JPEG (CMYK, gray, orientation).
- PNG and WebP of the kinds libvips decodes to Pillow's pixels (``images/vips.py``): a
  sequential libvips decode (PNG) or libwebp's scaled decode (WebP) feeding a box shrink by
  ``f``; libvips streams the rows, so the full-size picture never exists in memory.
- Everything else (GIF, BMP, TIFF, palette or 16-bit PNG, animated images) decodes in full,
  as before.

The result is deterministic: the same bytes with the same options always give the same
pixels, hence the same identity (the SHA-256 of the reduced pixels, docs/images.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyvips
from PIL import Image

from kestrel.images.vips import BANDS, takes

__all__ = ["JPEG_FACTORS", "Fit", "Shrink", "plan_shrink", "shrink_factor", "shrink_on_load"]

# upright (height, width) -> the (height, width) the crops resample the image to
Fit = Callable[[int, int], tuple[int, int]]
JPEG_FACTORS = (8, 4, 2)  # the DCT scalings Pillow asks libjpeg for
_WEBP_BANDS = {"RGB": 3, "RGBA": 4}


def _sides(side: int, f: int) -> tuple[int, int]:
    return side // f, -(-side // f)  # a decoder rounds one way or the other


def shrink_factor(height: int, width: int, fit: Fit, factors: Iterable[int]) -> int:
    """The largest ``f`` of ``factors`` for which the ``height`` x ``width`` image reduced
    by ``f`` (either rounding) is still at least as large as its ``fit``; 1 if none."""
    target = fit(height, width)
    for f in sorted(set(factors), reverse=True):
        if f < 2:
            continue
        fits = all(
            h >= target[0] and w >= target[1] for h in _sides(height, f) for w in _sides(width, f)
        )
        if fits:
            return f
    return 1


def _integer_factors(height: int, width: int, fit: Fit) -> range:
    th, tw = fit(height, width)
    return range(2, max(1, min(height // max(th, 1), width // max(tw, 1))) + 1)


def _vips_shrunk(image: Image.Image, data: bytes, f: int) -> np.ndarray | None:
    """``data`` decoded by libvips reduced by ``f``, uint8 H x W x bands; None if libvips
    reports anything wrong (Pillow then decodes it in full)."""
    bands = (BANDS.get("PNG", {}) if image.format == "PNG" else _WEBP_BANDS)[image.mode]
    try:
        # a source over the bytes: new_from_buffer would hold a copy of them
        source = pyvips.Source.new_from_memory(data)
        if image.format == "WEBP":
            vips = pyvips.Image.new_from_source(source, "", scale=1.0 / f, fail_on="warning")
        else:
            vips = pyvips.Image.new_from_source(source, "", access="sequential", fail_on="warning")
            vips = vips.shrinkh(f).shrinkv(f)  # rows shrunk first: less held between them
        if vips.format != "uchar" or vips.bands != bands:
            return None
        array = vips.numpy()
    except pyvips.Error:
        return None
    return array.reshape(vips.height, vips.width, vips.bands)


def _vips_kind(image: Image.Image, data: bytes) -> bool:
    if image.format == "WEBP":
        return image.mode in _WEBP_BANDS and not getattr(image, "is_animated", False)
    return image.mode in BANDS["PNG"] and takes(image, data)


@dataclass(frozen=True, slots=True)
class Shrink:
    """How one encoded image is decoded: ``how`` is "full" (Pillow, whole), "draft" (Pillow,
    a JPEG at 1/``factor`` scale) or "vips" (libvips, reduced by ``factor``); ``size`` is the
    (height, width) it decodes to at most, as stored."""

    how: str
    factor: int
    size: tuple[int, int]
    source_width: int = 0

    def peak_bytes(self) -> int:
        """What decoding it may hold at once, at most: Pillow keeps 4 bytes a pixel, its
        conversion, the RGB array and alpha's compositing a few more; libvips streams, with
        up to ~500 source rows in its line buffers (20 MB for a 7000 x 7000 PNG, measured)."""
        if self.how == "vips":
            return self.size[0] * self.size[1] * 12 + self.source_width * 4 * 512
        return self.size[0] * self.size[1] * 16


def _reduced(image: Image.Image, how: str, f: int) -> Shrink:
    return Shrink(how, f, (-(-image.height // f), -(-image.width // f)), image.width)


def plan_shrink(
    image: Image.Image, source: bytes | Path, fit: Fit | None, upright: tuple[int, int]
) -> Shrink:
    """How to decode the encoded image Pillow opened as ``image`` (``upright``: its height and
    width once turned upright) so that it is reduced as far as ``fit`` allows (module doc);
    ``fit`` None: in full."""
    full = Shrink("full", 1, (image.height, image.width))
    if fit is None:
        return full
    if image.format in ("JPEG", "MPO"):
        f = shrink_factor(*upright, fit, JPEG_FACTORS)
        return _reduced(image, "draft", f) if f > 1 else full
    factors = _integer_factors(*upright, fit)
    if image.format not in ("PNG", "WEBP") or len(factors) == 0:
        return full
    data = source if isinstance(source, bytes) else source.read_bytes()
    if not _vips_kind(image, data):
        return full
    f = shrink_factor(*upright, fit, factors)
    return _reduced(image, "vips", f) if f > 1 else full


def shrink_on_load(image: Image.Image, source: bytes | Path, plan: Shrink) -> np.ndarray | None:
    """Carry out ``plan``: a JPEG is set to decode at its reduced size and None is returned
    (Pillow decodes it); a PNG or WebP comes back decoded by libvips, uint8 H x W x bands;
    None for the rest (or if libvips fails): Pillow decodes it in full."""
    if plan.how == "draft":
        image.draft(image.mode, (image.width // plan.factor, image.height // plan.factor))
        return None
    if plan.how != "vips":
        return None
    data = source if isinstance(source, bytes) else source.read_bytes()
    return _vips_shrunk(image, data, plan.factor)
