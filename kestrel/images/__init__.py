"""Caller-side images: decode to RGB pixels as people see them and hash them once, before a
request reaches the scheduler.

Accepted inputs: ``PIL.Image.Image`` (any mode), numpy arrays (H x W, or H x W x C with C in
1..4; uint8, uint16 or float), ``pyvips.Image`` (1..4 bands), encoded bytes in one of
``ACCEPTED_FORMATS`` (PNG, JPEG, WebP, GIF, BMP, TIFF; any other is refused naming its format)
and ``str`` / ``pathlib.Path`` file paths. What happens to each kind of image
(docs/images.md):

- EXIF orientation (paths, bytes, PIL images carrying EXIF, pyvips images) is applied, so every
  coordinate the model returns is in the picture a viewer shows; ``exif_orientation=False``
  keeps the stored orientation. An unreadable EXIF block counts as upright.
- 16-bit pixels (PIL ``I;16`` / ``I`` modes, uint16 arrays, vips ``ushort``) are scaled
  0..65535 -> 0..255 (rounded), never clipped; float pixels (PIL ``F``, float arrays) are read as
  0..1 and anything else (NaN, infinity, values outside 0..1) is refused.
- Alpha (RGBA, LA, PA, palettes or RGB / L with a transparent colour, 2- and 4-channel arrays) is
  composited on ``background`` (white by default); ``background=None`` drops it instead, as
  PIL's ``convert("RGB")`` and the Moondream reference do.
- Animated images (GIF, APNG, WebP) use their first frame. Everything else (gray, bilevel,
  palette, CMYK, YCbCr) follows PIL's ``convert("RGB")``.

The pixel limit is checked from the header (encoded inputs, lazily loaded PIL images, pyvips
images) or the array shape before any full decode, so an oversized upload costs no decode.

Encoded images larger than their crops use are reduced as they are decoded, given a ``fit``
(``images/shrink.py``), and a decode holds its bytes of a ``budget`` (``images/budget.py``).

The cache identity of an image is the SHA-256 of its decoded RGB pixels (with dtype and shape),
taken after all of the above (a reduced image's reduced pixels): the same picture hits the
cache whatever container it came in (a PNG file, its bytes, a PIL image, a numpy array, a JPEG
stored sideways with an orientation tag), and the same bytes always hash alike. The runtime
takes the :class:`PreparedImage` as it is: its pixels go straight to the crop pipeline on a
miss, nothing is decoded twice.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from kestrel.errors import InvalidInputError
from kestrel.images.budget import DecodeBudget
from kestrel.images.formats import ACCEPTED_FORMATS, accepted_readers, stream, unaccepted
from kestrel.images.orientation import read_orientation, upright
from kestrel.images.pixels import ImageError, array_rgb
from kestrel.images.shrink import Fit, Shrink, plan_shrink, shrink_on_load
from kestrel.images.vips import decode_pixels, tagged

__all__ = [
    "ACCEPTED_FORMATS",
    "DEFAULT_MAX_PIXELS",
    "WHITE",
    "ImageError",
    "ImageInput",
    "PreparedImage",
    "image_digest",
    "image_hash_int",
    "load_image",
    "prepare_image",
]

DEFAULT_MAX_PIXELS = 50_000_000

WHITE = (255, 255, 255)
_READ_CHUNK = 1 << 20
_WIDE_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")  # 16/32-bit gray, float gray
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")

ImageInput = Any  # PIL.Image.Image | np.ndarray | pyvips.Image | bytes | str | os.PathLike


@dataclass(frozen=True, slots=True)
class _Options:
    """How to decode: apply the EXIF orientation or not; the colour alpha is composited on
    (None: alpha dropped)."""

    exif_orientation: bool = True
    background: tuple[int, int, int] | None = WHITE
    fit: Fit | None = None  # encoded images: shrunk on load as far as this allows (shrink.py)


def _options(
    exif_orientation: bool, background: Sequence[int] | None, fit: Fit | None = None
) -> _Options:
    if background is None:
        return _Options(bool(exif_orientation), None, fit)
    colour = tuple(background)
    if len(colour) != 3 or not all(
        isinstance(c, (int, np.integer)) and not isinstance(c, bool) and 0 <= c <= 255
        for c in colour
    ):
        raise ValueError(
            f"background must be an (r, g, b) tuple of ints in 0..255, got {background!r}"
        )
    return _Options(bool(exif_orientation), (int(colour[0]), int(colour[1]), int(colour[2])), fit)


def _check_size(width: int, height: int, max_pixels: int, what: str) -> None:
    if width <= 0 or height <= 0:
        raise ImageError(f"{what} has zero size ({width} x {height})")
    if width * height > max_pixels:
        raise ImageError(
            f"{what} is {width} x {height} = {width * height:,} pixels, above the limit of "
            f"{max_pixels:,}; downscale it first or raise max_pixels"
        )


@contextmanager
def _first_frame(image: Image.Image) -> Iterator[None]:
    """Animated images: decode frame 0, then put a caller's image back on its own frame."""
    frame = image.tell() if getattr(image, "is_animated", False) else 0
    if frame:
        image.seek(0)
    try:
        yield
    finally:
        if frame:
            image.seek(frame)


