"""Moondream's crops made on the device the encoder runs on: libvips' bytes, as tensors.

The plans of ``resample.py`` (which source pixels each pass of a resize reads, with which
integer weights) run here as matrix products: each pass's weights, scaled by 1/4096 (a power
of two), in a dense matrix, the rounding libvips adds as the product's bias, then a floor and
libvips' clip. Every product and partial sum is a whole number of 1/4096ths below 2^24, which
float32 holds exactly, so no float is ever rounded and the result cannot depend on the GPU or
the order of its sums (float64 where PyTorch is allowed TF32 or bf16 products; a box average,
which libvips makes with a 32-bit reciprocal, always in float64). The image is made planar
once, [H, 3, W]: a row pass multiplies it as [H, 3W], a column pass as [3H, W], no transposes.
The matrices are built on the device from the tables (two small uploads through the pinned
ring per image size) and the last 64 MB of them are kept.

``tests/unit/test_resample.py`` checks the bytes against the installed pyvips, and the
runtime checks them again at start-up (``device_disagrees``) before it trusts a device with
them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from kestrel.crops.overlap import overlap_crops
from kestrel.crops.resample import AxisPass, CropPlan, ResizePlan, crop_plan
from kestrel.crops.stages import kernel_plan
from kestrel.moondream.vision import normalize_pixels, normalize_planar, pixel_table
from kestrel_kernels import pinned
from kestrel_kernels.fused import fused_backend
from kestrel_kernels.transfer import upload
from kestrel_kernels.triton_resample import resample_crops

if TYPE_CHECKING:
    from kestrel.moondream.config import VisionConfig

__all__ = ["device_disagrees", "encoder_crops", "make_crops", "resize"]


def resize(pixels: torch.Tensor, plan: ResizePlan) -> torch.Tensor:
    """``pixels`` (uint8 [H, W, 3], any device) resized by ``plan``: uint8 [*plan.size, 3],
    byte for byte what libvips makes."""
    x = _planar(pixels)
    resized = _resized(x, plan, _matrices(plan.passes, x.device, x.dtype))
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


def _resized(x: torch.Tensor, plan: ResizePlan, matrices: list[torch.Tensor]) -> torch.Tensor:
    """``x`` ([H, 3, W] floats) through ``plan``'s passes: [*plan.size] as [h, 3, w], whole
    numbers 0..255. Each pass is one matrix product with the pass's weights in a dense matrix
    and libvips' rounding added as its bias (exact: every product and partial sum is a whole
    number of 1/4096ths below 2^24), floored (``floor(y + 1/2)``: libvips' ``(sum + 2048) >>
    12``) and clipped where libvips clips; a box average in float64 (libvips multiplies by
    ~2^24 / box in 32 bits)."""
    for p, m in zip(plan.passes, matrices, strict=True):
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


def _crops(pixels: torch.Tensor, plan: CropPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The global crop [crop, 3, crop] and the strided view of the local crops [rows, cols, 3,
    crop, crop] in the resized copy, both as whole-number floats."""
    g = plan.geometry
    x = _planar(pixels)
    n = len(plan.whole.passes)  # a new size's matrices built together
    matrices = _matrices(plan.whole.passes + plan.local.passes, x.device, x.dtype)
    whole = _resized(x, plan.whole, matrices[:n])
    resized = _resized(x, plan.local, matrices[n:])  # [h, 3, w]
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
    out = torch.empty((g.n_crops, g.crop, g.crop, 3), dtype=torch.uint8, device=pixels.device)
    if _kernel_runs(pixels.device):
        return _kernel_crops(pixels, plan, out, None)
    whole, windows = _crops(pixels, plan)
    out[0].copy_(whole.permute(0, 2, 1))
    out[1:].view(g.rows, g.cols, g.crop, g.crop, 3).copy_(windows.permute(0, 1, 3, 4, 2))
    return out


