"""Generated image files for the image tests (docs/images.md): one small picture stored in each
EXIF orientation, animations, any PIL image encoded with options."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

# The picture as a viewer shows it: 10 wide, 6 tall.
UPRIGHT = np.random.default_rng(24).integers(0, 256, size=(6, 10, 3), dtype=np.uint8)
# The array each orientation stores so that a viewer shows UPRIGHT (the inverse of the tag).
STORED = {
    1: UPRIGHT,
    2: UPRIGHT[:, ::-1],
    3: UPRIGHT[::-1, ::-1],
    4: UPRIGHT[::-1],
    5: UPRIGHT.transpose(1, 0, 2),
    6: np.rot90(UPRIGHT, 1),
    7: UPRIGHT[::-1, ::-1].transpose(1, 0, 2),
    8: np.rot90(UPRIGHT, -1),
}


def encode(image: Image.Image, fmt: str = "PNG", orientation: int | None = None, **kw) -> bytes:
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kw["exif"] = exif.tobytes()
    out = io.BytesIO()
    image.save(out, format=fmt, **kw)
    return out.getvalue()


def stored_png(orientation: int) -> bytes:
    return encode(Image.fromarray(np.ascontiguousarray(STORED[orientation])), "PNG", orientation)


def animation(fmt: str) -> bytes:
    frames = [Image.new("RGB", (8, 6), c) for c in ((250, 0, 0), (0, 250, 0), (0, 0, 250))]
    out = io.BytesIO()
    frames[0].save(out, format=fmt, save_all=True, append_images=frames[1:], duration=50)
    return out.getvalue()
