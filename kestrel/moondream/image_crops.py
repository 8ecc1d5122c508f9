"""Overlapping crops of an image for the vision tower, and their pixel normalization.

Moondream 2 sees an image as one global crop (the whole image squashed to crop x crop) plus up
to ``max_crops`` local crops cut from an upscaled copy. Each local crop keeps a margin of
``overlap_margin`` patches on every side that overlaps its neighbours; only its centre window of
``grid_side - 2 * overlap_margin`` patches is new (architecture doc section 2).

Resampling is libvips lanczos3 through ``pyvips.Image.resize(hscale, vscale=...)`` on the uint8
array, the call the reference makes, so the crops are byte-identical to the reference's (the
fixture's PNG crops check this). Pixel normalization reproduces the reference's bfloat16
arithmetic whatever the model dtype (design doc section 5.6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyvips
import torch

from .config import VisionConfig

__all__ = ["CropError", "OverlapCrops", "normalize_pixels", "overlap_crops", "select_tiling"]


class CropError(ValueError):
    """Pixels the crop pipeline cannot take (wrong type, bands or dtype)."""


def select_tiling(height: int, width: int, crop_size: int, max_crops: int) -> tuple[int, int]:
    """(rows, cols) of local crops for an image area of ``height`` x ``width`` pixels.

    ``crop_size`` is the crop's window (its non-overlapping centre), and height/width are the
    image size minus both margins, as the reference calls it. Reproduces the reference rule
    exactly, including its float arithmetic: small sides give (1, 1); otherwise tiles follow the
    aspect ratio, at least ceil(side / window) per side, at most ``max_crops`` in total.
    """
    if max_crops < 1:
        raise ValueError(f"max_crops must be >= 1, got {max_crops}")
    if height <= crop_size or width <= crop_size:
        return (1, 1)
    min_h = math.ceil(height / crop_size)
    min_w = math.ceil(width / crop_size)
    if min_h * min_w > max_crops:
        # Even the minimum does not fit: shrink both sides by the same factor.
        ratio = math.sqrt(max_crops / (min_h * min_w))
        return (max(1, math.floor(min_h * ratio)), max(1, math.floor(min_w * ratio)))
    rows = max(math.floor(math.sqrt(max_crops * height / width)), min_h)
    cols = max(math.floor(math.sqrt(max_crops * width / height)), min_w)
    if rows * cols > max_crops:  # trim the longer side back under the budget
        if cols > rows:
            cols = math.floor(max_crops / rows)
        else:
            rows = math.floor(max_crops / cols)
    return (max(1, rows), max(1, cols))


@dataclass(frozen=True, slots=True, eq=False)
class OverlapCrops:
    """``crops`` uint8 [N, crop, crop, 3] (read-only): index 0 the global crop, then the local
    crops row-major (index 1 + i * cols + j); ``tiling`` = (rows, cols), N = 1 + rows * cols."""

    crops: np.ndarray
    tiling: tuple[int, int]

    @property
    def n_crops(self) -> int:
        return self.crops.shape[0]


def _as_vips(image: np.ndarray | pyvips.Image) -> pyvips.Image:
    if isinstance(image, pyvips.Image):
        if image.format != "uchar" or image.bands != 3:
            raise CropError(
                f"overlap_crops needs a 3-band uchar image, got {image.bands} band(s) of "
                f"{image.format!r}; pass it through load_image first"
            )
        return image
    if not isinstance(image, np.ndarray):
        raise CropError(f"overlap_crops takes a numpy array or pyvips image, not {type(image)}")
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or image.size == 0:
        raise CropError(
            f"overlap_crops needs a non-empty H x W x 3 uint8 array, got {image.dtype} "
            f"{image.shape}; pass it through load_image first"
        )
    return pyvips.Image.new_from_array(np.ascontiguousarray(image))


def _resize(image: pyvips.Image, height: int, width: int) -> np.ndarray:
    # Independent horizontal/vertical scales (aspect not preserved), libvips' default lanczos3.
    resized = image.resize(width / image.width, vscale=height / image.height)
    return np.asarray(resized.numpy(), dtype=np.uint8).reshape(resized.height, resized.width, -1)


def _paste(dst: np.ndarray, src: np.ndarray) -> None:
    # libvips hits the requested size for every geometry we tried; should it ever round one
    # down, the reference leaves the missing edge zero, and so does this.
    dst[: src.shape[0], : src.shape[1]] = src[: dst.shape[0], : dst.shape[1]]


def overlap_crops(
    image: np.ndarray | pyvips.Image, config: VisionConfig, *, max_crops: int | None = None
) -> OverlapCrops:
    """The global crop and the overlapping local crops of an H x W x 3 uint8 RGB image.

    ``max_crops`` overrides ``config.max_crops`` (tests and experiments only).
    """
    vips = _as_vips(image)
    crop = config.crop_size
    margin_px = config.overlap_margin * config.enc_patch_size
    window = (config.grid_side - 2 * config.overlap_margin) * config.enc_patch_size
    rows, cols = select_tiling(
        vips.height - 2 * margin_px,
        vips.width - 2 * margin_px,
        window,
        config.max_crops if max_crops is None else max_crops,
    )
    crops = np.zeros((1 + rows * cols, crop, crop, 3), dtype=np.uint8)
    _paste(crops[0], _resize(vips, crop, crop))
    resized = _resize(vips, rows * window + 2 * margin_px, cols * window + 2 * margin_px)
    for i in range(rows):
        for j in range(cols):
            y0, x0 = i * window, j * window
            _paste(crops[1 + i * cols + j], resized[y0 : y0 + crop, x0 : x0 + crop])
    crops.flags.writeable = False
    return OverlapCrops(crops=crops, tiling=(rows, cols))


def normalize_pixels(
    crops_u8: np.ndarray | torch.Tensor,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """uint8 crops [N, H, W, 3] -> [N, 3, H, W] in [-1, 1], cast to ``dtype`` on ``device``.

    The arithmetic is the reference's: uint8 -> bfloat16, then /255, -0.5, /0.5 with every step
    rounded to bfloat16, whatever ``dtype`` is; the 256 possible results are the fixture's
    ``pixel_lut``. The uint8 data moves to the device before widening (4x less to copy).
    """
    if isinstance(crops_u8, np.ndarray):
        # torch cannot wrap a read-only array (OverlapCrops.crops is one): copy the uint8 data.
        array = crops_u8 if crops_u8.flags.writeable else crops_u8.copy()
        crops = torch.from_numpy(array)
    else:
        crops = crops_u8
    if crops.dtype != torch.uint8 or crops.ndim != 4 or crops.shape[-1] != 3:
        raise CropError(
            f"expected uint8 crops [N, H, W, 3], got {crops.dtype} {tuple(crops.shape)}"
        )
    x_NHWC = crops.to(device=device)
    x_NCHW = x_NHWC.permute(0, 3, 1, 2)
    x_NCHW = x_NCHW.to(torch.bfloat16).div(255.0).sub(0.5).div(0.5)
    return x_NCHW.to(dtype).contiguous()
