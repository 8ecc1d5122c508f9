"""Overlapping crops, the host half of Moondream's vision tower (numpy and pyvips only).

One global crop (the whole image squashed to crop x crop) plus up to ``max_crops`` local crops
cut from an upscaled copy. Each local crop keeps a margin of ``overlap_margin`` patches on
every side that overlaps its neighbours; only its centre window of
``grid_side - 2 * overlap_margin`` patches is new. Resampling is libvips lanczos3 through
``pyvips.Image.resize(hscale, vscale=...)`` on the uint8 array, the call the reference makes,
so the crops are byte-identical to the reference's (the fixture's PNG crops check this).

Per image there are two resizes (each one libvips call that renders its whole result) and one
array copy that cuts every local crop out of the upscaled copy at once. This module imports
neither torch nor the rest of kestrel (its one kestrel name, ``VisionConfig``, is a type only):
the crop worker process (``worker.py``) imports it, and nothing else of kestrel, without them
(``tests/unit/test_crop_worker_imports.py`` holds it to that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyvips

if TYPE_CHECKING:
    from kestrel.moondream.config import VisionConfig

__all__ = [
    "CropError",
    "CropGeometry",
    "CropPart",
    "OverlapCrops",
    "PartRenders",
    "check_pixels",
    "crop_geometry",
    "crop_parts",
    "lut_image",
    "overlap_crops",
    "part_renders",
    "select_tiling",
    "vips_image",
    "write_crops",
    "write_part",
]


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


@dataclass(frozen=True, slots=True)
class CropGeometry:
    """Where the crops of one image come from: the local crops are the ``rows`` x ``cols``
    windows, ``window`` pixels apart, of the image resized to ``resized`` (height, width)."""

    crop: int  # side of every crop, pixels
    margin: int  # overlap margin, pixels
    window: int  # a local crop's new centre, pixels
    rows: int
    cols: int

    @property
    def n_crops(self) -> int:
        return 1 + self.rows * self.cols

    @property
    def resized(self) -> tuple[int, int]:
        return (
            self.rows * self.window + 2 * self.margin,
            self.cols * self.window + 2 * self.margin,
        )


@dataclass(frozen=True, slots=True)
class CropPart:
    """Some of an image's crops, made on their own: the global crop (``whole``) and the pixel
    rows ``top <= y < bottom`` of the upscaled copy the local crops are cut from (the rows of
    every local crop that lie there). Parts of one image write disjoint pixels, so they can run
    at once (one worker each)."""

    whole: bool
    top: int
    bottom: int


# What a part costs, in units of one band pixel made by shrinking (resampling a pixel of the
# resized copy and copying it into its crops). Measured with libvips 8.18 on an AMD EPYC, one
# thread, the crop worker's pipelines kept across images (``scripts/bench_crop_parts.py``): a
# band pixel costs ~4.4 ns when the copy shrinks the source, ~20 ns when it enlarges it in
# either direction (libvips then resamples through an affine transform: a 700 x 700 image's
# 910 x 910 copy takes 16 ms, a 1280 x 960 one's 3.2 ms). The global crop (always a shrink but
# for tiny images) costs ~0.15 of a unit per source pixel and ~1.0 per crop pixel: 1.3-1.4 ms
# for a 1280 x 960 source. Fitted so that a 1280 x 960 image's two parts, each timed alone in
# a worker, come out equal (2.5 ms each; 4.7 ms whole). A pipeline built for a new image size
# adds ~0.35 ms of libvips set-up per render, so the first part (two renders) runs ~0.35 ms
# longer on an image size its worker has not seen.
ENLARGED_BAND_PIXEL = 4.4
GLOBAL_PER_SOURCE_PIXEL = 0.15
GLOBAL_PER_CROP_PIXEL = 1.0


def crop_parts(g: CropGeometry, n: int, source: tuple[int, int] = (0, 0)) -> list[CropPart]:
    """Up to ``n`` parts that together make every crop of ``g``, about equal in work: bands
    of the resized copy's rows, the first one shortened by the global crop's work (it makes
    that crop too). ``source``: the image's height and width, which set that work."""
    height, width = g.resized
    k = max(1, min(n, height))
    enlarged = height > source[0] or width > source[1]
    per_row = width * (ENLARGED_BAND_PIXEL if enlarged else 1.0)
    whole = GLOBAL_PER_SOURCE_PIXEL * source[0] * source[1] + GLOBAL_PER_CROP_PIXEL * g.crop**2
    total = whole + height * per_row
    edges = [0]
    for i in range(1, k):  # band i ends where i / k of the work is done
        edges.append(min(height, max(edges[-1], round((total * i / k - whole) / per_row))))
    edges.append(height)
    parts = [CropPart(i == 0, edges[i], edges[i + 1]) for i in range(k)]
    return [p for p in parts if p.whole or p.bottom > p.top]