def _pil_array(image: Image.Image, opts: _Options, what: str) -> np.ndarray:
    if image.mode in _WIDE_MODES:
        array = np.asarray(image)
        if image.mode == "I":  # 32-bit ints: PIL's mode for 16-bit files on some versions
            if array.size and (int(array.min()) < 0 or int(array.max()) > 65535):
                raise ImageError(f"{what} is 32-bit with values outside 0..65535")
            array = array.astype(np.uint16)
        return array_rgb(array, opts.background, what)
    if opts.background is not None and (image.mode in _ALPHA_MODES or "transparency" in image.info):
        return array_rgb(np.asarray(image.convert("RGBA")), opts.background, what)
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    return np.asarray(rgb, dtype=np.uint8)


def _from_pil(
    image: Image.Image, max_pixels: int, opts: _Options, what: str = "image"
) -> np.ndarray:
    _check_size(image.width, image.height, max_pixels, what)
    try:
        with _first_frame(image):
            out = _pil_array(image, opts, what)
            orientation = read_orientation(image) if opts.exif_orientation else 1
    except ImageError:
        raise
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt pixel data
        raise ImageError(f"cannot decode {what}: {exc}") from exc
    return upright(out, orientation, copy=True)


Decoded = tuple[np.ndarray, tuple[int, int] | None]  # pixels, the size as sent if reduced


Planned = tuple[Shrink, int, tuple[int, int]]  # how it decodes, orientation, upright size


def _planned(image: Image.Image, source: bytes | Path, opts: _Options) -> Planned:
    """How ``image`` decodes (``images/shrink.py``), its EXIF orientation as read from the
    header (1 where the header cannot tell: PIL then reads it as it decodes) and its upright
    (height, width)."""
    orientation = read_orientation(image) if opts.exif_orientation and tagged(image) else 1
    turned = orientation in (5, 6, 7, 8)
    upright_size = (image.width, image.height) if turned else (image.height, image.width)
    return plan_shrink(image, source, opts.fit, upright_size), orientation, upright_size


def _from_header(
    image: Image.Image,
    source: bytes | Path,
    planned: Planned,
    max_pixels: int,
    opts: _Options,
    what: str,
) -> Decoded:
    """An encoded image whose header PIL read, decoded as ``planned``: shrunk on load where
    its crops allow (``images/shrink.py``), decoded by libvips where it decodes this kind to
    PIL's pixels (``images/vips.py``), by PIL otherwise. The upright size as sent comes with
    the pixels when they were reduced."""
    plan, orientation, upright_size = planned
    pixels = shrink_on_load(image, source, plan)
    sent = upright_size if plan.how == "draft" or pixels is not None else None
    if pixels is None and plan.how != "draft":
        pixels = decode_pixels(image, source)
    if pixels is None:
        return _from_pil(image, max_pixels, opts, what), sent
    rgb = array_rgb(pixels, opts.background, what)
    return upright(rgb, orientation, copy=False), sent  # libvips' buffer is fresh: no copy


def _open_encoded(
    source: bytes | Path,
    max_pixels: int,
    opts: _Options,
    what: str,
    budget: DecodeBudget | None = None,
) -> Decoded:
    try:
        # reads the header only, trying the accepted formats' readers alone
        with Image.open(stream(source), formats=accepted_readers()) as image:
            _check_size(image.width, image.height, max_pixels, what)
            planned = _planned(image, source, opts)
            if budget is None:
                return _from_header(image, source, planned, max_pixels, opts, what)
            charge = budget.take(planned[0].peak_bytes(), what)
            try:
                pixels, sent = _from_header(image, source, planned, max_pixels, opts, what)
                return charge.settle(pixels), sent
            except BaseException:
                charge.release()
                raise
    except Image.DecompressionBombError as exc:
        raise ImageError(f"{what} is too large to decode safely: {exc}") from exc
    except ImageError:
        raise
    except UnidentifiedImageError as exc:
        raise ImageError(unaccepted(source, what)) from exc
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"cannot decode {what} as an image: {exc}") from exc


def _from_array(array: np.ndarray, max_pixels: int, opts: _Options) -> np.ndarray:
    if array.ndim >= 2 and array.size:
        _check_size(array.shape[1], array.shape[0], max_pixels, "image array")
    rgb = array_rgb(array, opts.background)
    return upright(rgb, 1, copy=True)


