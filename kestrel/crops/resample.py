"""libvips' lanczos3 resize of a uint8 RGB image as tables of integer weights (numpy only).

Moondream's crops come from ``pyvips.Image.resize`` (``overlap.py``): on a GPU host that is
~9 ms of host work per new image, on the critical path of a lone request, so a CUDA runtime
makes the same bytes on the GPU (``device.py``). libvips resizes an 8-bit image with
fixed-point integer arithmetic (coefficients in 1/4096ths, positions in 1/64ths of a pixel), so
a copy of its arithmetic gives its exact output, not an approximation. This module is that
copy's host half: what each pass of a resize reads and with which integer weights.

- an axis that shrinks runs ``reducev`` / ``reduceh``: a lanczos3 mask of ``2 * rint(3 s) + 1``
  taps per output pixel (``s`` the shrink), the sum rounded and clipped to 0..255; past twice
  the reduce gap (a 4x shrink: a side over ~1,500 pixels for a 378-pixel global crop) a box
  average over ``floor(s / 2)`` pixels comes first, as libvips' ``shrinkv`` / ``shrinkh`` make
  it (a multiply by ~2^24 / box and the top 8 bits of 32), and the mask reduces what is left;
- an axis that grows runs through ``affine`` with the bicubic (Catmull-Rom) interpolator: four
  taps a row, rounded, then four a column, rounded and clipped; when one axis grows, the other
  goes through the same interpolator at its own scale (1.0 after a reduce), as libvips does.

The tables (source positions and weights) are computed in float64 with the same expressions in
the same order as libvips 8.18 (``resample/resize.c``, ``reducev.cpp``, ``reduceh.cpp``,
``shrinkv.c``, ``shrinkh.c``, ``affine.c``, ``bicubic.cpp``, and their Highway kernels for
uchar), and cached per axis. ``tests/unit/test_resample.py`` checks the bytes against the
installed pyvips.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from kestrel.crops.overlap import CropGeometry, crop_geometry

if TYPE_CHECKING:
    from kestrel.moondream.config import VisionConfig

__all__ = ["AxisPass", "CropPlan", "ResizePlan", "crop_plan", "resize_plan"]

_POSITIONS = 64  # VIPS_TRANSFORM_SCALE: sub-pixel positions of a mask table
_ONE = 4096  # VIPS_INTERPOLATE_SCALE: a coefficient of 1.0
_GAP = 2.0  # vips_resize's default reduce gap


@dataclass(frozen=True, slots=True, eq=False)
class AxisPass:
    """One pass along ``axis`` (0: rows, 1: columns): output pixel i is
    ``(sum_k weight[i, k] * source[index[i, k]] + 2048) >> 12``, clipped to 0..255 where
    ``clip`` (the end of a libvips operation); a ``box`` pass (libvips' shrink by ``box``
    pixels) is the sum of its taps, averaged as libvips averages it."""

    axis: int
    n_in: int
    index: np.ndarray  # int64 [n_out, taps]: source positions, edges repeated
    weight: np.ndarray  # int32 [n_out, taps]
    clip: bool
    key: tuple  # what made the tables (their device matrices are kept by it)
    box: int = 0

    @property
    def scale(self) -> float:
        """What the integer weights are multiplied by: 2^-12, or for a box libvips'
        reciprocal ``floor(2^24 / box) / 2^24`` (both exact in float64)."""
        return ((1 << 24) // self.box) / (1 << 24) if self.box else 1.0 / _ONE


@dataclass(frozen=True, slots=True, eq=False)
class ResizePlan:
    """The passes that resize an image to ``size`` (height, width); ``natural``: the size
    libvips' operations end at (cut or padded with zeros to ``size``, as ``crops._resized``)."""

    passes: tuple[AxisPass, ...]
    size: tuple[int, int]
    natural: tuple[int, int]


def _lanczos3(x: float) -> float:
    if not -3.0 <= x <= 3.0:
        return 0.0
    return _sinc(x) * _sinc(x / 3)


def _sinc(x: float) -> float:
    if x == 0.0:
        return 1.0
    x = x * math.pi
    return math.sin(x) / x