def crop_geometry(
    height: int, width: int, config: VisionConfig, max_crops: int | None = None
) -> CropGeometry:
    """The crop geometry of a ``height`` x ``width`` image (``max_crops`` overrides the
    config's, for tests and experiments)."""
    margin = config.overlap_margin * config.enc_patch_size
    window = (config.grid_side - 2 * config.overlap_margin) * config.enc_patch_size
    rows, cols = select_tiling(
        height - 2 * margin,
        width - 2 * margin,
        window,
        config.max_crops if max_crops is None else max_crops,
    )
    return CropGeometry(config.crop_size, margin, window, rows, cols)


@dataclass(frozen=True, slots=True, eq=False)
class OverlapCrops:
    """``crops`` uint8 [N, crop, crop, 3] (read-only): index 0 the global crop, then the local
    crops row-major (index 1 + i * cols + j); ``tiling`` = (rows, cols), N = 1 + rows * cols."""

    crops: np.ndarray
    tiling: tuple[int, int]

    @property
    def n_crops(self) -> int:
        return self.crops.shape[0]


def vips_image(image: np.ndarray | pyvips.Image) -> pyvips.Image:
    """``image`` as a 3-band uchar vips image; CropError for anything else."""
    if isinstance(image, pyvips.Image):
        if image.format != "uchar" or image.bands != 3:
            raise CropError(
                f"overlap_crops needs a 3-band uchar image, got {image.bands} band(s) of "
                f"{image.format!r}; pass it through load_image first"
            )
        return image
    return pyvips.Image.new_from_array(check_pixels(image))


def check_pixels(image: object) -> np.ndarray:
    """``image`` as a C-contiguous H x W x 3 uint8 array; CropError for anything else."""
    if not isinstance(image, np.ndarray):
        raise CropError(f"overlap_crops takes a numpy array or pyvips image, not {type(image)}")
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or image.size == 0:
        raise CropError(
            f"overlap_crops needs a non-empty H x W x 3 uint8 array, got {image.dtype} "
            f"{image.shape}; pass it through load_image first"
        )
    return np.ascontiguousarray(image)


def lut_image(lut: np.ndarray) -> pyvips.Image:
    """A 256-entry float32 table as the one-band vips image ``maplut`` takes."""
    table = np.ascontiguousarray(lut, dtype=np.float32)
    if table.shape != (256,):
        raise CropError(f"a pixel table has 256 entries, got shape {table.shape}")
    return pyvips.Image.new_from_memory(table.tobytes(), 256, 1, 1, "float")


def _resized(
    image: pyvips.Image,
    height: int,
    width: int,
    lut: pyvips.Image | None,
    area: tuple[int, int, int, int] | None = None,
) -> pyvips.Image:
    """The libvips image of ``image`` resized to ``height`` x ``width`` (independent scales,
    lanczos3), through ``lut`` if given; nothing is computed until it is rendered. ``area`` =
    (top, left, h, w) keeps only that rectangle of the result (libvips computes what it is
    asked for; the pixels are those of the whole render)."""
    out = image.resize(width / image.width, vscale=height / image.height)
    if out.width != width or out.height != height:
        # libvips hits the requested size for every geometry we tried; should it ever miss,
        # the reference keeps the top-left corner and leaves any missing edge zero.
        out = out.embed(0, 0, width, height)
    if area is not None:
        top, left, height, width = area
        out = out.crop(left, top, width, height)
    return out.maplut(lut) if lut is not None else out


def _rendered(out: pyvips.Image, floats: bool) -> np.ndarray:
    """``out`` rendered in one libvips call: [height, width, 3] uint8 (float32: ``floats``)."""
    dtype = np.float32 if floats else np.uint8
    return np.frombuffer(out.write_to_memory(), dtype).reshape(out.height, out.width, 3)


def _windows(resized: np.ndarray, g: CropGeometry) -> np.ndarray:
    """A read-only view of the local crops in ``resized``: [rows, cols, crop, crop, 3]."""
    s0, s1, s2 = resized.strides
    shape = (g.rows, g.cols, g.crop, g.crop, 3)
    strides = (g.window * s0, g.window * s1, s0, s1, s2)
    return np.lib.stride_tricks.as_strided(resized, shape, strides, writeable=False)


