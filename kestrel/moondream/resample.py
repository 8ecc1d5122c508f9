"""libvips' lanczos3 resize of a uint8 RGB image as integer tensor arithmetic, on any device.

Moondream's crops come from ``pyvips.Image.resize`` (``crops.py``): on a GPU host that is
~9 ms of host work per new image, on the critical path of a lone request. This module makes
the same bytes with torch on the device the encoder runs on. libvips resizes an 8-bit image
with fixed-point integer arithmetic (coefficients in 1/4096ths, positions in 1/64ths of a
pixel), so a copy of its arithmetic gives its exact output, not an approximation:

- an axis that shrinks runs ``reducev`` / ``reduceh``: a lanczos3 mask of ``2 * rint(3 s) + 1``
  taps per output pixel (``s`` the shrink), the sum rounded and clipped to 0..255; past twice
  the reduce gap (a 4x shrink: a side over ~1,500 pixels for a 378-pixel global crop) a box
  average over ``floor(s / 2)`` pixels comes first, as libvips' ``shrinkv`` / ``shrinkh`` make
  it (a multiply by ~2^24 / box and the top 8 bits of 32), and the mask reduces what is left;
- an axis that grows runs through ``affine`` with the bicubic (Catmull-Rom) interpolator: four
  taps a row, rounded, then four a column, rounded and clipped; when one axis grows, the other
  goes through the same interpolator at its own scale (1.0 after a reduce), as libvips does.

Every pass is a gather of source rows (or columns) and an int32 weighted sum: no float
rounding anywhere on the device. The tables (source positions and coefficients) are computed
on the host in float64, the same expressions in the same order as libvips 8.18 (``resample/
resize.c``, ``reducev.cpp``, ``reduceh.cpp``, ``shrinkv.c``, ``shrinkh.c``, ``affine.c``,
``bicubic.cpp``, and their Highway kernels for uchar), and cached per axis.
``tests/unit/test_resample.py`` checks the bytes against the installed pyvips, and the runtime
checks them again at start-up (``device_disagrees``) before it trusts a device with them.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch

from kestrel.moondream.crops import CropGeometry, crop_geometry, overlap_crops

if TYPE_CHECKING:
    from kestrel.moondream.config import VisionConfig

__all__ = [
    "AxisPass",
    "CropPlan",
    "ResizePlan",
    "crop_plan",
    "device_disagrees",
    "make_crops",
    "resize",
    "resize_plan",
]

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
    index: np.ndarray  # int64 [n_out, taps]: source positions, edges repeated
    weight: np.ndarray  # int32 [n_out, taps]
    clip: bool
    key: tuple  # what made the tables (their device copies are kept by it)
    box: int = 0


@dataclass(frozen=True, slots=True, eq=False)
class ResizePlan:
    """The passes that resize an image to ``size`` (height, width); ``natural``: the size
    libvips' operations end at (cut or padded with zeros to ``size``, as ``crops._fit``)."""

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


def _table_index(pos: float) -> int:
    """The mask for position ``pos``: its fraction rounded to the nearest 1/64 (0..64)."""
    return ((int(pos * _POSITIONS * 2) & (_POSITIONS * 2 - 1)) + 1) >> 1


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
    table = [_mask(taps, shrink, float(t) / _POSITIONS) for t in range(_POSITIONS + 1)]
    edge = math.ceil(taps / 2.0) - 1
    index = np.empty((n_out, taps), np.int64)
    weight = np.empty((n_out, taps), np.int32)
    pos = 0.5 * shrink - 0.5 - offset
    for i in range(n_out):
        if not across:
            pos = (i + 0.5) * shrink - 0.5 - offset
        start = int(pos) - edge
        index[i] = np.arange(start, start + taps)
        weight[i] = table[_table_index(pos)]
        pos += shrink
    np.clip(index, 0, n_in - 1, out=index)
    return box, boxed, (index, weight)


@lru_cache(maxsize=256)
def _bicubic(n_in: int, n_out: int, step: float, across: bool) -> tuple[np.ndarray, np.ndarray]:
    """Index and weight tables of libvips' affine with the bicubic interpolator along one
    axis, ``step`` source pixels per output pixel (``across``: x, whose position adds up)."""
    table = [_catmull(float(t) / _POSITIONS) for t in range(_POSITIONS + 1)]
    index = np.empty((n_out, 4), np.int64)
    weight = np.empty((n_out, 4), np.int32)
    pos = 0.0 * step + 0.5 + 1  # ia * 0, less idx (0.5 - 1), plus the window offset
    for i in range(n_out):
        if not across:
            pos = step * float(i) + 0.5 + 1
        start = int(pos) - 3  # the 4 x 4 window's first tap, less the 2-pixel border
        index[i] = np.arange(start, start + 4)
        weight[i] = table[_table_index(pos)]
        pos += step
    np.clip(index, 0, n_in - 1, out=index)
    return index, weight


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
            passes.append(AxisPass(axis, *boxed, clip=False, key=(*key, "box"), box=box))
        passes.append(AxisPass(axis, *tables, clip=True, key=key))
        h, w = (len(tables[0]), w) if axis == 0 else (h, len(tables[0]))
    if hscale > 1.0 or vscale > 1.0:
        a = hscale if hscale > 1.0 else 1.0
        d = vscale if vscale > 1.0 else 1.0
        tmp = 1.0 / (a * d - 0.0 * 0.0)
        ia, id_ = tmp * d, tmp * a
        n_w, n_h = _round_int(a * w), _round_int(d * h)
        across, down = (w, n_w, ia, True), (h, n_h, id_, False)
        passes.append(AxisPass(1, *_bicubic(*across), clip=False, key=("bicubic", *across)))
        passes.append(AxisPass(0, *_bicubic(*down), clip=True, key=("bicubic", *down)))
        h, w = n_h, n_w
    return ResizePlan(tuple(passes), (out_height, out_width), (h, w))


