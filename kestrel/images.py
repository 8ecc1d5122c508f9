"""Caller-side images: decode to RGB pixels and hash them once, before a request reaches the
scheduler.

Accepted inputs: ``PIL.Image.Image`` (any mode), numpy arrays (H x W, or H x W x C with C in
1..4, dtype uint8), ``pyvips.Image`` (1..4 bands, uchar), encoded bytes (PNG, JPEG, ... anything
PIL reads) and ``str`` / ``pathlib.Path`` file paths. Colour conversion follows PIL's
``convert("RGB")``, which is what the reference applies: alpha is dropped (not composited), gray
is replicated, palettes are looked up. EXIF orientation is not applied (the reference does not).

The pixel limit is checked from the header (encoded inputs, lazily loaded PIL images, pyvips
images) or the array shape before any full decode, so an oversized upload costs no decode.

The cache identity of an image is the SHA-256 of its decoded RGB pixels (with dtype and shape),
so the same pixels hit the cache whatever container they came in: a PNG file, its bytes, a PIL
image or a numpy array. The runtime takes the :class:`PreparedImage` as it is: its pixels go
straight to the crop pipeline on a miss, nothing is decoded twice.
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from kestrel.errors import InvalidInputError

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "ImageError",
    "ImageInput",
    "PreparedImage",
    "image_digest",
    "image_hash_int",
    "load_image",
    "prepare_image",
]

DEFAULT_MAX_PIXELS = 50_000_000
_READ_CHUNK = 1 << 20

ImageInput = Any  # PIL.Image.Image | np.ndarray | pyvips.Image | bytes | str | os.PathLike


class ImageError(ValueError):
    """An image that cannot be used: unreadable, empty, too large, or of an unsupported kind."""


def _check_size(width: int, height: int, max_pixels: int, what: str) -> None:
    if width <= 0 or height <= 0:
        raise ImageError(f"{what} has zero size ({width} x {height})")
    if width * height > max_pixels:
        raise ImageError(
            f"{what} is {width} x {height} = {width * height:,} pixels, above the limit of "
            f"{max_pixels:,}; downscale it first or raise max_pixels"
        )


def _from_pil(image: Image.Image, max_pixels: int, what: str = "image") -> np.ndarray:
    _check_size(image.width, image.height, max_pixels, what)
    try:
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        out = np.asarray(rgb, dtype=np.uint8)
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt pixel data
        raise ImageError(f"cannot decode {what}: {exc}") from exc
    return np.array(out, dtype=np.uint8, order="C", copy=True)


def _open_encoded(source: io.BytesIO | Path, max_pixels: int, what: str) -> np.ndarray:
    try:
        with Image.open(source) as image:  # reads the header only
            return _from_pil(image, max_pixels, what)
    except Image.DecompressionBombError as exc:
        raise ImageError(f"{what} is too large to decode safely: {exc}") from exc
    except ImageError:
        raise
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"cannot decode {what} as an image: {exc}") from exc


def _from_array(array: np.ndarray, max_pixels: int) -> np.ndarray:
    if array.size == 0:
        raise ImageError(f"image array is empty (shape {array.shape})")
    if array.dtype != np.uint8:
        raise ImageError(
            f"image array has dtype {array.dtype}; expected uint8 in 0..255 "
            "(convert with np.clip(x, 0, 255).astype(np.uint8) if it holds that range)"
        )
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in (1, 2, 3, 4):
        raise ImageError(
            f"image array has shape {array.shape}; expected H x W or H x W x C with C in 1..4"
        )
    height, width, channels = array.shape
    _check_size(width, height, max_pixels, "image array")
    # Gray (+ alpha): replicate the gray channel; RGB(A): keep RGB. Alpha is dropped, as PIL does.
    rgb = np.repeat(array[:, :, :1], 3, axis=2) if channels <= 2 else array[:, :, :3]
    return np.array(rgb, dtype=np.uint8, order="C", copy=True)


def _from_vips(image: Any, max_pixels: int) -> np.ndarray:
    _check_size(image.width, image.height, max_pixels, "pyvips image")
    if image.format != "uchar":
        raise ImageError(
            f"pyvips image has format {image.format!r}; expected 8-bit 'uchar' "
            "(convert first, e.g. image.colourspace('srgb') or image.cast('uchar'))"
        )
    if image.interpretation == "cmyk":
        raise ImageError("pyvips image is CMYK; convert it with image.colourspace('srgb') first")
    if image.bands not in (1, 2, 3, 4):
        raise ImageError(f"pyvips image has {image.bands} bands; expected 1 to 4")
    try:
        array = image.numpy()
    except Exception as exc:  # libvips reports decode failures as pyvips.Error
        raise ImageError(f"cannot decode pyvips image: {exc}") from exc
    return _from_array(np.asarray(array), max_pixels)


def _is_vips(image: Any) -> bool:
    cls = type(image)
    return cls.__module__.startswith("pyvips") and cls.__name__ == "Image"


def _path_of(image: str | os.PathLike[str]) -> Path:
    path = Path(image).expanduser()
    if not path.exists():
        raise ImageError(f"no such image file: {path}")
    if not path.is_file():
        raise ImageError(f"image path is not a file: {path}")
    return path


def load_image(image: ImageInput, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Decode/convert ``image`` to a new C-contiguous H x W x 3 uint8 RGB array.

    The result never shares memory with the input. Raises ImageError for an unsupported type,
    corrupt or empty data, a missing file, a wrong dtype or shape, or more than ``max_pixels``.
    """
    if isinstance(image, Image.Image):
        return _from_pil(image, max_pixels)
    if isinstance(image, np.ndarray):
        return _from_array(image, max_pixels)
    if isinstance(image, (bytes, bytearray, memoryview)):
        if len(image) == 0:
            raise ImageError("image bytes are empty")
        return _open_encoded(io.BytesIO(bytes(image)), max_pixels, "image bytes")
    if isinstance(image, (str, os.PathLike)):
        path = _path_of(image)
        return _open_encoded(path, max_pixels, f"image file {path}")
    if _is_vips(image):
        return _from_vips(image, max_pixels)
    raise ImageError(
        f"unsupported image type {type(image).__name__}: pass a PIL image, a numpy uint8 array, "
        "a pyvips image, encoded bytes, or a file path"
    )