def _mask(taps: int, shrink: float, x: float) -> list[int]:
    """libvips' lanczos3 mask for sub-pixel offset ``x``: normalized to sum 1, then truncated
    to 1/4096ths (a C cast to short)."""
    half = x + taps / 2.0 - 1
    c = [_lanczos3((i - half) / shrink) for i in range(taps)]
    total = 0.0
    for v in c:
        total += v
    return [int(v / total * _ONE) for v in c]


def _masks(taps: int, shrink: float) -> np.ndarray:
    """``_mask`` for each of the 65 sub-pixel offsets t / 64, int32 [65, taps], computed with
    numpy: the same float64 expressions in the same order, but numpy's sine may differ from
    libm's in the last bit, so a row with a weight within 1e-6 of a nonzero whole 1/4096th
    (where a last-bit difference could move its truncation) is made again by ``_mask``."""
    half = np.arange(_POSITIONS + 1) / _POSITIONS + taps / 2.0 - 1
    x = (np.arange(taps)[None, :] - half[:, None]) / shrink
    weights = np.where((x >= -3.0) & (x <= 3.0), _np_sinc(x) * _np_sinc(x / 3), 0.0)
    scaled = weights / np.cumsum(weights, axis=1)[:, -1:] * _ONE  # sums added left to right
    table = scaled.astype(np.int32)  # truncated, as a C cast
    edge = (np.abs(scaled - np.round(scaled)) < 1e-6) & (np.abs(scaled) > 0.5)  # near 0: 0
    for t in np.flatnonzero(edge.any(axis=1)):
        table[t] = _mask(taps, shrink, t / _POSITIONS)
    return table