def encoder_crops(
    pixels: torch.Tensor, plan: CropPlan, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The vision encoder's input from ``pixels`` (uint8 [H, W, 3]) on its device: the crops of
    ``make_crops``, normalized as ``vision.normalize_pixels`` normalizes them, [N, 3, crop,
    crop] in ``dtype``, written into ``out`` when given (the encoder's own input buffer).
    Where the Triton kernel runs (``kestrel_kernels.triton_resample``) that is one launch per
    step of the resizes (2 for most images), else the torch matrix products below (an 800 x
    600 chart's 9 crops: 17 launches in bfloat16)."""
    g = plan.geometry
    shape = (g.n_crops, 3, g.crop, g.crop)
    if out is not None and (tuple(out.shape) != shape or out.dtype != dtype
                            or not out.is_contiguous()):  # fmt: skip
        raise ValueError(f"the crops go to a contiguous {dtype} {shape}, not {out.dtype} "
                         f"{tuple(out.shape)}")  # fmt: skip
    if _kernel_runs(pixels.device):
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=pixels.device)
        return _kernel_crops(pixels, plan, out, _pixel_lut(pixels.device))
    whole, windows = _crops(pixels, plan)
    made = torch.empty(shape, dtype=torch.bfloat16, device=pixels.device)
    made[0].copy_(whole.permute(1, 0, 2))  # whole numbers 0..255: exact in bfloat16
    made[1:].view(g.rows, g.cols, 3, g.crop, g.crop).copy_(windows)
    made = normalize_planar(made, dtype)
    return made if out is None else out.copy_(made)


def _kernel_runs(device: torch.device) -> bool:
    """Whether the crops are cut by the Triton kernel: where the fused ops are Triton's."""
    return fused_backend(device) == "triton"


def _kernel_crops(
    pixels: torch.Tensor, plan: CropPlan, out: torch.Tensor, lut: torch.Tensor | None
) -> torch.Tensor:
    """``out`` filled by ``triton_resample.resample_crops``: the image size's tables and
    stage rows uploaded once (``_matrices``' keeping), then one launch per step."""
    height, width, _ = pixels.shape
    kp = kernel_plan(plan, height, width)
    tables = _kept(
        ("stages", height, width, plan.geometry, str(pixels.device)),
        lambda: upload(torch.from_numpy(kp.array), torch.int32, pixels.device),
    )
    if kp.short:  # a resize ends short of its size: libvips' zeros there
        out.fill_(0 if lut is None else float(_PIXEL_TABLE[0]))
    image = pixels if pixels.is_contiguous() else pixels.contiguous()
    resample_crops(image, tables, kp.desc_at, kp.steps, kp.scratch_size, out, lut)
    return out


_PIXEL_TABLE = pixel_table()


def _pixel_lut(device: torch.device) -> torch.Tensor:
    """``vision.pixel_table`` on ``device`` (uploaded once)."""
    return _kept(
        ("pixel table", str(device)),
        lambda: upload(torch.from_numpy(_PIXEL_TABLE), torch.float32, device),
    )


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
        scaled = [oriented[j][1] * passes[todo[j]].scale for j in mine]
        for j, w in zip(mine, _upload_all(scaled, t, device), strict=True):
            weights[j] = w
    for j, i in enumerate(todo):
        p, n_out = passes[i], len(passes[i].index)
        shape = (p.n_in, n_out) if p.axis == 1 else (n_out, p.n_in)
        m = torch.zeros(shape, dtype=types[i], device=device)
        found[i] = m.scatter_add_(p.axis ^ 1, indexes[j], weights[j])  # repeated edges add up
        _keep(keys[i], m)
    return found


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
    full = _kept(key, lambda: torch.full((_BIAS_LENGTH,), value, dtype=like.dtype,
                                         device=like.device))  # fmt: skip
    return full[:n]


def _kept(key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The tensor kept under ``key`` (marked lately used), else ``make()``'s, kept."""
    with _MATRICES_LOCK:
        found = _MATRICES.get(key)
        if found is not None:
            _MATRICES.move_to_end(key)
            return found
    made = make()
    _keep(key, made)
    return made


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
    libvips on a probe image, or it cannot make them), or None when they are the same for
    every probe. The first probe's encoder input (bfloat16) is checked too, which also
    builds the Triton kernel's forms before the first request."""
    rng = np.random.default_rng(0)
    for i, (height, width) in enumerate(_PROBES):
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        plan = crop_plan(height, width, config)
        try:
            image = torch.from_numpy(pixels).to(device)
            made = make_crops(image, plan).cpu().numpy()
            normalized = encoder_crops(image, plan, torch.bfloat16) if i == 0 else None
        except Exception as exc:  # a device without a dtype or an op we use, a Triton that
            # cannot build the kernel for it: the host makes the crops instead
            return f"the device cannot make a {height} x {width} image's crops: {exc!r}"
        expected = overlap_crops(pixels, config).crops
        if made.shape != expected.shape or not np.array_equal(made, expected):
            wrong = int((made != expected).sum()) if made.shape == expected.shape else -1
            return (
                f"a {height} x {width} image's crops differ from libvips' "
                f"({wrong} of {expected.size} values)"
            )
        if normalized is not None and not torch.equal(
            normalized.cpu(), normalize_pixels(expected, torch.bfloat16, "cpu")
        ):
            return f"a {height} x {width} image's encoder input differs from the host's"
    return None