def _round_int(x: float) -> int:
    return int(x + 0.5) if x > 0 else int(x - 0.5)


def resize(pixels: torch.Tensor, plan: ResizePlan) -> torch.Tensor:
    """``pixels`` (uint8 [H, W, 3], any device) resized by ``plan``: uint8 [*plan.size, 3],
    byte for byte what libvips makes. Each pass adds its taps one at a time (a gather and a
    multiply-add each), so the only temporaries are the size of the pass's output."""
    x = pixels
    for p in plan.passes:
        index, weight = _on(p, pixels.device)
        shape = [1, 1, 1]
        shape[p.axis] = index.shape[1]
        acc = x.index_select(p.axis, index[0]) * weight[0].view(shape)  # int32
        for k in range(1, index.shape[0]):
            acc.addcmul_(x.index_select(p.axis, index[k]), weight[k].view(shape))
        if p.box:  # libvips' average: a multiply by ~2^24 / box in 32 bits, the top 8 bits
            scale = (1 << 32) // (256 * p.box)
            x = acc.add_(p.box // 2).to(torch.int64).mul_(scale).bitwise_and_(0xFFFFFFFF)
            x = torch.bitwise_right_shift(x, 24, out=x).to(torch.int32)
            continue
        x = torch.bitwise_right_shift(acc.add_(_ONE // 2), 12, out=acc)  # floor, as C's >>
        if p.clip:
            x.clamp_(0, 255)
    out = x.to(torch.uint8)
    (h, w), (nh, nw) = plan.size, plan.natural
    if (nh, nw) == (h, w):
        return out
    fitted = torch.zeros((h, w, 3), dtype=torch.uint8, device=pixels.device)
    fitted[: min(h, nh), : min(w, nw)] = out[:h, :w]
    return fitted


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


def crop_plan(height: int, width: int, config: VisionConfig) -> CropPlan:
    """How a ``height`` x ``width`` image's crops are made on a device."""
    g = crop_geometry(height, width, config)
    return CropPlan(
        g, resize_plan(height, width, g.crop, g.crop), resize_plan(height, width, *g.resized)
    )


def make_crops(pixels: torch.Tensor, plan: CropPlan) -> torch.Tensor:
    """The crops of ``pixels`` (uint8 [H, W, 3]) on its device: uint8 [N, crop, crop, 3],
    channels last, index 0 the global crop, then the local crops row-major; the bytes of
    ``crops.overlap_crops``."""
    g = plan.geometry
    out = torch.empty((g.n_crops, g.crop, g.crop, 3), dtype=torch.uint8, device=pixels.device)
    out[0] = resize(pixels, plan.whole)
    resized = resize(pixels, plan.local)
    s0, s1, s2 = resized.stride()
    windows = resized.as_strided(
        (g.rows, g.cols, g.crop, g.crop, 3), (g.window * s0, g.window * s1, s0, s1, s2)
    )
    out[1:].view(g.rows, g.cols, g.crop, g.crop, 3).copy_(windows)
    return out


_DEVICE_TABLES: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
_DEVICE_TABLES_KEPT = 512
_DEVICE_TABLES_LOCK = threading.Lock()


def _on(p: AxisPass, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``p``'s tables on ``device``, tap-major ([taps, n_out]): uploaded once, the last 512
    used kept."""
    key = (*p.key, str(device))
    with _DEVICE_TABLES_LOCK:
        found = _DEVICE_TABLES.get(key)
        if found is not None:
            _DEVICE_TABLES.move_to_end(key)
            return found
    found = tuple(torch.from_numpy(t.T.copy()).to(device) for t in (p.index, p.weight))
    with _DEVICE_TABLES_LOCK:
        _DEVICE_TABLES[key] = found
        while len(_DEVICE_TABLES) > _DEVICE_TABLES_KEPT:
            _DEVICE_TABLES.popitem(last=False)
    return found


# Images whose crops take every kind of pass: both axes grown, both shrunk, one of each, and
# both box-shrunk first (the global crop of a 1600 x 2000 image).
_PROBES = ((480, 640), (960, 1280), (700, 500), (1600, 2000))


def device_disagrees(config: VisionConfig, device: torch.device | str) -> str | None:
    """Why ``device`` cannot be trusted with crops (its bytes differ from this process's
    libvips on a probe image), or None when they are the same for every probe."""
    rng = np.random.default_rng(0)
    for height, width in _PROBES:
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        plan = crop_plan(height, width, config)
        made = make_crops(torch.from_numpy(pixels).to(device), plan).cpu().numpy()
        expected = overlap_crops(pixels, config).crops
        if made.shape != expected.shape or not np.array_equal(made, expected):
            wrong = int((made != expected).sum()) if made.shape == expected.shape else -1
            return (
                f"a {height} x {width} image's crops differ from libvips' "
                f"({wrong} of {expected.size} values)"
            )
    return None
