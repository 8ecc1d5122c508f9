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

Every pass is one matrix product with the pass's integer weights (scaled by 1/4096, a power of
two) in a dense matrix: every product and partial sum is then a whole number of 1/4096ths below
2^24, which float32 holds exactly, so no float is ever rounded and the result cannot depend on
the GPU or the order of its sums (float64 where PyTorch is allowed TF32 or bf16 products). The
tables (source positions and coefficients) are computed
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
from kestrel.moondream.vision import normalize_planar
from kestrel_kernels import pinned
from kestrel_kernels.transfer import upload

if TYPE_CHECKING:
    from kestrel.moondream.config import VisionConfig

__all__ = [
    "AxisPass",
    "CropPlan",
    "ResizePlan",
    "crop_plan",
    "device_disagrees",
    "encoder_crops",
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
    n_in: int
    index: np.ndarray  # int64 [n_out, taps]: source positions, edges repeated
    weight: np.ndarray  # int32 [n_out, taps]
    clip: bool
    key: tuple  # what made the tables (their device matrices are kept by it)
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
    table = np.array([_mask(taps, shrink, t / _POSITIONS) for t in range(_POSITIONS + 1)], np.int32)
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


def resize(pixels: torch.Tensor, plan: ResizePlan) -> torch.Tensor:
    """``pixels`` (uint8 [H, W, 3], any device) resized by ``plan``: uint8 [*plan.size, 3],
    byte for byte what libvips makes."""
    resized = _resized(_planar(pixels), plan)
    return resized.permute(0, 2, 1).to(torch.uint8, memory_format=torch.contiguous_format)


def _exact() -> torch.dtype:
    """The float type whose matrix products are exact here: float32 while they run in IEEE
    float32 (PyTorch's default), float64 where TF32 or bf16 products are allowed."""
    if torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32:
        return torch.float64
    return torch.float32


def _planar(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 [H, W, 3] as floats [H, 3, W] (one copy): a resize's row pass multiplies it as
    [H, 3W], its column pass as [3H, W], so no pass needs a transpose."""
    height, width, _ = pixels.shape
    out = torch.empty((height, 3, width), dtype=_exact(), device=pixels.device)
    return out.copy_(pixels.permute(0, 2, 1))


def _resized(x: torch.Tensor, plan: ResizePlan) -> torch.Tensor:
    """``x`` ([H, 3, W] floats) through ``plan``'s passes: [*plan.size] as [h, 3, w], whole
    numbers 0..255. Each pass is one matrix product with the pass's weights in a dense matrix
    and libvips' rounding added as its bias (exact: every product and partial sum is a whole
    number of 1/4096ths below 2^24), floored (``floor(y + 1/2)``: libvips' ``(sum + 2048) >>
    12``) and clipped where libvips clips; a box average in float64 (libvips multiplies by
    ~2^24 / box in 32 bits)."""
    for p, m in zip(plan.passes, _matrices(plan.passes, x.device, x.dtype), strict=True):
        height, _, width = x.shape
        wide = x.to(torch.float64) if p.box else x
        rounding = (p.box // 2) * ((1 << 24) // p.box) / (1 << 24) if p.box else 0.5
        if p.axis == 0:  # [n_out, H] @ [H, 3W]
            flat = wide.view(height, 3 * width)
            y = torch.addmm(_bias(rounding, flat.shape[1], m), m, flat).view(-1, 3, width)
        else:  # [3H, W] @ [W, n_out] (the matrix is kept transposed)
            y = torch.addmm(_bias(rounding, m.shape[1], m), wide.view(3 * height, width), m)
            y = y.view(height, 3, -1)
        x = y.floor_() if y.dtype == x.dtype else y.floor_().to(x.dtype)  # a box: from float64
        if p.clip:
            x.clamp_(0, 255)
    (h, w), (nh, nw) = plan.size, plan.natural
    if (nh, nw) == (h, w):
        return x
    fitted = x.new_zeros((h, 3, w))
    fitted[: min(h, nh), :, : min(w, nw)] = x[:h, :, :w]
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


def _crops(pixels: torch.Tensor, plan: CropPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The global crop [crop, 3, crop] and the strided view of the local crops [rows, cols, 3,
    crop, crop] in the resized copy, both as whole-number floats."""
    g = plan.geometry
    x = _planar(pixels)
    _matrices(plan.whole.passes + plan.local.passes, x.device, x.dtype)  # a new size: together
    whole = _resized(x, plan.whole)
    resized = _resized(x, plan.local)  # [h, 3, w]
    s0, s1, s2 = resized.stride()
    windows = resized.as_strided(
        (g.rows, g.cols, 3, g.crop, g.crop), (g.window * s0, g.window * s2, s1, s0, s2)
    )
    return whole, windows


def make_crops(pixels: torch.Tensor, plan: CropPlan) -> torch.Tensor:
    """The crops of ``pixels`` (uint8 [H, W, 3]) on its device: uint8 [N, crop, crop, 3],
    channels last, index 0 the global crop, then the local crops row-major; the bytes of
    ``crops.overlap_crops``."""
    g = plan.geometry
    whole, windows = _crops(pixels, plan)
    out = torch.empty((g.n_crops, g.crop, g.crop, 3), dtype=torch.uint8, device=pixels.device)
    out[0].copy_(whole.permute(0, 2, 1))
    out[1:].view(g.rows, g.cols, g.crop, g.crop, 3).copy_(windows.permute(0, 1, 3, 4, 2))
    return out


def encoder_crops(pixels: torch.Tensor, plan: CropPlan, dtype: torch.dtype) -> torch.Tensor:
    """The vision encoder's input from ``pixels`` (uint8 [H, W, 3]) on its device: the crops of
    ``make_crops``, normalized as ``vision.normalize_pixels`` normalizes them, [N, 3, crop,
    crop] in ``dtype``, written channel-major straight from the resized copies. An 800 x 600
    chart's 9 crops are 17 kernel launches in bfloat16."""
    g = plan.geometry
    whole, windows = _crops(pixels, plan)
    out = torch.empty((g.n_crops, 3, g.crop, g.crop), dtype=torch.bfloat16, device=pixels.device)
    out[0].copy_(whole.permute(1, 0, 2))  # whole numbers 0..255: exact in bfloat16
    out[1:].view(g.rows, g.cols, 3, g.crop, g.crop).copy_(windows)
    return normalize_planar(out, dtype)


_MATRICES: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_MATRIX_BYTES = 64 << 20  # kept on each device, the least lately used let go first
_MATRICES_LOCK = threading.Lock()


def _matrices(
    passes: tuple[AxisPass, ...], device: torch.device, dtype: torch.dtype
) -> list[torch.Tensor]:
    """Each pass's weights as a dense matrix on ``device``, [n_out, n_in] (a column pass:
    [n_in, n_out], as its product takes it), scaled to 1/4096ths of a whole (a box pass:
    libvips' 32-bit reciprocal of the box, in float64), kept while they fit
    ``_MATRIX_BYTES``. Those not kept are built on the device together: their tables in one
    upload of positions and one of weights per float type (``_upload_all``), then a fill and
    a scatter each."""
    types = [torch.float64 if p.box else dtype for p in passes]
    keys = [(*p.key, str(device), t) for p, t in zip(passes, types, strict=True)]
    with _MATRICES_LOCK:
        found = [_MATRICES.get(k) for k in keys]
        for k, m in zip(keys, found, strict=True):
            if m is not None:
                _MATRICES.move_to_end(k)
    todo = [i for i, m in enumerate(found) if m is None]
    if not todo:
        return found
    oriented = [(passes[i].index.T, passes[i].weight.T) if passes[i].axis else
                (passes[i].index, passes[i].weight) for i in todo]  # fmt: skip
    indexes = _upload_all([t[0] for t in oriented], torch.int64, device)
    weights: list[torch.Tensor | None] = [None] * len(todo)
    for t in set(types[i] for i in todo):
        mine = [j for j, i in enumerate(todo) if types[i] == t]
        scaled = [oriented[j][1] * _scale(passes[todo[j]]) for j in mine]
        for j, w in zip(mine, _upload_all(scaled, t, device), strict=True):
            weights[j] = w
    for j, i in enumerate(todo):
        p, n_out = passes[i], len(passes[i].index)
        shape = (p.n_in, n_out) if p.axis == 1 else (n_out, p.n_in)
        m = torch.zeros(shape, dtype=types[i], device=device)
        found[i] = m.scatter_add_(p.axis ^ 1, indexes[j], weights[j])  # repeated edges add up
        _keep(keys[i], m)
    return found


def _scale(p: AxisPass) -> float:
    """What a pass's integer weights are multiplied by: 2^-12, or for a box libvips'
    reciprocal ``floor(2^24 / box) / 2^24`` (both exact in float64)."""
    return ((1 << 24) // p.box) / (1 << 24) if p.box else 1.0 / _ONE


def _upload_all(arrays: list[np.ndarray], dtype: torch.dtype, device: torch.device) -> list:
    """``arrays`` on ``device`` as ``dtype``: one upload through the pinned ring while they
    fit a slot together, else one each; the device tensors are views of what was uploaded."""
    host = [np.ascontiguousarray(a, _NUMPY[dtype]) for a in arrays]
    if sum(a.nbytes for a in host) > pinned.SLOT_BYTES:
        return [upload(torch.from_numpy(a), dtype, device) for a in host]
    flat = upload(torch.from_numpy(np.concatenate([a.ravel() for a in host])), dtype, device)
    out, at = [], 0
    for a in host:
        out.append(flat[at : at + a.size].view(a.shape))
        at += a.size
    return out


_NUMPY = {torch.int64: np.int64, torch.float32: np.float32, torch.float64: np.float64}


_BIAS_LENGTH = 1 << 16  # the longest bias a product takes: 3 x a 21,845-pixel side


def _bias(value: float, n: int, like: torch.Tensor) -> torch.Tensor:
    """A [n] vector of ``value`` on ``like``'s device and dtype: the first ``n`` of one kept
    vector per value (made once, not per image size)."""
    if n > _BIAS_LENGTH:
        return torch.full((n,), value, dtype=like.dtype, device=like.device)
    key = ("bias", value, str(like.device), like.dtype)
    with _MATRICES_LOCK:
        found = _MATRICES.get(key)
        if found is not None:
            _MATRICES.move_to_end(key)
            return found[:n]
    bias = torch.full((_BIAS_LENGTH,), value, dtype=like.dtype, device=like.device)
    _keep(key, bias)
    return bias[:n]


def _keep(key: tuple, tensor: torch.Tensor) -> None:
    with _MATRICES_LOCK:
        _MATRICES[key] = tensor
        while sum(t.nbytes for t in _MATRICES.values()) > _MATRIX_BYTES and len(_MATRICES) > 1:
            _MATRICES.popitem(last=False)


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
