"""Images an engine has decoded before, known by their encoded bytes: a repeat is not decoded.

A caller that asks several questions about one image (a chart's questions, each turn of a
conversation that sends its image again) hands in the same encoded bytes each time. An image's
identity is the SHA-256 of its decoded pixels (docs/images.md), so every request used to pay a
decode and a hash of every pixel on the caller's thread before it was queued: ~3 ms for an
862 x 582 chart PNG on this project's 2-core VM, ~6 ms on a GPU host, time a lone request
waits for.

``KnownImages`` remembers, for the last ``capacity`` encoded images it prepared, the SHA-256 of
their bytes -> the digest and size their pixels got. The same bytes again become a
``DeferredImage``: that digest and size, no decode. Its pixels are decoded only if something
asks for them (its crops, when the cache no longer holds the image), on the thread that asks:
the crop pool's. The identity is unchanged: a deferred image's digest is the one its pixels
were given when the same bytes were decoded with the same options.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import numpy as np

from kestrel.images import DEFAULT_MAX_PIXELS, WHITE, PreparedImage, load_image, prepare_image
from kestrel.images.budget import DecodeBudget
from kestrel.images.shrink import Fit

__all__ = ["DeferredImage", "KnownImages"]

_KEY_PREFIX = b"kestrel-encoded:"  # the bytes' digest is a lookup key, never an identity


class DeferredImage(PreparedImage):
    """A :class:`PreparedImage` whose digest is known and whose pixels are decoded from its
    encoded bytes on first use (once, whichever thread asks first). Pickled (a Ray front door
    sending it to a replica), it travels as its encoded bytes and its decoder, not its pixels:
    the other side decodes only if it needs the crops."""

    __slots__ = ("_data", "_decode", "_lock", "_pixels", "_size")

    def __init__(
        self,
        digest: bytes,
        data: bytes,
        decode: Callable[[bytes], np.ndarray],
        size: tuple[int, int],
        sent_size: tuple[int, int] | None = None,
    ) -> None:
        fields = {"digest": digest, "_data": data, "_decode": decode, "_lock": threading.Lock(),
                  "_pixels": None, "_size": size, "sent_size": sent_size}  # fmt: skip
        for name, value in fields.items():  # frozen: set past the dataclass's guard
            object.__setattr__(self, name, value)

    @property
    def pixels(self) -> np.ndarray:  # type: ignore[override]
        with self._lock:
            if self._pixels is None:
                pixels = self._decode(self._data)
                if pixels.shape[:2] != self._size:  # the same bytes, the same options
                    raise RuntimeError(f"{self!r} decoded to {pixels.shape[:2]}")
                pixels.setflags(write=False)
                object.__setattr__(self, "_pixels", pixels)
            return self._pixels

    @property
    def decoded(self) -> bool:
        """Whether the pixels have been decoded (something needed them)."""
        return self._pixels is not None

    @property
    def width(self) -> int:
        return self._size[1]

    @property
    def height(self) -> int:
        return self._size[0]

    def __repr__(self) -> str:
        return f"DeferredImage({self.height}x{self.width}, digest={self.digest[:8].hex()})"

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return DeferredImage, (self.digest, self._data, self._decode, self._size, self.sent_size)


class KnownImages:
    """``prepare(image)`` = :func:`prepare_image` with these options, except that encoded bytes
    (or a file's) prepared before, among the last ``capacity``, come back deferred. Shared by
    the threads of one engine."""

    def __init__(
        self,
        capacity: int = 4096,
        *,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        exif_orientation: bool = True,
        background: Sequence[int] | None = WHITE,
        fit: Fit | None = None,
        budget: DecodeBudget | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._options = {"max_pixels": max_pixels, "exif_orientation": exif_orientation,
                         "background": background, "fit": fit}  # fmt: skip
        # a deferred image's later decode (on the crop pool's thread) is not charged: the
        # pool decodes one image at a time
        self._decode = partial(load_image, **self._options)
        self.budget = budget
        # bytes' key -> the pixels' digest, their size, the size as sent if they were reduced
        self._known: OrderedDict[bytes, tuple[bytes, tuple[int, int], tuple[int, int] | None]]
        self._known = OrderedDict()
        self._lock = threading.Lock()
        self.repeats = 0  # images that came back deferred

    def __len__(self) -> int:
        return len(self._known)

    def prepare(self, image: object) -> PreparedImage:
        data = _encoded(image)
        if data is None:  # decoded already (PIL, numpy, pyvips), prepared, or unreadable
            return prepare_image(image, budget=self.budget, **self._options)
        key = _key(data)
        with self._lock:
            known = self._known.get(key)
            if known is not None:
                self._known.move_to_end(key)
                self.repeats += 1
        if known is not None:
            return DeferredImage(known[0], data, self._decode, known[1], known[2])
        prepared = prepare_image(
            image, budget=self.budget, **self._options
        )  # raises for anything not an image
        with self._lock:
            size = (prepared.height, prepared.width)
            self._known[key] = (prepared.digest, size, prepared.sent_size)
            while len(self._known) > self.capacity:
                self._known.popitem(last=False)
        return prepared


def _encoded(image: object) -> bytes | None:
    """The encoded bytes of ``image`` (bytes-like, or a file path's contents), else None."""
    if isinstance(image, bytes):
        return image
    if isinstance(image, (bytearray, memoryview)):
        return bytes(image)  # a copy: the caller may change theirs after the call
    if isinstance(image, (str, Path)):
        try:
            return Path(image).expanduser().read_bytes()
        except (OSError, ValueError):  # prepare_image says what is wrong with the path
            return None
    return None


def _key(data: bytes) -> bytes:
    h = hashlib.sha256(_KEY_PREFIX)
    h.update(data)
    return h.digest()
