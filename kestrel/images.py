"""Caller-side image handling: decode and hash once, before a request reaches the scheduler.

The cache identity of an image is the SHA-256 of its decoded RGB pixels (with dtype and shape),
so the same pixels hit the cache whatever container they came in: a PNG file, its bytes, a PIL
image or a numpy array. Decoding a file costs little next to the vision encoder, and the engine
has to decode on a miss anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kestrel.errors import InvalidInputError
from kestrel.moondream.image_input import (
    DEFAULT_MAX_PIXELS,
    ImageError,
    image_digest,
    load_image,
)

__all__ = ["PreparedImage", "prepare_image"]


@dataclass(frozen=True, slots=True, eq=False)
class PreparedImage:
    """A decoded H x W x 3 uint8 RGB image and its content digest. Pass it as ``image`` to
    any Engine call to skip decoding and hashing again (e.g. many questions about one image)."""

    pixels: np.ndarray
    digest: bytes

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])


def prepare_image(image: object, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> PreparedImage:
    """Decode ``image`` (path, bytes, PIL, numpy, pyvips) and hash its pixels.

    Raises :class:`~kestrel.errors.InvalidInputError` for anything that is not a usable image
    (unreadable, corrupt, empty, over ``max_pixels``, unsupported type)."""
    if isinstance(image, PreparedImage):
        return image
    try:
        pixels = load_image(image, max_pixels=max_pixels)
    except ImageError as exc:
        raise InvalidInputError(f"bad image: {exc}") from exc
    except (OSError, ValueError, MemoryError) as exc:  # decoder errors PIL does not wrap
        raise InvalidInputError(f"bad image: {type(exc).__name__}: {exc}") from exc
    pixels.setflags(write=False)  # shared read-only between requests
    return PreparedImage(pixels, image_digest(pixels))
