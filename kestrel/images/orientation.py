"""EXIF orientation: read from a PIL image's header, applied to its decoded pixels."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from PIL import Image

__all__ = ["ORIENT", "read_orientation", "upright"]

ORIENTATION_TAG = 0x0112  # EXIF "Orientation"

# EXIF orientation -> the array operation that shows the picture upright (H x W x C arrays).
ORIENT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    1: lambda a: a,
    2: lambda a: a[:, ::-1],  # mirrored left-right
    3: lambda a: a[::-1, ::-1],  # upside down
    4: lambda a: a[::-1],  # mirrored top-bottom
    5: lambda a: a.transpose(1, 0, 2),  # transposed
    6: lambda a: np.rot90(a, -1),  # stored 90 degrees counter-clockwise: turn it clockwise
    7: lambda a: a[::-1, ::-1].transpose(1, 0, 2),  # transversed
    8: lambda a: np.rot90(a, 1),  # stored 90 degrees clockwise: turn it counter-clockwise
}


def read_orientation(image: Image.Image) -> int:
    """The orientation ``image``'s EXIF gives (1, upright, when it has none or it is broken)."""
    try:
        value = image.getexif().get(ORIENTATION_TAG, 1)
    except Exception:  # a broken EXIF block (any parser error) says nothing: upright
        return 1
    return value if isinstance(value, int) and value in ORIENT else 1


def upright(rgb: np.ndarray, orientation: int, *, copy: bool) -> np.ndarray:
    """``rgb`` turned as ``orientation`` says, C-contiguous uint8: a new array, or with
    ``copy=False`` ``rgb`` itself when it already is one and upright (a decoder's fresh
    buffer)."""
    out = ORIENT[orientation](rgb)
    if copy or orientation != 1:
        return np.array(out, dtype=np.uint8, order="C", copy=True)
    return np.ascontiguousarray(out, dtype=np.uint8)