def _np_sinc(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        xp = x * math.pi
        return np.where(x == 0.0, 1.0, np.sin(xp) / xp)


def _catmull(x: float) -> list[int]:
    """libvips' Catmull-Rom coefficients for offset ``x``, truncated to 1/4096ths."""
    cr1 = 1.0 - x
    cr2 = -0.5 * x
    cr3 = cr1 * cr2
    cone = cr1 * cr3
    cfou = x * cr3
    cr4 = cfou - cone
    ctwo = cr1 - cone + cr4
    cthr = x - cfou - cr4
    return [int(c * _ONE) for c in (cone, ctwo, cthr, cfou)]


def _tables(
    pos: np.ndarray, first: int, taps: int, table: np.ndarray, n_in: int
) -> tuple[np.ndarray, np.ndarray]:
    """Index and weight tables for float64 positions ``pos`` (one an output pixel): taps from
    ``int(pos) - first`` on, edges repeated, weighted by the mask for the position's fraction
    rounded to the nearest 1/64 (``(int(pos * 128) & 127) + 1 >> 1``, as libvips: 0..64)."""
    start = pos.astype(np.int64) - first  # a C cast: positions are never negative
    index = np.clip(start[:, None] + np.arange(taps), 0, n_in - 1)
    sub = (((pos * (_POSITIONS * 2)).astype(np.int64) & (_POSITIONS * 2 - 1)) + 1) >> 1
    return index, table[sub]


def _positions(first: float, step: float, n: int, across: bool, direct: np.ndarray) -> np.ndarray:
    """Output pixels' source positions: ``direct`` (each computed on its own), or, ``across``
    a row, added up from ``first`` one ``step`` at a time, as libvips' row loops do (a
    cumulative sum adds left to right, so the float64 rounding is the same)."""
    if not across:
        return direct
    steps = np.full(n, step)
    steps[0] = first
    return np.cumsum(steps)


Tables = tuple[np.ndarray, np.ndarray]


@lru_cache(maxsize=256)
def _reduce(n_in: int, shrink: float, across: bool) -> tuple[int, Tables | None, Tables]:
    """libvips' reduce of ``n_in`` pixels by ``shrink`` (``across``: reduceh, whose position
    adds up along the row): (box, its tables or None, the lanczos3 mask's tables). Past twice
    the gap libvips first box-shrinks by ``box`` pixels (rounding the length up, the last pixel
    repeated), then reduces what is left."""
    n_out = int(n_in / shrink + 0.5)
    extra = n_out * shrink - n_in
    box = max(1, math.floor(n_in / n_out / _GAP))
    boxed = None
    if box > 1:
        n_mid = math.ceil(n_in / box)
        index = np.minimum(np.arange(n_mid * box).reshape(n_mid, box), n_in - 1)
        boxed = (index, np.ones((n_mid, box), np.int32))
        n_in, extra, shrink = n_mid, extra / box, shrink / box
    offset = (1 + extra) / 2.0 - 1
    taps = int(2 * np.rint(3 * shrink) + 1)
    table = _masks(taps, shrink)
    direct = (np.arange(n_out) + 0.5) * shrink - 0.5 - offset
    pos = _positions(0.5 * shrink - 0.5 - offset, shrink, n_out, across, direct)
    return box, boxed, _tables(pos, math.ceil(taps / 2.0) - 1, taps, table, n_in)


_CATMULL = np.array([_catmull(t / _POSITIONS) for t in range(_POSITIONS + 1)], np.int32)


@lru_cache(maxsize=256)
def _bicubic(n_in: int, n_out: int, step: float, across: bool) -> Tables:
    """Index and weight tables of libvips' affine with the bicubic interpolator along one
    axis, ``step`` source pixels per output pixel (``across``: x, whose position adds up).
    A position is ``step * i`` less the input offset (-0.5, less the 1-pixel border) plus the
    window offset (1); the window's first tap is one before it, 2 more for the border."""
    direct = step * np.arange(n_out, dtype=np.float64) + 0.5 + 1
    pos = _positions(0.0 * step + 0.5 + 1, step, n_out, across, direct)
    return _tables(pos, 3, 4, _CATMULL, n_in)


def resize_plan(height: int, width: int, out_height: int, out_width: int) -> ResizePlan:
    """How libvips resizes a ``height`` x ``width`` image to ``out_height`` x ``out_width``
    (``resize(out_width / width, vscale=out_height / height)``, lanczos3)."""
    if min(height, width, out_height, out_width) < 1:
        raise ValueError(f"cannot resize {height} x {width} to {out_height} x {out_width}")
    hscale = max(out_width / width, 1.0 / width)
    vscale = max(out_height / height, 1.0 / height)
    passes: list[AxisPass] = []
    h, w = height, width
    for axis, scale in ((0, vscale), (1, hscale)):
        if scale >= 1.0:
            continue
        n_in, shrink = (h if axis == 0 else w), 1.0 / scale
        box, boxed, tables = _reduce(n_in, shrink, axis == 1)
        key = ("reduce", n_in, shrink, axis)
        if boxed is not None:
            passes.append(AxisPass(axis, n_in, *boxed, clip=False, key=(*key, "box"), box=box))
            n_in = len(boxed[0])
        passes.append(AxisPass(axis, n_in, *tables, clip=True, key=key))
        h, w = (len(tables[0]), w) if axis == 0 else (h, len(tables[0]))
    if hscale > 1.0 or vscale > 1.0:
        a = hscale if hscale > 1.0 else 1.0
        d = vscale if vscale > 1.0 else 1.0
        tmp = 1.0 / (a * d - 0.0 * 0.0)
        ia, id_ = tmp * d, tmp * a
        n_w, n_h = _round_int(a * w), _round_int(d * h)
        across, down = (w, n_w, ia, True), (h, n_h, id_, False)
        passes.append(AxisPass(1, w, *_bicubic(*across), clip=False, key=("bicubic", *across)))
        passes.append(AxisPass(0, h, *_bicubic(*down), clip=True, key=("bicubic", *down)))
        h, w = n_h, n_w
    return ResizePlan(tuple(passes), (out_height, out_width), (h, w))


def _round_int(x: float) -> int:
    return int(x + 0.5) if x > 0 else int(x - 0.5)


@dataclass(frozen=True, slots=True, eq=False)
class CropPlan:
    """How one image's crops are made on a device: the global crop (``whole``) and the
    resized copy the local crops are cut from (``local``), as ``crops.overlap_crops``."""

    geometry: CropGeometry
    whole: ResizePlan
    local: ResizePlan

    @property
    def tiling(self) -> tuple[int, int]:
        return (self.geometry.rows, self.geometry.cols)


@lru_cache(maxsize=1024)
def crop_plan(
    height: int, width: int, config: VisionConfig, plan_size: tuple[int, int] | None = None
) -> CropPlan:
    """How a ``height`` x ``width`` image's crops are made on a device (kept per size), on the
    grid of a ``plan_size`` picture (its size as sent, when it was reduced on decode)."""
    g = crop_geometry(*(plan_size or (height, width)), config)
    return CropPlan(
        g, resize_plan(height, width, g.crop, g.crop), resize_plan(height, width, *g.resized)
    )