def _from_vips(image: Any, max_pixels: int, opts: _Options) -> np.ndarray:
    _check_size(image.width, image.height, max_pixels, "pyvips image")
    if image.format not in ("uchar", "ushort", "float", "double"):
        raise ImageError(
            f"pyvips image has format {image.format!r}; expected 'uchar' (0..255), 'ushort' "
            "(0..65535) or 'float' (0..1); convert first, e.g. image.cast('uchar')"
        )
    if image.interpretation == "cmyk":
        raise ImageError("pyvips image is CMYK; convert it with image.colourspace('srgb') first")
    if image.bands not in (1, 2, 3, 4):
        raise ImageError(f"pyvips image has {image.bands} bands; expected 1 to 4")
    try:
        if opts.exif_orientation and image.get_typeof("orientation"):
            image = image.autorot()  # applies and then drops the orientation tag
        array = image.numpy()
    except Exception as exc:  # libvips reports decode failures as pyvips.Error
        raise ImageError(f"cannot decode pyvips image: {exc}") from exc
    return _from_array(np.asarray(array), max_pixels, opts)


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


def load_image(
    image: ImageInput,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    exif_orientation: bool = True,
    background: Sequence[int] | None = WHITE,
    fit: Fit | None = None,
    budget: DecodeBudget | None = None,
) -> np.ndarray:
    """Decode/convert ``image`` to a new C-contiguous H x W x 3 uint8 RGB array, upright
    (unless ``exif_orientation=False``) with alpha composited on ``background`` (None: dropped).

    Encoded inputs (bytes, paths) larger than ``fit`` needs are reduced as they are decoded
    (``images/shrink.py``; None: decoded in full), and their decode holds its bytes of
    ``budget`` (``images/budget.py``; OverloadedError when it stays full) until the array is
    freed. The result never shares memory with the input. Raises ImageError for an unsupported
    type, corrupt or empty data, a missing file, a wrong dtype, value range or shape, or more
    than ``max_pixels``; ValueError for a bad ``background``.
    """
    return _load(image, max_pixels, _options(exif_orientation, background, fit), budget)[0]


def _load(
    image: ImageInput, max_pixels: int, opts: _Options, budget: DecodeBudget | None
) -> Decoded:
    if isinstance(image, Image.Image):
        return _from_pil(image, max_pixels, opts), None
    if isinstance(image, np.ndarray):
        return _from_array(image, max_pixels, opts), None
    if isinstance(image, (bytes, bytearray, memoryview)):
        if len(image) == 0:
            raise ImageError("image bytes are empty")
        return _open_encoded(bytes(image), max_pixels, opts, "image bytes", budget)
    if isinstance(image, (str, os.PathLike)):
        path = _path_of(image)
        return _open_encoded(path, max_pixels, opts, f"image file {path}", budget)
    if _is_vips(image):
        return _from_vips(image, max_pixels, opts), None
    raise ImageError(
        f"unsupported image type {type(image).__name__}: pass a PIL image, a numpy array, "
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
    if isinstance(image, Image.Image) or _is_vips(image):  # decoded with the default options
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
    # (height, width) of the picture as sent, upright, when it was reduced on decode
    # (images/shrink.py): its crops are planned for that size. None: the pixels' own size.
    sent_size: tuple[int, int] | None = None

    @property
    def plan_size(self) -> tuple[int, int]:
        """The (height, width) the crops' grid is chosen for: the picture as sent."""
        return self.sent_size if self.sent_size is not None else (self.height, self.width)

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])


def prepare_image(
    image: object,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    exif_orientation: bool = True,
    background: Sequence[int] | None = WHITE,
    fit: Fit | None = None,
    budget: DecodeBudget | None = None,
) -> PreparedImage:
    """Decode ``image`` (path, bytes, PIL, numpy, pyvips) as :func:`load_image` does and hash
    its pixels. A :class:`PreparedImage` is returned as it is (the options do not apply again).

    Raises :class:`~kestrel.errors.InvalidInputError` for anything that is not a usable image
    (unreadable, corrupt, empty, over ``max_pixels``, unsupported type or value range), and
    OverloadedError when ``budget`` stays full."""
    if isinstance(image, PreparedImage):
        return image
    opts = _options(exif_orientation, background, fit)  # a bad background: ValueError
    try:
        pixels, sent = _load(image, max_pixels, opts, budget)
    except ImageError as exc:
        raise InvalidInputError(f"bad image: {exc}") from exc
    except (OSError, ValueError, MemoryError) as exc:  # decoder errors PIL does not wrap
        raise InvalidInputError(f"bad image: {type(exc).__name__}: {exc}") from exc
    pixels.setflags(write=False)  # shared read-only between requests
    return PreparedImage(pixels, image_digest(pixels), sent)