def _digest_array(array: np.ndarray) -> bytes:
    # dtype and shape are hashed with the pixels: equal bytes in another shape are another image.
    h = hashlib.sha256()
    h.update(f"kestrel-pixels:{array.dtype.str}:{tuple(array.shape)}:".encode())
    h.update(np.ascontiguousarray(array).data)
    return h.digest()


def image_digest(image: ImageInput) -> bytes:
    """A 32-byte SHA-256 content digest, the image's identity in the prefix cache.

    Encoded bytes and paths: the digest of the file bytes (nothing is decoded). numpy arrays:
    the digest of (dtype, shape, pixel bytes) as given. PIL and pyvips images: the digest of
    their :func:`load_image` array (so the same RGB pixels as a numpy array hash the same).
    """
    if isinstance(image, (bytes, bytearray, memoryview)):
        return hashlib.sha256(image).digest()
    if isinstance(image, (str, os.PathLike)):
        h = hashlib.sha256()
        with _path_of(image).open("rb") as fh:
            while chunk := fh.read(_READ_CHUNK):
                h.update(chunk)
        return h.digest()
    if isinstance(image, np.ndarray):
        return _digest_array(image)
    if isinstance(image, Image.Image) or _is_vips(image):
        return _digest_array(load_image(image, max_pixels=2**62))
    raise ImageError(f"unsupported image type {type(image).__name__}")


def image_hash_int(digest: bytes) -> int:
    """The cache's image hash: the first 16 bytes of ``digest`` as a big-endian 128-bit int."""
    if len(digest) < 16:
        raise ValueError(f"digest must be at least 16 bytes, got {len(digest)}")
    return int.from_bytes(digest[:16], "big")


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
