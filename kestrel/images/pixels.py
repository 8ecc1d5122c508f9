"""Pixels in any of the accepted dtypes and channel counts to 8-bit RGB: 16-bit scaled, floats
read as 0..1, gray replicated, alpha composited on a background (docs/images.md's table)."""

from __future__ import annotations

import numpy as np

__all__ = ["ImageError", "array_rgb"]


class ImageError(ValueError):
    """An image that cannot be used: unreadable, empty, too large, or of an unsupported kind."""


def _to_uint8(array: np.ndarray, what: str) -> np.ndarray:
    """uint8 as is; uint16 scaled 65535 -> 255 (rounded); float read as 0..1."""
    if array.dtype == np.uint8:
        return array
    if array.dtype.kind == "u" and array.dtype.itemsize == 2:  # either byte order
        return ((array.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)
    if array.dtype.kind == "f":
        if not np.isfinite(array).all():
            raise ImageError(f"{what} ({array.dtype}) holds NaN or infinite values")
        low, high = float(array.min()), float(array.max())
        if low < 0.0 or high > 1.0:
            raise ImageError(
                f"{what} is {array.dtype} with values in [{low:g}, {high:g}]; float images are "
                "read as 0..1 (divide by 255 first if it holds 0..255)"
            )
        return np.rint(array.astype(np.float32) * 255.0).astype(np.uint8)
    raise ImageError(
        f"{what} has dtype {array.dtype}; expected uint8 (0..255), uint16 (0..65535) or "
        "float (0..1)"
    )


def _composite(rgb: np.ndarray, alpha: np.ndarray, background: tuple[int, int, int]) -> np.ndarray:
    """``rgb`` over ``background`` by ``alpha`` (H x W x 1), rounded; opaque pixels unchanged."""
    a = alpha.astype(np.uint16)
    colour = np.asarray(background, dtype=np.uint16)
    return ((rgb.astype(np.uint16) * a + colour * (255 - a) + 127) // 255).astype(np.uint8)


def array_rgb(
    array: np.ndarray, background: tuple[int, int, int] | None, what: str = "image array"
) -> np.ndarray:
    if array.size == 0:
        raise ImageError(f"{what} is empty (shape {array.shape})")
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in (1, 2, 3, 4):
        raise ImageError(
            f"{what} has shape {array.shape}; expected H x W or H x W x C with C in 1..4"
        )
    array = _to_uint8(array, what)
    channels = array.shape[2]
    # Gray (+ alpha): replicate the gray channel; RGB(A): keep RGB.
    rgb = np.repeat(array[:, :, :1], 3, axis=2) if channels <= 2 else array[:, :, :3]
    if channels in (2, 4) and background is not None:
        rgb = _composite(rgb, array[:, :, channels - 1 :], background)
    return rgb