def overlap_crops(
    image: np.ndarray | pyvips.Image,
    config: VisionConfig,
    *,
    max_crops: int | None = None,
    plan_size: tuple[int, int] | None = None,
) -> OverlapCrops:
    """The global crop and the overlapping local crops of an H x W x 3 uint8 RGB image, on
    the grid of a ``plan_size`` picture (its size as sent, when it was reduced on decode;
    None: the image's own).

    ``max_crops`` overrides ``config.max_crops`` (tests and experiments only).
    """
    vips = vips_image(image)
    size = plan_size or (vips.height, vips.width)
    g = crop_geometry(size[0], size[1], config, max_crops)
    crops = np.empty((g.n_crops, g.crop, g.crop, 3), dtype=np.uint8)
    crops[0] = _rendered(_resized(vips, g.crop, g.crop, None), False)
    local = crops[1:].reshape(g.rows, g.cols, g.crop, g.crop, 3)
    np.copyto(local, _windows(_rendered(_resized(vips, *g.resized, None), False), g))
    crops.flags.writeable = False
    return OverlapCrops(crops=crops, tiling=(g.rows, g.cols))


@dataclass(frozen=True, slots=True, eq=False)
class PartRenders:
    """What renders one part's crops (``part_renders``): the libvips images of its global crop
    (``whole``) and of its band of the resized copy (``band``), None where the part has none,
    both built on ``source``. Building them is ~0.35 ms of libvips set-up each, rendering a
    one-row band ~0.1 ms more; they can be rendered again, by one thread at a time, after
    the pixels in ``source``'s memory change: ``source.invalidate()`` first (the crop worker
    keeps them for its reused shared memory, ``worker.py``)."""

    source: pyvips.Image
    part: CropPart
    whole: pyvips.Image | None
    band: pyvips.Image | None
    floats: bool


def part_renders(
    image: pyvips.Image, g: CropGeometry, lut: pyvips.Image | None = None,
    part: CropPart | None = None,
) -> PartRenders:  # fmt: skip
    """The libvips images that make ``part`` of ``image``'s crops (all of them when None),
    uint8, or float32 through ``lut`` (256 entries, one per pixel value)."""
    height, width = g.resized
    part = part or CropPart(True, 0, height)
    whole = _resized(image, g.crop, g.crop, lut) if part.whole else None
    area = (part.top, 0, part.bottom - part.top, width)
    band = _resized(image, height, width, lut, area) if part.bottom > part.top else None
    return PartRenders(image, part, whole, band, lut is not None)


def write_part(renders: PartRenders, g: CropGeometry, out: np.ndarray) -> None:
    """Render ``renders`` into ``out`` [N, crop, crop, 3], channels last as libvips makes
    them (the device, or the encoder's patch cut, reorders them for free): the part's crops,
    the others left as they are. Every copy here moves whole crop rows (``crop * 3``
    contiguous values), not single channels."""
    want = (g.n_crops, g.crop, g.crop, 3)
    dtype = np.dtype(np.float32 if renders.floats else np.uint8)
    if out.shape != want or out.dtype != dtype or not out.flags.c_contiguous:
        raise CropError(
            f"crops need a C-contiguous {dtype} {want} array, got {out.dtype} {out.shape}"
        )
    part = renders.part
    if renders.whole is not None:
        np.copyto(out[0], _rendered(renders.whole, renders.floats))
    if renders.band is None:
        return
    band = _rendered(renders.band, renders.floats)
    local = out[1:].reshape(g.rows, g.cols, g.crop, g.crop, 3)
    for r in range(g.rows):  # the rows of tile row r inside the band
        a, b = max(part.top, r * g.window), min(part.bottom, r * g.window + g.crop)
        if a >= b:
            continue
        rows = band[a - part.top : b - part.top]
        for c in range(g.cols):
            x = c * g.window
            local[r, c, a - r * g.window : b - r * g.window] = rows[:, x : x + g.crop]


def write_crops(
    image: pyvips.Image,
    g: CropGeometry,
    out: np.ndarray,
    lut: pyvips.Image | None = None,
    part: CropPart | None = None,
) -> None:
    """Write the crops of ``image`` into ``out`` [N, crop, crop, 3] (``write_part``): uint8,
    or float32 mapped through ``lut``. ``part``: only those crops (``crop_parts``)."""
    write_part(part_renders(image, g, lut, part), g, out)
